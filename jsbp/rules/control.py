"""Higher-order primitives (jit, custom_jvp_call, custom_vjp_call, remat, scan, while, cond) and
layout requests are handled by the planner itself (``jsbp._problem``): call-like ones are inlined,
loops and branches are part of the problem with their boundary layouts chosen with the rest, a
request's value is boxed to the layout it asks for. This module lists them so the registry can
report them as supported."""

# fmt: off
HANDLED_BY_COMPILER = (
    "jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
    "custom_vjp_call_jaxpr", "custom_lin", "remat", "checkpoint", "scan", "while", "cond",
    "jsbp_to_global", "custom_linear_solve", "reshard", "sharding_constraint",
)
# fmt: on
