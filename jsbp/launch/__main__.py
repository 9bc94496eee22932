"""``python -m jsbp.launch``: see ``jsbp.launch``."""

import sys

from . import main

sys.exit(main())
