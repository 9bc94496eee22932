"""Higher-order primitives (jit, custom_jvp_call, custom_vjp_call, remat, scan, while, cond) are
handled by the compiler itself (``jsbp._compiler``): call-like ones are inlined, loops get a
fixed-point carry layout, cond branches are boxed to one output layout. This module lists them so
the registry can report them as supported."""

# fmt: off
HANDLED_BY_COMPILER = (
    "jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
    "custom_vjp_call_jaxpr", "custom_lin", "remat", "checkpoint", "scan", "while", "cond",
    "jsbp_to_global", "custom_linear_solve", "reshard", "sharding_constraint",
)
# fmt: on
