"""``jsbp.jit``: compile a consistent-view function into one full-manual ``shard_map`` program.

Inside the function every global tensor argument is a plain *logical* ``jax.Array`` (tracer):
write ordinary JAX. ``jsbp.to_global(x, sbp=..., grad_sbp=...)`` on such a value binds a layout
annotation (the ``jsbp_to_global`` primitive) that the SBP inference honours; its transpose carries
``grad_sbp`` into the backward pass (OneFlow's Megatron f/g idiom).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _sbp
from ._emit import run_program
from ._errors import PlacementError, SbpError
from ._interop import (
    _context_mesh_set,
    lift_out_shardings,
    meshless,
    no_context_mesh,
    retype,
    trace_with_mesh,
)
from ._layout import Layout, layout_of, normalise_nd
from ._lower import plan
from ._placement import placement as Placement
from ._program import Program
from ._statickey import static_key
from ._tensor import GlobalTensor
from ._trace import current_tracer, tracing

__all__ = ["jit", "JitFunction", "to_global_p"]

# -------------------------------------------------------------------------------------------
# the layout-annotation primitive
# -------------------------------------------------------------------------------------------

to_global_p = Primitive("jsbp_to_global")
to_global_p.def_impl(lambda x, *, nd, grad_nd: x)
to_global_p.def_abstract_eval(
    lambda x, *, nd, grad_nd: retype(x, nd)
)  # typed traces: nd's sharding
mlir.register_lowering(to_global_p, lambda ctx, x, *, nd, grad_nd: [x])


def _to_global_transpose(ct, x, *, nd, grad_nd):
    if type(ct) is ad.Zero:
        return [ct]
    return [to_global_p.bind(ct, nd=grad_nd, grad_nd=None)]


ad.deflinear2(to_global_p, _to_global_transpose)
batching.defvectorized(to_global_p)


class _Hook:
    """Active while ``jsbp.jit`` traces: turns ``to_global`` on logical values into annotations."""

    def __init__(self, placement: Placement):
        self.placement = placement

    def annotate(self, x, placement=None, sbp=None, grad_sbp=None):
        if isinstance(x, GlobalTensor):
            raise SbpError(
                "inside jsbp.jit, global tensors are plain logical arrays; a GlobalTensor reached the "
                f"traced function from outside ({x!r}). Pass it as an argument instead of closing over it."
            )
        if placement is not None and placement != self.placement:
            raise PlacementError(
                f"to_global inside jsbp.jit: the program runs on {self.placement!r}; moving a value to "
                f"{placement!r} is only possible outside jsbp.jit (box it eagerly)."
            )
        shape = tuple(jnp.shape(x))
        nd = None if sbp is None else normalise_nd(sbp, shape, self.placement, op="to_global")
        gnd = (
            None
            if grad_sbp is None
            else normalise_nd(grad_sbp, shape, self.placement, op="to_global(grad_sbp=)")
        )
        if nd is None and gnd is None:
            return x
        return to_global_p.bind(x, nd=nd, grad_nd=gnd)

    def to_global(self, x, dst, grad):
        return self.annotate(x, dst.placement, dst.nd_sbp, None if grad is None else grad.nd_sbp)


# -------------------------------------------------------------------------------------------
# compiled entries
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Entry:
    placement: Placement
    in_layouts: list[Layout]
    in_dtypes: list
    program: Program
    out_tree: Any
    out_layouts: list[Layout]
    out_dtypes: list
    fn: Any  # jitted shard_map over physical arrays
    flat_fn: Any  # logical flat function (for the backward program)
    out_struct: Any = (
        None  # out_tree with global tensors as nodes: physical outputs -> global tensors
    )
    _bwd: Any = None
    strict: bool = (
        False  # a primitive without a rule raises (else: runs replicated, with a warning)
    )
    _diff: Any = None


def _is_global(x):
    return isinstance(x, GlobalTensor)


def _dtype(d):
    """``np.dtype(d)``, except that an extended dtype (a typed PRNG key array's ``key<fry>``)
    stays as it is: key arrays pass through ``jsbp.jit`` as ``B`` values."""
    return d if jax.dtypes.issubdtype(d, jax.dtypes.extended) else np.dtype(d)


def _keys_broadcast(out_nd, avals, placement):
    """Typed PRNG key outputs are always ``B`` (a key array is never split)."""
    keys = [jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) for a in avals]
    if not any(keys):
        return out_nd
    out_nd = list(out_nd) if out_nd is not None else [None] * len(avals)
    return [(_sbp.broadcast,) * placement.ndim if k else nd for k, nd in zip(keys, out_nd)]


def _weak(x) -> bool:
    """A Python scalar, or an array (or tracer) JAX marks weakly typed."""
    return type(x) in (int, float, complex) or bool(
        getattr(getattr(x, "aval", x), "weak_type", False)
    )


def _leaf_type(x):
    try:
        return (x.dtype, x.shape, _weak(x))
    except AttributeError:  # a Python scalar
        return type(x)


def _scalar_tracer(x) -> bool:
    """A Python scalar argument as ``jax.jit`` traces it: a weakly typed 0-d tracer."""
    return isinstance(x, jax.core.Tracer) and x.ndim == 0 and _weak(x)


def _put_plain(x, lay: Layout):
    """A plain array or scalar argument, replicated (B) on the placement."""
    arr = x if isinstance(x, jax.Array) else jnp.asarray(x)
    return arr if isinstance(arr, jax.core.Tracer) else jax.device_put(arr, lay.sharding)


def _partial_squeeze(lays):
    return [bool(lay.partial_axes) for lay in lays]


def _build_shard_map(placement, in_layouts, out_layouts, prog, in_dtypes, donated=None):
    """The jitted ``shard_map`` running ``prog`` on physical arrays. A zero-size input holds no
    data: it is made inside the body instead of passed in (XLA rejects a manual computation whose
    body folds an empty operand away: "expected at least one operand ... GlobalToLocalShape")."""
    sq_in = _partial_squeeze(in_layouts)
    sq_out = _partial_squeeze(out_layouts)
    passed = [math.prod(l.shape) != 0 for l in in_layouts]

    def body(*xs):
        it = iter(xs)
        xs = [
            (next(it)[0] if s else next(it)) if keep else jnp.zeros(l.local_shape, d)
            for keep, s, l, d in zip(passed, sq_in, in_layouts, in_dtypes)
        ]
        outs = run_program(prog, xs)
        return tuple(o[None] if s else o for o, s in zip(outs, sq_out))

    donate = (
        ()
        if donated is None
        else tuple(
            j for j, i in enumerate(i for i, keep in enumerate(passed) if keep) if donated[i]
        )
    )
    sm = meshless(
        jax.jit(
            jax.shard_map(  # runs whatever jax.set_mesh(...) is active
                body,
                mesh=placement.mesh,
                in_specs=tuple(l.spec for l, keep in zip(in_layouts, passed) if keep),
                out_specs=tuple(l.spec for l in out_layouts),
                check_vma=False,
            ),
            donate_argnums=donate,
        )
    )
    if all(passed):
        return sm
    return _DropEmpty(sm, passed)


class _DropEmpty:
    """``fn`` called with the non-empty ones of its physical arguments (see ``_build_shard_map``);
    ``lower`` as ``jax.jit``'s, for ``count_collectives``."""

    def __init__(self, fn, passed):
        self.fn, self.passed = fn, passed

    def _keep(self, args):
        return [a for a, keep in zip(args, self.passed) if keep]

    def __call__(self, *args):
        return self.fn(*self._keep(args))

    def lower(self, *args):
        return self.fn.lower(*self._keep(args))


def _out_nd_list(out_sbp, n_out, placement, out_shapes):
    if out_sbp is None:
        return None
    # a single nd-sbp for every output, or one per output leaf (sequence / pytree prefix)
    try:
        single = _sbp.parse_nd(out_sbp, placement.ndim)
        specs = [single] * n_out
    except SbpError as e:
        if isinstance(out_sbp, (str, _sbp.Sbp)):  # one nd-sbp, not one for this placement
            raise SbpError(f"jsbp.jit: out_sbp={out_sbp!r}: {e}") from None
        if isinstance(out_sbp, (list, tuple)) and len(out_sbp) == n_out:
            specs = [None if s is None else _sbp.parse_nd(s, placement.ndim) for s in out_sbp]
        else:

            def is_nd(s):  # a tuple is an nd-sbp where it parses as one, else a container
                if s is None or isinstance(s, (str, _sbp.Sbp)):
                    return True
                if not isinstance(s, tuple):
                    return False
                try:
                    _sbp.parse_nd(s, placement.ndim)
                    return True
                except SbpError:
                    return False

            leaves = jax.tree_util.tree_leaves(out_sbp, is_leaf=is_nd)
            if len(leaves) != n_out:
                raise SbpError(
                    f"jsbp.jit: out_sbp={out_sbp!r} gives {len(leaves)} layouts for {n_out} outputs; pass one "
                    "nd-sbp for all outputs or one per output."
                ) from None
            specs = [None if s is None else _sbp.parse_nd(s, placement.ndim) for s in leaves]
    return [
        None if s is None else normalise_nd(s, shp, placement, op="jsbp.jit(out_sbp=)")
        for s, shp in zip(specs, out_shapes)
    ]


def _trace(fn, treedef, static, in_layouts, in_dtypes, placement, weak=()):
    """``weak``: per leaf, whether it is a Python scalar (weakly typed, as under ``jax.jit``: a
    float16 tensor times ``2.0`` stays float16)."""
    weak = tuple(weak) or (False,) * len(in_layouts)
    abstract = [
        jax.ShapeDtypeStruct(l.shape, d, weak_type=w)
        for l, d, w in zip(in_layouts, in_dtypes, weak)
    ]
    store = {}

    def flat_fn(*logical):
        dyn = jax.tree_util.tree_unflatten(treedef, list(logical))
        args, kwargs = _merge_static(dyn, static)
        out = fn(*args, **kwargs)
        leaves, tree = jax.tree_util.tree_flatten(out, is_leaf=_is_global)
        if any(_is_global(x) for x in leaves):
            raise SbpError(
                "a function under jsbp.jit returned a GlobalTensor built inside it; inside jsbp.jit values "
                "are logical arrays — return them directly (their layout is inferred)."
            )
        store["tree"] = tree
        return [jnp.asarray(x) for x in leaves]

    with tracing(_Hook(placement)):
        closed = trace_with_mesh(
            lambda avals: jax.make_jaxpr(flat_fn)(*avals), placement, abstract, in_layouts
        )
    return lift_out_shardings(closed), store["tree"], flat_fn


def _merge_static(dyn, static):
    """The call's ``(args, kwargs)`` from its dynamic part ``(args, kwargs)`` and its static part
    ``((position, value), ...), ((name, value), ...)``; ``static=()``: ``dyn`` is the positional
    arguments alone (``_auto`` traces so)."""
    if static == ():
        return tuple(dyn), {}
    (args, kwargs), (pos, named) = dyn, static
    out = list(args)
    for i, v in pos:  # ascending positions
        out.insert(i, v)
    return tuple(out), {**kwargs, **dict(named)}


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none
        return None


def _argnums_and_names(fn, sig, nums, names, what: str):
    """``jax.jit``'s reading of ``{what}_argnums`` / ``{what}_argnames``: where only one is given,
    the other is completed from the signature's positional-or-keyword parameters."""
    nums_given, names_given = nums is not None, names is not None
    nums = () if nums is None else (nums,) if isinstance(nums, int) else tuple(nums)
    names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
    name = getattr(fn, "__name__", "fn")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise SbpError(f"jsbp.jit({name}): {what}_argnums must be ints, got {nums!r}.")
    if not all(isinstance(k, str) for k in names):
        raise SbpError(f"jsbp.jit({name}): {what}_argnames must be strings, got {names!r}.")
    if sig is not None and nums_given != names_given:
        pk = [
            (i, k)
            for i, (k, p) in enumerate(sig.parameters.items())
            if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
        ]
        if nums_given:
            names = tuple(k for i, k in pk if i in nums)
        else:
            nums = tuple(i for i, k in pk if k in names)
    return nums, names


def _positions(nums, n: int) -> frozenset:
    """Argument numbers (negative ones count from the end) among ``n`` positional arguments."""
    return frozenset(i % n for i in nums if -n <= i < n)


class _PlainArguments(Exception):
    """Raised while tracing ``JitFunction._outer`` for arguments that are not all global tensors."""


class JitFunction:
    """A consistent-view function compiled by ``jsbp.jit``; call it with global tensors."""

    def __init__(
        self,
        fn,
        *,
        out_sbp=None,
        static_argnums=None,
        strict: bool | None = None,
        static_argnames=None,
        donate_argnums=None,
        donate_argnames=None,
    ):
        self.fn = fn
        self.out_sbp = out_sbp
        self.strict = _strict_default() if strict is None else bool(strict)
        sig = _signature(fn)
        self.static_argnums, self.static_argnames = _argnums_and_names(
            fn, sig, static_argnums, static_argnames, "static"
        )
        self.donate_argnums, self.donate_argnames = _argnums_and_names(
            fn, sig, donate_argnums, donate_argnames, "donate"
        )
        both = set(self.static_argnames) & set(self.donate_argnames)
        if both or set(self.static_argnums) & set(self.donate_argnums):
            raise SbpError(
                f"jsbp.jit({getattr(fn, '__name__', 'fn')}): arguments {sorted(both) or sorted(set(self.static_argnums) & set(self.donate_argnums))} "
                "are both static and donated; a static argument is no buffer to donate. Drop one of the two."
            )
        self._cache: dict = {}
        # dispatch cache: (structure of the arguments with global tensors as nodes, leaf types,
        # static args) -> (entry, the plain leaves and their layouts). A global tensor flattens to
        # its physical array with its layout in the structure, so a hit needs no per-leaf Python.
        self._fast: dict = {}
        # the call itself: one jax.jit over the arguments' pytree, so that a call whose arguments
        # are all global tensors is dispatched by JAX's C++ path (structure, layouts in the
        # treedef, avals, shardings) with no per-leaf Python of ours; see ``_traced_call``.
        # Static arguments keep the Python path (jax.jit would key them by ``==``: ``1 == 1.0``),
        # and so do donated ones (the program itself donates them, which a program called inside
        # another jax.jit would not), and so does a call under a context mesh (the function is
        # traced under it, see ``trace_with_mesh``; the program runs without it, see ``meshless``)
        python_path = (
            self.static_argnums
            or self.static_argnames
            or self.donate_argnums
            or self.donate_argnames
        )
        self._outer = None if python_path else jax.jit(_traced_call_of(weakref.ref(self)))
        functools.update_wrapper(self, fn)

    # -- argument handling -------------------------------------------------------------------
    def _split(self, args, kwargs):
        """``(dyn, static, spos)``: the dynamic ``(args, kwargs)``, the static
        ``((position, value), ...), ((name, value), ...)`` and the static positions."""
        spos = _positions(self.static_argnums, len(args)) if self.static_argnums else frozenset()
        snames = self.static_argnames
        static = (
            tuple((i, args[i]) for i in sorted(spos)),
            tuple((k, kwargs[k]) for k in sorted(kwargs) if k in snames),
        )
        dyn = (
            tuple(a for i, a in enumerate(args) if i not in spos),
            {k: v for k, v in kwargs.items() if k not in snames} if snames else dict(kwargs),
        )
        return dyn, static, spos

    def _donated(self, args, kwargs, dyn, spos):
        """Per leaf of ``dyn`` (global tensors as leaves), whether its buffer is donated."""
        if not (self.donate_argnums or self.donate_argnames):
            return None
        dpos = {
            i for i in self.donate_argnums if 0 <= i < len(args)
        }  # jax.jit: negative ones donate nothing
        flags = (
            tuple(i in dpos for i in range(len(args)) if i not in spos),
            {k: k in self.donate_argnames for k in dyn[1]},
        )
        per = jax.tree_util.tree_map(
            lambda f, sub: jax.tree_util.tree_map(lambda _: f, sub, is_leaf=_is_global),
            flags,
            dyn,
            is_leaf=lambda x: isinstance(x, bool),
        )
        return tuple(jax.tree_util.tree_leaves(per))

    @staticmethod
    def _static_key(static):
        """Typed: ``1``, ``1.0``, ``True`` and ``-0.0`` are different programs (``_statickey``)."""
        try:
            return static_key(static)
        except TypeError:
            raise SbpError(
                f"jsbp.jit: static arguments must be hashable, got {static!r}."
            ) from None

    def _prepare(self, args, kwargs):
        dyn, static, spos = self._split(args, kwargs)
        donated = self._donated(args, kwargs, dyn, spos)
        leaves, treedef = jax.tree_util.tree_flatten(dyn, is_leaf=_is_global)
        placement = None
        for x in leaves:
            if _is_global(x):
                if placement is None:
                    placement = x.placement
                elif x.placement != placement:
                    raise PlacementError(
                        f"{getattr(self.fn, '__name__', 'function')}: arguments live on two placements, "
                        f"{placement!r} and {x.placement!r}; box one with x.to_global(placement=...) first."
                    )
        if placement is None:
            raise SbpError(
                f"jsbp.jit({getattr(self.fn, '__name__', 'fn')}) needs at least one GlobalTensor argument "
                "to know the placement; make one with jsbp.tensor(...)."
            )
        phys, lays, dtypes, plain, weak = [], [], [], [], []
        for i, x in enumerate(leaves):
            if _is_global(x):
                phys.append(x._value)
                lays.append(x._layout)
                dtypes.append(_dtype(x._value.dtype))
                weak.append(False)
            else:
                arr = x if isinstance(x, jax.Array) else jnp.asarray(x)
                lay = layout_of(placement, (_sbp.broadcast,) * placement.ndim, tuple(arr.shape))
                phys.append(_put_plain(arr, lay))
                lays.append(lay)
                dtypes.append(_dtype(arr.dtype))
                weak.append(_weak(x))
                plain.append((i, lay))
        key = (treedef, tuple(lays), tuple(dtypes), tuple(weak), self._static_key(static), donated)
        return key, placement, treedef, static, lays, dtypes, phys, plain

    def _entry(self, key, placement, treedef, static, lays, dtypes) -> _Entry:
        entry = self._cache.get(key)
        if entry is None:
            closed, out_tree, flat_fn = _trace(
                self.fn, treedef, static, lays, dtypes, placement, key[3]
            )
            out_avals = closed.out_avals
            out_sbp = self.out_sbp(out_tree) if callable(self.out_sbp) else self.out_sbp
            out_nd = _out_nd_list(out_sbp, len(out_avals), placement, [a.shape for a in out_avals])
            out_nd = _keys_broadcast(out_nd, out_avals, placement)
            prog = plan(placement, closed.jaxpr, closed.consts, lays, out_nd, strict=self.strict)
            fn = _build_shard_map(placement, lays, prog.out_layouts, prog, dtypes, donated=key[5])
            out_struct = jax.tree_util.tree_structure(
                jax.tree_util.tree_unflatten(
                    out_tree, [GlobalTensor(0, lay) for lay in prog.out_layouts]
                )
            )
            entry = _Entry(
                placement,
                lays,
                dtypes,
                prog,
                out_tree,
                prog.out_layouts,
                [a.dtype for a in out_avals],
                fn,
                flat_fn,
                out_struct,
                strict=self.strict,
            )
            self._cache[key] = entry
        return entry

    def _lookup(self, args, kwargs=None) -> tuple[_Entry, list]:
        """The compiled entry for these arguments and the physical arrays to call it with."""
        kwargs = {} if kwargs is None else kwargs
        dyn, static, _ = self._split(args, kwargs)
        leaves, structure = jax.tree_util.tree_flatten(dyn)
        try:
            fast_key = (structure, tuple(map(_leaf_type, leaves)), static_key(static))
            hit = self._fast.get(fast_key)
        except TypeError:  # unhashable static argument: _prepare says so
            hit, fast_key = None, None
        if hit is not None:
            entry, plain = hit
            for i, lay in plain:
                leaves[i] = _put_plain(leaves[i], lay)
            return entry, leaves
        key, placement, treedef, static, lays, dtypes, phys, plain = self._prepare(args, kwargs)
        entry = self._entry(key, placement, treedef, static, lays, dtypes)
        if fast_key is not None:
            self._fast[fast_key] = (entry, plain)
        return entry, phys

    def _find(self, args, kwargs):
        """``_lookup``; its one-argument form where the call has no keyword arguments."""
        return self._lookup(args, kwargs) if kwargs else self._lookup(args)

    def lower_program(self, *args, **kwargs) -> _Entry:
        return self._find(args, kwargs)[0]

    def __call__(self, *args, **kwargs):
        tracer = current_tracer()
        if tracer is not None and not any(
            _is_global(x) for x in jax.tree_util.tree_leaves((args, kwargs), is_leaf=_is_global)
        ):
            return self._inline(tracer, args, kwargs)  # called by a function jsbp.jit is tracing
        if self._outer is not None and not _context_mesh_set():
            try:
                return self._outer(*args, **kwargs)
            except _PlainArguments:  # this function is called with plain arrays
                self._outer = None
            except ValueError as e:  # a 0-d weak array committed to other devices
                if "incompatible devices" not in str(e):
                    raise
                self._outer = None
        entry, phys = self._find(args, kwargs)
        if any(isinstance(p, jax.core.Tracer) for p in phys):
            outs = _differentiable(entry)(*phys)
        else:
            outs = entry.fn(*phys)
        return jax.tree_util.tree_unflatten(entry.out_struct, outs)

    def _inline(self, hook, args, kwargs):
        """Inside another ``jsbp.jit`` function's trace the values are logical arrays: the call
        is part of that program (planned with it), its ``out_sbp`` a layout annotation."""
        out = self.fn(*args, **kwargs)
        if self.out_sbp is None:
            return out
        leaves, tree = jax.tree_util.tree_flatten(out)
        out_sbp = self.out_sbp(tree) if callable(self.out_sbp) else self.out_sbp
        nds = _out_nd_list(
            out_sbp, len(leaves), hook.placement, [tuple(jnp.shape(x)) for x in leaves]
        )
        if nds is None:
            return out
        leaves = [x if nd is None else hook.annotate(x, sbp=nd) for x, nd in zip(leaves, nds)]
        return jax.tree_util.tree_unflatten(tree, leaves)

    def _traced_call(self, *args, **kwargs):
        """The body of ``_outer``: traced once per structure, layouts and avals of the arguments
        (jax.jit's cache), it finds or builds the entry as the Python path does and calls its
        program, differentiable with jsbp's own backward program (under ``jax.grad`` of the call
        as on the Python path; without a transformation the custom rule costs nothing).

        Only for arguments that are all global tensors or Python scalars (weakly typed 0-d
        tracers here): another plain array is put on the placement by the Python path
        (``_put_plain``: a committed single-device array is handled there), so one raises
        ``_PlainArguments`` and the function keeps the Python path from then on."""
        if not all(
            _is_global(x) or _scalar_tracer(x)
            for x in jax.tree_util.tree_leaves((args, kwargs), is_leaf=_is_global)
        ):
            raise _PlainArguments
        entry, phys = self._find(args, kwargs)
        return jax.tree_util.tree_unflatten(entry.out_struct, _differentiable(entry)(*phys))

    def lower(self, *args, **kwargs):
        """``jax.jit``-style lowering of the compiled program (used by
        ``jsbp.debug.count_collectives``): the ``shard_map`` over the arguments' physical arrays."""
        entry, phys = self._find(args, kwargs)
        return entry.fn.lower(*phys)

    def trace(self, *args, **kwargs):
        """``jax.jit``-style tracing of the compiled program: a ``jax.stages.Traced`` of the
        ``shard_map`` over the arguments' physical arrays (its ``.jaxpr``, ``.lower()``)."""
        entry, phys = self._find(args, kwargs)
        fn = entry.fn
        if isinstance(fn, _DropEmpty):
            phys, fn = fn._keep(phys), fn.fn
        with no_context_mesh():
            return fn.fn.trace(*phys)


def _traced_call_of(ref):
    """``JitFunction._traced_call`` of the function ``ref`` refers to, for its ``jax.jit``: a weak
    reference, so that the function and what it captured go with the last reference to it (a
    bound method would make a cycle that only a garbage collection pass breaks, and JAX's caches
    of the traced program would keep the captured arrays until then)."""

    def traced_call(*args, **kwargs):
        return ref()._traced_call(*args, **kwargs)

    return traced_call


def _differentiable(entry: _Entry):
    if entry._diff is not None:
        return entry._diff
    fn, ref = entry.fn, weakref.ref(entry)  # no cycle entry -> run -> entry (see _traced_call_of)

    @jax.custom_vjp
    def run(*phys):
        return fn(*phys)

    def fwd(*phys):
        return fn(*phys), phys

    def bwd(phys, cts):
        entry = ref()
        bwd_fn, diff_idx = _backward(entry)
        cts = [  # the backward program reads the cotangents of inexact outputs only (keys: float0)
            c
            if not (hasattr(c, "dtype") and c.dtype == jax.dtypes.float0)
            else jnp.zeros(l.physical_shape, d)
            for c, l, d in zip(cts, entry.out_layouts, entry.out_dtypes)
            if _inexact(d)
        ]
        grads = bwd_fn(*phys, *cts)
        out = []
        gi = iter(grads)
        for i, p in enumerate(phys):
            if i in diff_idx:
                out.append(next(gi))
            else:
                out.append(np.zeros(np.shape(p), jax.dtypes.float0))
        return tuple(out)

    run.defvjp(fwd, bwd)
    entry._diff = run
    return run


def _inexact(d):
    return jnp.issubdtype(d, jnp.inexact)


def _backward(entry: _Entry):
    """The backward program: cotangents in the outputs' layouts -> gradients in the inputs' layouts."""
    if entry._bwd is not None:
        return entry._bwd
    n_in = len(entry.in_layouts)
    diff_idx = [i for i, d in enumerate(entry.in_dtypes) if _inexact(d)]
    out_diff = [i for i, d in enumerate(entry.out_dtypes) if _inexact(d)]

    def bwd_logical(*args):
        primals, cts = args[:n_in], dict(zip(out_diff, args[n_in:]))

        def f_diff(*xs):
            full = list(primals)
            for i, x in zip(diff_idx, xs):
                full[i] = x
            outs = entry.flat_fn(*full)
            return [outs[i] for i in out_diff]

        _, vjp = jax.vjp(f_diff, *[primals[i] for i in diff_idx])
        return list(vjp([cts[i] for i in out_diff]))

    in_lays = list(entry.in_layouts) + [entry.out_layouts[i] for i in out_diff]
    in_dts = list(entry.in_dtypes) + [entry.out_dtypes[i] for i in out_diff]
    abstract = [jax.ShapeDtypeStruct(l.shape, d) for l, d in zip(in_lays, in_dts)]
    with tracing(_Hook(entry.placement)):
        closed = lift_out_shardings(
            trace_with_mesh(
                lambda avals: jax.make_jaxpr(bwd_logical)(*avals),
                entry.placement,
                abstract,
                in_lays,
            )
        )
    out_nd = [entry.in_layouts[i].nd_sbp for i in diff_idx]
    prog = plan(entry.placement, closed.jaxpr, closed.consts, in_lays, out_nd, strict=entry.strict)
    fn = _build_shard_map(entry.placement, in_lays, prog.out_layouts, prog, in_dts)
    entry._bwd = (fn, set(diff_idx))
    return entry._bwd


def _strict_default() -> bool:
    """``JSBP_STRICT=1`` makes every ``jsbp.jit`` strict unless it says otherwise."""
    return os.environ.get("JSBP_STRICT", "") not in ("", "0")


def jit(
    fn=None,
    *,
    out_sbp=None,
    static_argnums=None,
    strict: bool | None = None,
    static_argnames=None,
    donate_argnums=None,
    donate_argnames=None,
):
    """Compile a consistent-view function of global tensors into one ``shard_map`` program.

    Global tensor arguments arrive in ``fn`` as logical ``jax.Array`` s; plain arrays and scalars
    are broadcast (``B``) on the arguments' placement. jsbp infers the layout of every value,
    inserts the cheapest boxing where an op needs one, and returns global tensors whose layouts
    are the inferred ones (``out_sbp`` forces them: one nd-sbp for all outputs, one per output
    leaf, or a function of the output's pytree structure returning one per leaf, for outputs whose
    number is only known once traced). Traced once per input signature.

    >>> step = jsbp.jit(lambda x, w: jnp.tanh(x @ w))  # doctest: +SKIP
    >>> y = step(x, w)   # x: (S(0)), w: (B)  ->  y: (S(0)), no communication  # doctest: +SKIP

    A primitive with no SBP rule runs replicated (operands gathered to B, computed on every
    device) with a ``jsbp.NoRuleWarning``; ``strict=True`` (or ``JSBP_STRICT=1``) makes it an
    ``SbpError`` naming the primitive instead.

    The arguments of ``jax.jit`` have its meaning: ``static_argnums`` (negative ones count from
    the end of the call's positional arguments) and ``static_argnames`` (each completed from the
    other through ``fn``'s signature), ``donate_argnums`` / ``donate_argnames`` (the donated
    global tensors' buffers are given to the program and deleted, as ``jax.jit`` deletes donated
    arrays), keyword arguments at call time (dynamic unless named static), a ``jsbp.jit``
    function called inside another (it becomes part of the caller's program: planned with it, its
    ``out_sbp`` a layout annotation there) and recursion through static arguments.

    What differs from ``jax.jit``:

    * at least one argument is a global tensor (it gives the placement), except when called
      inside another ``jsbp.jit`` function;
    * static arguments are keyed by type and value (``1``, ``1.0``, ``True`` and ``-0.0`` are four
      programs), where ``jax.jit`` keys them by ``==`` and ``hash``;
    * plain (non-global) arrays among the arguments are broadcast copies on the placement:
      donating one donates the copy, not the caller's array;
    * ``.lower(...)`` and ``.trace(...)`` take the same arguments and give the lowering / trace of
      the compiled ``shard_map`` program, whose arguments are the global tensors' *physical*
      arrays (padded blocks, partial addends): its ``compile()`` runs on those arrays, not on
      global tensors;
    * as in ``jax.jit`` (0.10), a negative ``donate_argnums`` donates nothing;
    * ``jsbp.jit`` has no ``in_shardings`` / ``out_shardings``: layouts come from the arguments
      and ``out_sbp`` (or ``jax.sharding.reshard`` / ``to_global`` inside the function).
    """
    if fn is None:
        return functools.partial(
            jit,
            out_sbp=out_sbp,
            static_argnums=static_argnums,
            strict=strict,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
        )
    return JitFunction(
        fn,
        out_sbp=out_sbp,
        static_argnums=static_argnums,
        strict=strict,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
    )
