"""Registration points through which the outer packages plug into the core.

The core (``_sbp``, ``_placement``, ``_layout``, ``_boxing``, ``_tensor``, ``_lower``, ``_jit``,
``rules`` ...) never imports ``viz``, ``flax``, ``pipeline``, ``checkpoint``, ``distributed`` or
``launch`` (``tests/test_layering.py`` checks it). What it needs from them it looks up here, and
they (or ``jsbp/__init__.py``, on their behalf) register it:

- ``html_renderers``: ``"tensor"`` / ``"placement"`` / ``"plan"`` -> ``f(obj) -> str`` (HTML), used
  by ``_repr_html_`` (``jsbp.viz``).
- ``multiprocess``: the cross-process helpers ``numpy()``, ``to_global`` and ``from_local`` call when
  ``jax.process_count() > 1`` (``jsbp.distributed``): ``spans_all_processes``,
  ``one_device_per_process``, ``send_blocks``, ``nearest_sources``, ``gather_local_meta``.
"""

from __future__ import annotations

import html as _html
from collections.abc import Callable

html_renderers: dict[str, Callable[[object], str]] = {}
multiprocess: dict[str, Callable] = {}


def render_html(kind: str, obj) -> str:
    """The registered HTML of ``obj``; a preformatted ``str(obj)`` if no renderer is registered or
    its package cannot be imported."""
    fn = html_renderers.get(kind)
    if fn is not None:
        try:
            return fn(obj)
        except ImportError:
            pass
    return f"<pre>{_html.escape(str(obj))}</pre>"


def multiprocess_fn(name: str) -> Callable:
    """The registered cross-process helper ``name`` (registered when ``jsbp`` is imported)."""
    try:
        return multiprocess[name]
    except KeyError:
        raise RuntimeError(
            f"jsbp: no multi-process helper {name!r} is registered; it is registered by "
            "jsbp.distributed when `import jsbp` runs. Import jsbp (not only its submodules) before "
            "running on several processes."
        ) from None
