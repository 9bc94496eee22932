"""JAX interop: jsbp speaks JAX's own sharding vocabulary both ways.

* nd-sbp <-> ``NamedSharding``: ``split(d)`` on axis ``a`` puts ``a``'s name in spec entry ``d``
  (several axes on one dim: a tuple, outer axis first — OneFlow's "axis 0 cuts first"), ``B`` leaves
  the axis out, ``P`` is an ``unreduced`` axis. JAX allows ``unreduced`` only on ``Explicit`` mesh
  axes, so the shardings jsbp hands out live on an all-``Explicit`` copy of the placement's mesh
  (same devices, same axis names).
* ``jsbp.tensor(jax_array)`` / ``x.to_jax()`` (``_tensor``) use :func:`layout_of_array` /
  :func:`to_jax_array`: no copy for even ``S`` / ``B`` layouts (the arrays share their shard
  buffers).
* Inside ``jsbp.jit``, JAX's sharding calls are layout requests: ``reshard`` /
  ``sharding_constraint`` equations are annotations (``_problem.build`` reads them
  with :func:`requested_nd`), and :func:`lift_out_shardings` turns every ``out_sharding=`` /
  ``sharding=`` parameter (``jnp.dot(..., out_sharding=)``, ``jnp.zeros(..., out_sharding=)``,
  ``nnx.Linear(...)(x, out_sharding=)``) into a ``reshard`` after the equation. Mesh axes map to
  placement axes by name.
* ``jsbp.jit`` traces the user's function with its arguments typed by their layouts
  (:func:`typed_avals`; ``to_global`` results by their targets, :func:`retype`), so
  ``jax.typeof(x).sharding`` inside it is ``x``'s layout over the placement's ``Explicit`` mesh; a
  function JAX's explicit-sharding rules refuse is traced again untyped (:func:`trace_with_mesh`).
* jsbp runs its own programs with no context mesh (:func:`meshless`), so it works while a
  ``jax.set_mesh(...)`` context is active; an untyped trace runs under the user's context mesh (so
  ``PartitionSpec`` s resolve), or, if none is set and the function needs one, under an
  ``Explicit`` abstract mesh of the placement.
* ``x.to_jax()`` inside any JAX transformation is the plain logical value
  (:func:`under_transformation`), concrete tensors included.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import _sbp
from ._errors import PlacementError, SbpError
from ._layout import Layout, layout_of, normalise_nd
from ._placement import placement as Placement

__all__ = [
    "named_sharding",
    "explicit_mesh",
    "layout_of_array",
    "to_jax_array",
    "meshless",
    "requested_nd",
    "lift_out_shardings",
    "trace_with_mesh",
    "under_transformation",
    "typed_avals",
    "retype",
]


# -------------------------------------------------------------------------------------------
# nd-sbp <-> PartitionSpec
# -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def explicit_mesh(plc: Placement) -> Mesh:
    """The placement's devices and axis names as a ``Mesh`` whose axes are all ``Explicit`` (JAX
    allows ``unreduced`` only on those)."""
    return Mesh(plc.devices, plc.axis_names, axis_types=(AxisType.Explicit,) * plc.ndim)


def _spec(plc: Placement, nd, ndim: int, op: str) -> PartitionSpec:
    names = plc.axis_names
    bad = [x for x in nd if x.is_partial and x.reduce != "sum"]
    if bad:
        raise SbpError(
            f"{op}: {_sbp.nd_str(nd)} on {plc} has a {bad[0]} axis; JAX's sharding vocabulary has only a "
            "partial *sum* (`unreduced`). Box it first (x.to_global(sbp=...)) to S, B or P."
        )
    entries = []
    for d in range(ndim):
        axes = tuple(names[a] for a, x in enumerate(nd) if x.is_split and x.dim == d)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    unreduced = frozenset(names[a] for a, x in enumerate(nd) if x.is_partial)
    return PartitionSpec(*entries, unreduced=unreduced) if unreduced else PartitionSpec(*entries)


def named_sharding(placement: Placement, sbp, ndim: int) -> NamedSharding:
    """The ``NamedSharding`` of nd-sbp ``sbp`` for an ``ndim``-dim tensor on ``placement``.

    ``split(d)`` on axis ``a`` names ``a`` in spec entry ``d`` (several axes: a tuple, outer axis
    first), ``B`` leaves the axis out, ``P`` makes it ``unreduced``. The mesh has the placement's
    devices and axis names, all axes ``Explicit``:

    >>> jsbp.named_sharding(q, ("S(0)", "P"), 2).spec   # doctest: +SKIP
    PartitionSpec('dp', None, unreduced={'tp'})
    """
    if not isinstance(placement, Placement):
        raise SbpError(f"named_sharding: placement must be a jsbp.placement, got {placement!r}.")
    if isinstance(ndim, bool) or not isinstance(ndim, (int, np.integer)) or ndim < 0:
        raise SbpError(f"named_sharding: ndim must be a non-negative int, got {ndim!r}.")
    nd = normalise_nd(sbp, (1,) * int(ndim), placement, op="named_sharding")
    return NamedSharding(
        explicit_mesh(placement), _spec(placement, nd, int(ndim), "named_sharding")
    )


def _entry_axes(entry) -> tuple:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _mesh_axis_sizes(mesh) -> dict:
    return dict(
        zip(mesh.axis_names, mesh.axis_sizes if hasattr(mesh, "axis_sizes") else mesh.devices.shape)
    )


def _axis_index(plc: Placement, mesh, name, op: str, where: str) -> int:
    if name not in plc.axis_names:
        raise SbpError(
            f"{op}: {where} names mesh axis {name!r} (mesh axes {tuple(mesh.axis_names)}), which is not an "
            f"axis of the placement {plc} (axes {plc.axis_names}); mesh axes map to placement axes by name: "
            "build the placement with axis_names= matching the mesh, or use the placement's names in the spec."
        )
    a = plc.axis_names.index(name)
    size = _mesh_axis_sizes(mesh).get(name)
    if size is not None and size != plc.hierarchy[a]:
        raise SbpError(
            f"{op}: mesh axis {name!r} has size {size} but the placement {plc} has {plc.hierarchy[a]} devices "
            "on its axis of that name; the mesh and the placement must agree on every named axis."
        )
    return a


def spec_to_nd(
    spec: PartitionSpec,
    mesh,
    plc: Placement,
    ndim: int,
    *,
    op: str,
    keep=None,
    strict_order: bool = True,
) -> tuple:
    """The nd-sbp a ``PartitionSpec`` on ``mesh`` asks for on ``plc`` (axes mapped by name).

    ``keep``: per placement axis, True where the spec says nothing about it (the axis keeps its
    current SBP; the caller fills those in), else the axis gets ``B`` when the spec names it nowhere.
    ``strict_order``: a dim split over several axes must name them in placement order (jsbp cuts
    with the outer axis first); otherwise the order is the placement's.
    """
    parts = tuple(
        getattr(spec, "partitions", spec)
    )  # iterating a spec with unreduced axes is refused
    entries = list(parts) + [None] * (ndim - len(parts))
    if len(entries) > ndim:
        raise SbpError(
            f"{op}: the spec {spec} has {len(spec)} entries for a tensor of {ndim} dims."
        )
    nd: list = [None if keep is not None and keep[a] else _sbp.broadcast for a in range(plc.ndim)]
    for d, entry in enumerate(entries):
        axes = [_axis_index(plc, mesh, n, op, f"the spec {spec}") for n in _entry_axes(entry)]
        if strict_order and axes != sorted(axes):
            raise SbpError(
                f"{op}: the spec {spec} splits dim {d} over {_entry_axes(entry)}, inner axis first; jsbp cuts a "
                f"dim with the outer placement axis first (placement axes {plc.axis_names}), so that block "
                "order has no nd-sbp. Name the axes in placement order."
            )
        for a in axes:
            nd[a] = _sbp.split(d)
    for name in getattr(spec, "unreduced", ()) or ():
        nd[_axis_index(plc, mesh, name, op, f"the spec {spec}")] = _sbp.partial_sum
    for name in getattr(spec, "reduced", ()) or ():  # replicated, marked for a later reduction
        a = _axis_index(plc, mesh, name, op, f"the spec {spec}")
        if nd[a] is None:
            nd[a] = _sbp.broadcast
    return tuple(nd)


# -------------------------------------------------------------------------------------------
# GlobalTensor <-> jax.Array
# -------------------------------------------------------------------------------------------


def placement_of_mesh(mesh: Mesh) -> Placement:
    """The placement of a concrete ``Mesh``: same devices (ids), hierarchy and axis names."""
    devs = np.asarray(mesh.devices)
    kind = devs.flat[0].platform
    return Placement(
        kind,
        np.vectorize(lambda d: d.id, otypes=[np.int64])(devs),
        axis_names=tuple(mesh.axis_names),
    )


def layout_of_array(arr: jax.Array) -> tuple[Layout, bool]:
    """(layout, shares_buffers) of a ``jax.Array`` with a ``NamedSharding``: the placement of its
    mesh and the nd-sbp of its spec. ``shares_buffers``: the array's shards are the layout's
    physical blocks as they are (even S / B); False for a P (``unreduced``) spec, whose physical
    array has the extra addend dim."""
    sh = arr.sharding
    if not isinstance(sh, NamedSharding):
        raise SbpError(
            f"tensor: a jax.Array with a {type(sh).__name__} carries no mesh axes to read a layout from; "
            "pass placement= and sbp= (or put it with a NamedSharding first)."
        )
    plc = placement_of_mesh(sh.mesh)
    nd = spec_to_nd(sh.spec, sh.mesh, plc, arr.ndim, op="tensor")
    lay = layout_of(plc, normalise_nd(nd, arr.shape, plc, op="tensor"), tuple(arr.shape))
    if not lay.is_even:  # JAX's own uneven shardings cut ceil-sized blocks, jsbp's are balanced
        return lay, False
    return lay, not lay.partial_axes


def physical_from_array(arr: jax.Array, lay: Layout):
    """The layout's physical array built from ``arr``'s shards, on the devices (no host trip): the
    same buffers for even S / B; for P each device's addend gains the leading addend dim."""
    shards = arr.addressable_shards
    if not lay.partial_axes:
        if arr.sharding.mesh is lay.placement.mesh or arr.sharding == lay.sharding:
            return arr
        return jax.make_array_from_single_device_arrays(
            lay.physical_shape, lay.sharding, [s.data for s in shards]
        )
    with no_context_mesh():  # a device-side reshape of each addend, whatever mesh the user has set
        datas = [s.data[None] for s in shards]
    return jax.make_array_from_single_device_arrays(lay.physical_shape, lay.sharding, datas)


def to_jax_array(x) -> jax.Array:
    """``x.to_jax()`` on concrete values: a ``jax.Array`` of the logical shape with the
    equivalent ``NamedSharding`` (``named_sharding``)."""
    lay = x.layout
    if not lay.is_even:
        d = next(d for d, n in enumerate(lay.shape) if n % lay.ways(d))
        axes = tuple(lay.placement.axis_names[a] for a in lay.splitters[d])
        raise SbpError(
            f"to_jax: dim {d} of the tensor of {lay.describe()} has size {lay.shape[d]}, which does not split "
            f"evenly {lay.ways(d)} ways over axes {axes}; a JAX NamedSharding cannot hold uneven blocks (jsbp pads "
            "them). Box it to a layout that splits it evenly (or B) first, or read it with x.numpy()."
        )
    ns = NamedSharding(
        explicit_mesh(lay.placement), _spec(lay.placement, lay.nd_sbp, len(lay.shape), "to_jax")
    )
    phys = x.physical
    shards = phys.addressable_shards
    with no_context_mesh():  # a device-side slice of each addend, whatever mesh the user has set
        datas = [s.data[0] for s in shards] if lay.partial_axes else [s.data for s in shards]
    return jax.make_array_from_single_device_arrays(lay.shape, ns, datas, dtype=phys.dtype)


def under_transformation() -> bool:
    """Whether a JAX transformation (``jax.jit``, ``jax.grad``, ``jax.vmap``...) is tracing now:
    ``x.to_jax()`` there is the plain logical value, whether ``x`` holds a tracer or a concrete
    array (an argument ``jax.grad`` does not differentiate, a closed-over tensor)."""
    from jax._src import core as jcore

    return not jcore.trace_state_clean()


# -------------------------------------------------------------------------------------------
# running jsbp's own programs under a user's context mesh
# -------------------------------------------------------------------------------------------


def _context_mesh_set() -> bool:
    return not jax.sharding.get_abstract_mesh().empty


@contextlib.contextmanager
def no_context_mesh():
    """No context mesh while jsbp runs its own (shard_map) programs: they name the placement's
    mesh, which JAX would otherwise check against the user's ``jax.set_mesh(...)``."""
    if not _context_mesh_set():
        yield
        return
    try:
        ctx = jax.set_mesh(None)
    except ValueError:  # refused under a transformation (see below)
        ctx = None
    if ctx is not None:
        with ctx:
            yield
        return
    # under a user's transformation (jax.jit / jax.grad): set_mesh is refused there; JAX's own
    # context variables are swapped instead (the same thing set_mesh does)
    from jax._src import mesh as _mesh

    held, concrete = _mesh_holders()
    prev_a = held.swap_local(_mesh.empty_abstract_mesh)
    prev_c = concrete.swap_local(_mesh.empty_concrete_mesh) if concrete is not None else None
    try:
        yield
    finally:
        held.set_local(prev_a)
        if concrete is not None:
            concrete.set_local(prev_c)


def _mesh_holders(by_name: bool = True):
    """JAX's thread-local holders of the context's abstract and concrete mesh (what
    ``jax.set_mesh`` swaps): ``jax._src.config.abstract_mesh_context_manager`` / ``device_context``
    up to JAX 0.11.1; where those names are gone (0.11.2), the holders in JAX's config and mesh
    modules whose value is the mesh in context now. The concrete one may be None (not found:
    JAX then checks only the abstract mesh)."""
    from jax._src import config as _config
    from jax._src import mesh as _mesh

    if (
        by_name
        and hasattr(_config, "abstract_mesh_context_manager")
        and hasattr(_config, "device_context")
    ):
        return _config.abstract_mesh_context_manager, _config.device_context
    if by_name and _FOUND_HOLDERS:  # module-level objects: found once, they stay the holders
        return _FOUND_HOLDERS[0]
    get_concrete = getattr(_mesh, "get_concrete_mesh", None)
    want = {
        "abstract": jax.sharding.get_abstract_mesh(),
        "concrete": get_concrete() if get_concrete else None,
    }
    found: dict = {}
    for mod in (_config, _mesh, sys.modules.get("jax._src.sharding_impls")):
        for holder in vars(mod).values() if mod is not None else ():
            if not (hasattr(holder, "swap_local") and hasattr(holder, "set_local")):
                continue
            try:
                value = holder.value
            except Exception:  # a holder that cannot be read here is not one of these
                continue
            for what, mesh in want.items():
                if mesh is not None and value is mesh and not getattr(mesh, "empty", True):
                    found.setdefault(what, holder)
    if "abstract" not in found:
        raise PlacementError(
            "jsbp cannot run its own program under this JAX's jax.set_mesh inside a transformation "
            f"(JAX {jax.__version__}: the context mesh's holder was not found). Call the eager jsbp "
            "operation outside jax.jit / jax.grad, put it inside jsbp.jit, or leave the set_mesh block."
        )
    holders = found["abstract"], found.get("concrete")
    if by_name and holders[1] is not None:
        _FOUND_HOLDERS.append(holders)
    return holders


_FOUND_HOLDERS: list = []  # ``_mesh_holders``' search, once it found both


class meshless:
    """``fn`` (a jitted jsbp program) called with no context mesh; ``lower`` likewise."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        if not _context_mesh_set():
            return self.fn(*args)
        with no_context_mesh():
            return self.fn(*args)

    def lower(self, *args):
        with no_context_mesh():
            return self.fn.lower(*args)


def portable_key(key):
    """A PRNG key made under a user's ``jax.set_mesh(...)`` lives on that mesh's devices; jsbp's
    program for another device set takes it uncommitted (its two words, through the host)."""
    if (
        not _context_mesh_set()
        or not isinstance(key, jax.Array)
        or isinstance(key, jax.core.Tracer)
    ):
        return key
    with no_context_mesh():
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(key)
            return jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)), impl=impl)
        return np.asarray(key)


def _needs_mesh(err: Exception) -> bool:
    msg = str(err)
    return (
        "mesh context" in msg or "mesh in context" in msg or "context mesh cannot be empty" in msg
    )


def _typed_spec(mesh, shape, nd) -> PartitionSpec:
    """The spec JAX's types can hold for a value of ``shape`` laid out as ``nd`` on ``mesh`` (the
    placement's axis names): each split axis named on its dim where the dim divides evenly (JAX's
    types hold no uneven split), ``B`` and ``P`` axes left out (inside ``jsbp.jit`` a ``P`` value is
    its logical sum: JAX would refuse every non-linear op on an ``unreduced`` type)."""
    names = mesh.axis_names
    sizes = _mesh_axis_sizes(mesh)
    entries = []
    for d in range(len(shape)):
        axes = tuple(names[a] for a, x in enumerate(nd) if x.is_split and x.dim == d)
        ways = int(np.prod([sizes[n] for n in axes])) if axes else 1
        if not axes or shape[d] % ways:
            entries.append(None)
        else:
            entries.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def typed_avals(abstract, layouts, plc: Placement) -> list:
    """``abstract`` (``jax.ShapeDtypeStruct`` s of ``jsbp.jit``'s logical arguments) typed with
    their layouts as ``NamedSharding`` s over the placement's ``Explicit`` mesh, so that
    ``jax.typeof(x).sharding`` inside the traced function is the argument's layout."""
    mesh = explicit_mesh(plc)
    out = []
    for a, lay in zip(abstract, layouts):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):  # a key array: B, untyped
            out.append(a)
            continue
        spec = _typed_spec(mesh, a.shape, lay.nd_sbp)
        out.append(
            jax.ShapeDtypeStruct(
                a.shape, a.dtype, weak_type=a.weak_type, sharding=NamedSharding(mesh, spec)
            )
        )
    return out


def retype(aval, nd):
    """The type of ``to_global(x, sbp=nd)`` inside a typed trace: ``x``'s type with the sharding
    of ``nd`` (an untyped trace, or a value on no mesh, keeps its type)."""
    sh = getattr(aval, "sharding", None)
    if (
        nd is None
        or not isinstance(sh, NamedSharding)
        or sh.mesh.empty
        or len(nd) != len(sh.mesh.axis_names)
    ):
        return aval
    if any(t != AxisType.Explicit for t in getattr(sh.mesh, "axis_types", ())):
        return aval
    spec = _typed_spec(sh.mesh, aval.shape, nd)
    return aval.update(sharding=NamedSharding(sh.mesh, spec))


def _same_axes(mesh, plc: Placement) -> bool:
    """Whether a (context) mesh has the placement's axis names and sizes (any axis types)."""
    return tuple(mesh.axis_names) == tuple(plc.axis_names) and tuple(
        _mesh_axis_sizes(mesh)[n] for n in plc.axis_names
    ) == tuple(plc.hierarchy)


UNTYPED: list[str] = []
"""Why the last few typed traces were refused (JAX's error, first line), newest last: those
functions were traced again untyped. For diagnostics and tests."""


def trace_with_mesh(make, plc: Placement, abstract=None, layouts=None):
    """A trace of the user's function: ``make(avals)`` (``make()`` without ``abstract``).

    With ``abstract`` / ``layouts``, the arguments are first traced typed (``typed_avals``: their
    layouts as ``NamedSharding`` s over the placement's ``Explicit`` mesh) under that mesh, so
    ``jax.typeof(x).sharding`` is ``x``'s layout and explicit-sharding code
    (``reshard(y, jax.typeof(x).sharding)``, ``out_sharding=P(...)``) resolves against the
    placement's axes. JAX's explicit-sharding rules refuse some programs jsbp runs (a contraction
    over a split dim without ``out_sharding``, a gather by split indices, ...): those are traced
    again untyped, as replicated values, and jsbp infers their layouts as before.

    The typed trace runs when no context mesh is set, or when the context mesh has the
    placement's axis names and sizes — the placement's own mesh (``Auto`` axes) included, whose
    ``Explicit`` twin is used, so explicit-sharding code works under ``jax.set_mesh(p.mesh)``.
    Otherwise the function is traced untyped under the user's context mesh; explicit-sharding code
    that JAX refuses under the placement's own mesh (its axes are ``Auto``: "cannot contain axis
    names that are of type Auto") is traced under the ``Explicit`` twin instead. Without a context
    mesh a function that needs one (a bare ``PartitionSpec`` passed to ``reshard`` /
    ``out_sharding=``) is traced under the ``Explicit`` abstract mesh of the placement.
    """
    call = (lambda avals: make()) if abstract is None else make
    ctx = jax.sharding.get_abstract_mesh()
    twin = explicit_mesh(plc).abstract_mesh
    ours = ctx.empty or _same_axes(ctx, plc)
    typed_err = None
    if abstract is not None and ours:
        try:
            with jax.sharding.use_abstract_mesh(twin):
                return call(typed_avals(abstract, layouts, plc))
        except SbpError:
            raise
        except (
            Exception
        ) as e:  # JAX's explicit-sharding rules refused the typed trace: untyped below
            typed_err = e
            UNTYPED.append(_first_line(e))
            del UNTYPED[:-8]
    try:
        return _untyped(call, abstract, ctx, ours, twin)
    except SbpError:
        raise
    except Exception as e:
        if typed_err is None or _first_line(e) == _first_line(typed_err):
            raise
        raise SbpError(
            f"jsbp.jit on {plc}: traced with its arguments typed by their layouts (jax.typeof(x).sharding "
            f"is x's layout), JAX's explicit-sharding rules refused the function: {_first_line(typed_err)}. "
            f"Traced again untyped (every value replicated in JAX's types), it failed: {_first_line(e)}. "
            "Code that reads jax.typeof(...).sharding needs the typed trace: give the operation JAX names "
            "an out_sharding= (or reshard its operands), as JAX's explicit sharding asks."
        ) from e


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _untyped(call, abstract, ctx, ours: bool, twin):
    """The untyped trace (see ``trace_with_mesh``)."""
    try:
        return call(abstract)
    except (ValueError, RuntimeError, TypeError) as e:
        if ctx.empty:
            if not _needs_mesh(e):
                raise
        elif not (
            ours and "of type Auto" in str(e)
        ):  # explicit-sharding code under p.mesh: the twin
            raise
    with jax.sharding.use_abstract_mesh(twin):
        return call(abstract)


# -------------------------------------------------------------------------------------------
# JAX's sharding calls inside jsbp.jit: layout requests
# -------------------------------------------------------------------------------------------


def requested_nd(eqn, cur: Layout, plc: Placement):
    """The nd-sbp a ``reshard`` / ``sharding_constraint`` equation asks for its operand (now laid
    out as ``cur``), or None when it asks nothing of the placement's axes.

    Mesh axes map to placement axes by name. A named axis gets what the spec says; an axis the
    spec leaves out gets ``B`` (replicated), except where the equation leaves it free: an ``Auto``
    axis of a ``reshard`` (``auto_axes``), a dim marked unconstrained, and placement axes the mesh
    does not have keep their current SBP.
    """
    name = eqn.primitive.name
    sharding = eqn.params.get("dst_sharding" if name == "reshard" else "sharding")
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    ndim = len(eqn.invars[0].aval.shape)
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    spec = sharding.spec
    unconstrained = set(eqn.params.get("unconstrained_dims", ()) or ())
    unconstrained |= {
        d
        for d, e in enumerate(getattr(spec, "partitions", spec))
        if e is PartitionSpec.UNCONSTRAINED
    }
    keep = []
    for n in plc.axis_names:
        if n not in mesh.axis_names:
            keep.append(True)
        elif name == "reshard" and types.get(n) not in (None, AxisType.Explicit):
            keep.append(True)  # an Auto axis is not in JAX's type: reshard says nothing about it
        else:
            keep.append(False)
    nd = list(
        spec_to_nd(
            spec, mesh, plc, ndim, op=f"{name} inside jsbp.jit", keep=keep, strict_order=False
        )
    )
    for a, x in enumerate(nd):  # an axis splitting an unconstrained dim keeps that split
        cx = cur.nd_sbp[a]
        if x is _sbp.broadcast and cx.is_split and cx.dim in unconstrained:
            nd[a] = cx
    if all(x is None for x in nd):
        return None
    nd = [cur.nd_sbp[a] if x is None else x for a, x in enumerate(nd)]
    if len({x.reduce for x in nd if x.is_partial}) > 1:  # a kept partial max / min beside a new P
        nd = [x if not x.is_partial or x.reduce == "sum" else _sbp.broadcast for x in nd]
    if any(x.is_split and x.dim >= ndim for x in nd):
        return None
    return tuple(nd)


def _is_request(s) -> bool:
    """A ``sharding=`` / ``out_sharding=`` parameter that names a mesh axis (one that names none is
    what JAX fills in for replicated values: no request)."""
    if not isinstance(s, NamedSharding):
        return False
    spec = s.spec
    return any(_entry_axes(e) for e in getattr(spec, "partitions", spec)) or bool(
        getattr(spec, "unreduced", ())
    )


_SHARDING_PARAMS = ("out_sharding", "sharding")


def _lift_jaxpr(jaxpr):
    from jax._src import core as jcore
    from jax._src.pjit import reshard_p

    new_eqns, changed = [], False
    for eqn in jaxpr.eqns:
        params = eqn.params
        sub = {k: _lift_param(v) for k, v in params.items()}
        if any(sub[k] is not params[k] for k in params):
            params = sub
        req = None
        if eqn.primitive.name not in ("reshard", "sharding_constraint"):
            for k in (
                _SHARDING_PARAMS
            ):  # cleared either way: a mesh's sharding means nothing on local shards
                if isinstance(params.get(k), NamedSharding):
                    if _is_request(params[k]):
                        req = params[k]
                    params = {**params, k: None}
        if req is not None and (
            eqn.primitive.multiple_results
            or len(eqn.outvars) != 1
            or isinstance(eqn.outvars[0], jcore.DropVar)
        ):
            req = None  # only single results carry a request (the parameter is still cleared)
        if params is eqn.params:
            new_eqns.append(eqn)
            continue
        changed = True
        if req is None:
            new_eqns.append(eqn.replace(params=params))
            continue
        out = eqn.outvars[0]
        mid = jcore.Var(out.aval)
        new_eqns.append(eqn.replace(params=params, outvars=[mid]))
        new_eqns.append(
            jcore.new_jaxpr_eqn(
                [mid],
                [out],
                reshard_p,
                {"dst_sharding": req, "concrete_mesh": None},
                jcore.no_effects,
                eqn.source_info,
                eqn.ctx,
            )
        )
    return jaxpr.replace(eqns=new_eqns) if changed else jaxpr


def _lift_param(v):
    from jax._src import core as jcore

    if isinstance(v, jcore.ClosedJaxpr):
        j = _lift_jaxpr(v.jaxpr)
        return v if j is v.jaxpr else v.replace(jaxpr=j)
    if isinstance(v, jcore.Jaxpr):
        return _lift_jaxpr(v)
    if (
        isinstance(v, tuple)
        and v
        and any(isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)) for x in v)
    ):
        out = tuple(_lift_param(x) for x in v)
        if all(a is b for a, b in zip(out, v)):
            return v
        return (
            type(v)(*out) if hasattr(v, "_fields") else out
        )  # a namedtuple stays one (custom_linear_solve's jaxprs)
    return v


def lift_out_shardings(closed):
    """``closed`` with every ``out_sharding=`` / ``sharding=`` parameter that names a mesh axis
    cleared and turned into a ``reshard`` of the equation's result (a layout request the compiler
    honours); nested jaxprs included. The same object when there is none."""
    j = _lift_jaxpr(closed.jaxpr)
    return closed if j is closed.jaxpr else closed.replace(jaxpr=j)
