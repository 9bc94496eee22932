"""Small host-side exchanges between processes, over JAX's own key-value store.

``from_local`` must learn the local shapes other processes hold before it can infer a logical
shape. That is a few integers, so it goes through the coordination service's key-value store
(the one ``jax.distributed`` starts), not through a compiled device collective: no compilation,
no device memory, and a clear error naming the missing process when one does not take part.

Every exchange is collective: every process calls it, in the same order. Keys are
``jsbp/<tag>/<call number>/<process>``; a process deletes its own key of call ``n - 2`` when it
makes call ``n``. That is safe: having read everyone's key of call ``n - 1``, it knows every
process has finished call ``n - 2``.
"""

from __future__ import annotations

import json

import numpy as np

from .._errors import SbpError
from ._errors import DistributedError
from ._heartbeat import activity
from ._runtime import _jax_distributed_state, _timeout_s, client

__all__ = ["allgather_json", "allgather_local_shapes", "gather_local_meta"]

_calls: dict[str, int] = {}


def allgather_json(obj, *, tag: str, what: str) -> list:
    """``obj`` (JSON-serialisable) from every process, in process order.

    ``tag`` names the exchange (one call counter per tag); ``what`` names the jsbp operation in
    errors. A single process gets ``[obj]`` back without any communication.
    """
    mine = json.loads(json.dumps(obj))
    c = client()
    st = _jax_distributed_state()
    n = st.num_processes if c is not None else 1
    if n == 1:
        return [mine]
    me = st.process_id
    call = _calls.get(tag, 0)
    _calls[tag] = call + 1
    if call >= 2:
        try:
            c.key_value_delete(f"jsbp/{tag}/{call - 2}/{me}")
        except Exception:  # noqa: BLE001 - cleanup only; a missing key is harmless
            pass
    c.key_value_set(f"jsbp/{tag}/{call}/{me}", json.dumps(mine))
    timeout = _timeout_s()
    out = []
    for p in range(n):
        if p == me:
            out.append(mine)
            continue
        key = f"jsbp/{tag}/{call}/{p}"
        try:
            with activity(f"{what}: waiting for process {p} (exchange {tag!r} #{call})"):
                raw = c.blocking_key_value_get(key, timeout * 1000)
        except Exception as e:  # JAX raises its runtime error type on timeout
            raise DistributedError(
                f"{what}: process {p} did not take part in call #{call} of this collective step within "
                f"{timeout} s (this is process {me} of {n}). {what} is collective: every process must "
                "call it, in the same order, even for tensors whose placement has none of its devices. "
                f"(JAX said: {str(e).splitlines()[0] if str(e) else type(e).__name__}; the wait is "
                "JSBP_DISTRIBUTED_TIMEOUT seconds.)"
            ) from None
        out.append(json.loads(raw))
    return out


def gather_local_meta(
    shapes: dict[int, tuple[int, ...]], dtype, n_devices: int, *, what: str = "from_local"
) -> tuple[dict[int, tuple[int, ...]], np.dtype]:
    """Merge every process's ``{flat device index: local shape}`` and local dtype.

    ``dtype`` is None on a process that holds no local array. Returns the shapes of all
    ``n_devices`` devices and the common dtype; raises ``SbpError`` when processes disagree or a
    device is covered twice or not at all.
    """
    mine = {
        "shapes": [[int(i), [int(x) for x in s]] for i, s in sorted(shapes.items())],
        "dtype": None if dtype is None else np.dtype(dtype).str,
    }
    parts = allgather_json(mine, tag="local_meta", what=what)
    out: dict[int, tuple[int, ...]] = {}
    owner: dict[int, int] = {}
    dtypes: dict[str, list[int]] = {}
    for p, part in enumerate(parts):
        if part["dtype"] is not None:
            dtypes.setdefault(part["dtype"], []).append(p)
        for i, s in part["shapes"]:
            if not 0 <= i < n_devices:
                raise SbpError(
                    f"{what}: process {p} reported a local array for device index {i}, but the placement "
                    f"has {n_devices} devices."
                )
            if i in out:
                raise SbpError(
                    f"{what}: processes {owner[i]} and {p} both gave a local array for device index {i} of "
                    "the placement; each device belongs to exactly one process."
                )
            out[i] = tuple(s)
            owner[i] = p
    missing = sorted(set(range(n_devices)) - set(out))
    if missing:
        raise SbpError(
            f"{what}: no process gave a local array for device index(es) {missing} of the placement "
            f"({n_devices} devices); every process must pass one array per device it owns."
        )
    if len(dtypes) > 1:
        by = "; ".join(f"{np.dtype(d).name} on process(es) {ps}" for d, ps in dtypes.items())
        raise SbpError(
            f"{what}: processes gave local arrays of different dtypes ({by}); use one dtype."
        )
    common = np.dtype(next(iter(dtypes))) if dtypes else None
    return out, common


def allgather_local_shapes(
    shapes: dict[int, tuple[int, ...]], n_devices: int
) -> dict[int, tuple[int, ...]]:
    """Every device's local shape, from each process's ``{flat device index: shape}``.

    Keys are flat device indices in placement order. Collective: every process calls it, in the
    same order; a single process gets its own dict back (checked for completeness).
    """
    return gather_local_meta(shapes, None, n_devices, what="allgather_local_shapes")[0]
