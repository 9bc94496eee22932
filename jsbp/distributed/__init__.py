"""Many processes, many machines: jsbp on JAX's own distributed runtime.

Start the processes with ``python -m jsbp.launch --nproc-per-node N script.py`` (or ``torchrun``,
``srun``, ``mpirun``) and call ``jsbp.distributed.initialize()`` at the top of the script. From
then on a placement may name devices of every process (ranks are global JAX device ids, see
``jsbp.placement.all``) and every jsbp call is the same SPMD program on every process. See
``docs/distributed.md``.
"""

from ._config import Config as Config
from ._errors import DistributedError as DistributedError
from ._gather import allgather_json as allgather_json
from ._gather import allgather_local_shapes as allgather_local_shapes
from ._gather import gather_local_meta as gather_local_meta
from ._heartbeat import activity as activity
from ._heartbeat import heartbeat as heartbeat
from ._runtime import barrier as barrier
from ._runtime import config as config
from ._runtime import initialize as initialize
from ._runtime import is_initialized as is_initialized
from ._runtime import shutdown as shutdown
