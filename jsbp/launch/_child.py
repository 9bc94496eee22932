"""What every launched process runs first: ``python .../jsbp/launch/_child.py {path|module} TARGET ARGS``.

It runs the user's script exactly as ``python TARGET ARGS`` (or ``python -m TARGET ARGS``) would,
with one difference: a process that leaves with ``sys.exit(code)``, ``code != 0``, after JAX's
distributed runtime started, exits at once instead of waiting in JAX's shutdown barrier for the
other processes (up to 300 s, or forever if they wait for it in a collective), so the launcher
sees the failure within seconds. Uncaught exceptions get the same treatment from
``jsbp.distributed.initialize`` itself.
"""

from __future__ import annotations

import os
import runpy
import sys


def _distributed_running() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def run(argv: list[str]) -> None:
    kind, target, *args = argv
    try:
        if kind == "module":
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()  # as `python -m target` does
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python target` does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code not in (None, 0) and _distributed_running():
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        raise


if __name__ == "__main__":
    run(sys.argv[1:])
