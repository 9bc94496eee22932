"""Prints the launcher's variables and argv as one JSON line, a line on stderr, and a last line
without a newline (the launcher must still prefix and terminate it). Imports nothing heavy."""

import json
import os
import sys

NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
         "NODE_RANK", "JSBP_DEVICES_PER_PROCESS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")  # fmt: skip
print(json.dumps({"env": {n: os.environ.get(n) for n in NAMES}, "argv": sys.argv[1:]}))
print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr)
sys.stdout.write(f"unterminated {os.environ['RANK']}")
