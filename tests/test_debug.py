"""jsbp.debug.count_collectives: counts what XLA really compiled, as DESIGN names it."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

import jsbp
from jsbp.debug import collectives_in_hlo, count_collectives

KEYS = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"}
ZERO = dict.fromkeys(KEYS, 0)


def _with(**kw):
    out = dict(ZERO)
    out.update({k.replace("_", "-"): v for k, v in kw.items()})
    return out


# -- parsing HLO text -------------------------------------------------------------------------------


def test_parse_plain_instructions():
    hlo = """
  %all-gather = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %all-reduce.1 = f32[8]{0} all-reduce(f32[8]{0} %x), channel_id=2, to_apply=%add
  ROOT %reduce-scatter = f32[2]{0} reduce-scatter(f32[8]{0} %all-reduce.1), dimensions={0}, to_apply=%add
  %cp = s32[] collective-permute(s32[] %i), source_target_pairs={{0,1},{1,0}}
"""
    assert collectives_in_hlo(hlo) == _with(
        all_gather=1, all_reduce=1, reduce_scatter=1, collective_permute=1
    )


def test_parse_tuple_shaped_all_to_all_with_index_comments():
    # XLA:CPU writes an all-to-all over 8 devices as a tuple; the "/*index=5*/" comment holds an "="
    hlo = (
        "  %all-to-all = (f32[1,1]{1,0}, f32[1,1]{1,0}, f32[1,1]{1,0}, f32[1,1]{1,0}, f32[1,1]{1,0}, "
        "/*index=5*/f32[1,1]{1,0}, f32[1,1]{1,0}, f32[1,1]{1,0}) all-to-all(%a, %b, %c, %d, %e, "
        "/*index=5*/%f, %g, %h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}\n"
    )
    assert collectives_in_hlo(hlo) == _with(all_to_all=1)


def test_parse_async_pairs_count_once():
    hlo = """
  %ag-start = (f32[2]{0}, f32[8]{0}) all-gather-start(f32[2]{0} %p), dimensions={0}
  %ag-done = f32[8]{0} all-gather-done((f32[2]{0}, f32[8]{0}) %ag-start)
  %ar-start = f32[8]{0} all-reduce-start(f32[8]{0} %x), to_apply=%add
  %ar-done = f32[8]{0} all-reduce-done(f32[8]{0} %ar-start)
"""
    assert collectives_in_hlo(hlo) == _with(all_gather=1, all_reduce=1)


def test_parse_ignores_operand_names_and_metadata():
    hlo = """
  %fusion = f32[8]{0} fusion(f32[8]{0} %all-gather.3, f32[8]{0} %all-reduce), kind=kLoop, metadata={op_name="jit(f)/all-gather"}
  %add = f32[8]{0} add(f32[8]{0} %all-to-all.2, f32[8]{0} %reduce-scatter.1)
"""
    assert collectives_in_hlo(hlo) == ZERO


def test_parse_empty():
    assert collectives_in_hlo("") == ZERO


# -- compiling functions ----------------------------------------------------------------------------


def test_counts_a_plain_shard_map_program():
    mesh = jsbp.placement("cpu", [0, 1, 2, 3], axis_names="i").mesh

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=PS("i"), out_specs=PS())
    def f(x):
        return jax.lax.psum(x, "i")

    x = jax.device_put(np.ones(4, np.float32), jax.sharding.NamedSharding(mesh, PS("i")))
    assert count_collectives(f, x) == _with(all_reduce=1)


def test_counts_boxing_of_global_tensors():
    x = jsbp.zeros(16, 8, placement=jsbp.placement("cpu", range(8)), sbp="S(0)")
    assert count_collectives(lambda t: t.to_global(sbp="B"), x) == _with(all_gather=1)
    assert count_collectives(lambda t: t.to_global(sbp="S(1)"), x) == _with(all_to_all=1)
    assert count_collectives(lambda t: t.to_global(sbp="P"), x) == ZERO


def test_returns_every_key():
    x = jsbp.zeros(4, placement=jsbp.placement("cpu", [0, 1]), sbp="B")
    got = count_collectives(lambda t: t, x)
    assert set(got) == KEYS and got == ZERO


def test_uses_lower_of_a_jitted_function_and_passes_kwargs():
    x = jsbp.zeros(8, placement=jsbp.placement("cpu", range(4)), sbp="P")

    def f(t, *, to):
        return t.to_global(sbp=to).to_jax()

    f_static = jax.jit(f, static_argnames="to")  # has .lower: used as is
    assert count_collectives(f_static, x, to="B") == _with(all_reduce=1)
    assert count_collectives(f_static, x, to="S(0)") == _with(reduce_scatter=1)


def test_does_not_execute_the_function():
    calls = []

    def f(t):
        jax.debug.callback(lambda: calls.append(1))
        return t.to_global(sbp="B")

    x = jsbp.zeros(8, placement=jsbp.placement("cpu", range(4)), sbp="S(0)")
    assert count_collectives(f, x) == _with(all_gather=1)
    assert calls == []


def test_counts_a_gradient_program():
    x = jsbp.zeros(8, 4, placement=jsbp.placement("cpu", range(4)), sbp="S(0)")

    def loss(t):
        return jnp.sum(t.to_global(sbp="B").to_jax() ** 2)

    # forward: one all-gather; backward: B -> S(0) is a local slice
    assert count_collectives(jax.grad(loss), x) == _with(all_gather=1)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_counts_several_collectives_in_one_program(n):
    x = jsbp.zeros(16, 8, placement=jsbp.placement("cpu", range(n)), sbp="P")

    def f(t):
        a = t.to_global(sbp="S(0)")  # reduce-scatter
        b = a.to_global(sbp="S(1)")  # all-to-all
        return b.to_global(sbp="B")  # all-gather

    assert count_collectives(f, x) == _with(reduce_scatter=1, all_to_all=1, all_gather=1)


def test_combined_all_reduce_counts_each_operand():
    # XLA's all-reduce combiner fuses independent reductions; each operand is one planned collective
    hlo = (
        "%all-reduce.1 = (f32[64]{0}, f32[3,4]{1,0}, f32[2]{0}) all-reduce(f32[64]{0} %a, "
        "f32[3,4]{1,0} %b, f32[2]{0} %c), channel_id=1, replica_groups={{0,1}}, to_apply=%add\n"
    )
    assert collectives_in_hlo(hlo) == _with(all_reduce=3)


def test_fused_gradient_reductions_match_the_plan():
    import jax
    import jax.numpy as jnp

    p = jsbp.placement.all("cpu")
    params = [jsbp.tensor(np.ones((4 + i, 3), np.float32), p, "B") for i in range(5)]
    x = jsbp.tensor(np.ones((8, 4), np.float32), p, "S(0)")

    def step(ps, x):
        g = jax.grad(lambda ps: sum(jnp.sum(jnp.tanh(x[:, :1] @ q[:1])) for q in ps))(ps)
        return [q - 0.1 * gi for q, gi in zip(ps, g)]

    f = jsbp.jit(step, out_sbp="B")
    # the five gradients' all-reduces, each read by its update, run as one combined collective
    # (``jsbp._combine``: the updates wait with them); XLA's count and the plan's agree
    assert (
        count_collectives(f, params, x)
        == jsbp.explain(f, params, x).collectives()
        == _with(all_reduce=1)
    )
    rows = [b for b in jsbp.explain(f, params, x).boxings() if b.collectives == ("all-reduce",)]
    assert len(rows) == 5 and {b.combined for b in rows} == {0}


def test_count_collectives_compiles_a_plain_function_like_explain():
    """jnp calls on global tensors only trace under jsbp.jit: count_collectives compiles a plain
    function that way, so it always agrees with explain (issue 19 item 6)."""
    import jax.numpy as jnp

    plc = jsbp.placement("cpu", [0, 1, 2, 3])
    x = jsbp.tensor(np.arange(32.0, dtype=np.float32).reshape(8, 4), placement=plc, sbp="S(0)")
    w = jsbp.tensor(np.ones((4, 4), np.float32), placement=plc, sbp="S(1)")
    f = lambda a, b: jnp.tanh(a @ b).sum()
    counts = jsbp.debug.count_collectives(f, x, w)
    assert counts == jsbp.explain(f, x, w).collectives()
    assert sum(counts.values()) >= 1
    # the eager API still compiles with jax.jit
    assert jsbp.debug.count_collectives(lambda a: a.to_global(sbp="B"), x)["all-gather"] == 1


def test_placement_error_is_an_sbp_error():
    assert issubclass(jsbp.PlacementError, jsbp.SbpError)
    assert issubclass(jsbp.PlacementError, ValueError)
    a = jsbp.tensor(np.ones(4, np.float32), placement=jsbp.placement("cpu", [0, 1]), sbp="B")
    b = jsbp.tensor(np.ones(4, np.float32), placement=jsbp.placement("cpu", [2, 3]), sbp="B")
    with pytest.raises(jsbp.SbpError, match="placement"):
        a + b


def test_estimate_is_the_cost_models_prediction_of_the_plan():
    """jsbp.debug.estimate: the plan's collectives and bytes as the cost model counts them, for a
    jsbp.jit function or a plain one (compiled like explain); the rates come from ``cost``."""
    import jax.numpy as jnp

    plc = jsbp.placement("cpu", [0, 1, 2, 3])
    x = jsbp.tensor(np.ones((8, 4), np.float32), placement=plc, sbp="S(0)")
    gather = jsbp.jit(lambda a: a * 2, out_sbp="B")
    e = jsbp.debug.estimate(gather, x)
    assert e.collectives == 1 and e.comm_bytes == 3 / 4 * 8 * 4 * 4  # the 3 blocks a device lacks
    assert e.input_bytes == 2 * 4 * 4 and e.peak_bytes >= e.input_bytes and e.seconds > 0
    local = jsbp.debug.estimate(lambda a: jnp.tanh(a), x)  # a plain function: no communication
    assert local.collectives == 0 and local.comm_bytes == 0
    slow = jsbp.debug.estimate(gather, x, cost=jsbp.CostModel(latency=1.0))
    assert slow.seconds > 1.0 > e.seconds
