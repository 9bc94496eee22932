"""Run the op sweep (tests/test_op_sweep.py) and print functions x cases, pass / raise / fail.

    python benchmarks/op_sweep_report.py            # the full sweep (JSBP_FULL=1), pytest -n 2
    python benchmarks/op_sweep_report.py --sample   # the default sample only
    python benchmarks/op_sweep_report.py --log L    # only summarise an existing JSONL log

"raise" is a clear jsbp.SbpError (allowed: raise instead of compute), listed with the primitive
it names; "fail" is a wrong value or any other exception. Primitives without a rule that ran
replicated (a NoRuleWarning, not a failure) are listed per function too.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def summarise(path: str, wall: float | None = None) -> str:
    rs = [json.loads(line) for line in open(path)]
    st = collections.Counter(r["status"] for r in rs)
    fns = {r["fn"].split("[")[0] for r in rs}
    lines = [
        f"functions: {len(fns)}   variants: {len({r['variant'] for r in rs})}   cases: {len(rs)}"
        + (f"   wall: {wall:.0f} s" if wall is not None else ""),
        f"pass: {st['pass']}   raise (SbpError): {st['raise']}   fail: {st['fail']}",
    ]
    raises = collections.defaultdict(collections.Counter)
    for r in rs:
        if r["status"] == "raise":
            raises[r["fn"]][r["primitive"] or r["detail"][:80]] += 1
    if raises:
        lines.append("\nraises (function -> primitive named: cases):")
        for fn in sorted(raises):
            lines.append(
                f"  {fn} -> " + ", ".join(f"{p}: {n}" for p, n in raises[fn].most_common())
            )
    repl = collections.defaultdict(set)
    for r in rs:
        for prim in r.get("replicated") or ():
            repl[r["fn"]].add(prim)
    if repl:
        lines.append("\nran replicated (no rule, NoRuleWarning; function -> primitives):")
        for fn in sorted(repl):
            lines.append(f"  {fn} -> {', '.join(sorted(repl[fn]))}")
    fails = collections.defaultdict(list)
    for r in rs:
        if r["status"] == "fail":
            fails[r["variant"]].append(r)
    if fails:
        lines.append("\nfailures (function: cases, first message):")
        for fn in sorted(fails):
            lines.append(
                f"  {fn}: {len(fails[fn])}  e.g. {fails[fn][0]['id']}: {fails[fn][0]['detail'][:160]}"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sample", action="store_true", help="the default sample, not the full sweep")
    ap.add_argument("--log", help="summarise this JSONL log instead of running")
    ap.add_argument("-n", default="2", help="pytest-xdist workers")
    a = ap.parse_args()
    if a.log:
        print(summarise(a.log))
        return 0
    fd, log = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    env = dict(os.environ, JSBP_SWEEP_LOG=log)
    env.pop("JSBP_FULL", None)
    if not a.sample:
        env["JSBP_FULL"] = "1"
    t = time.time()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/test_op_sweep.py",
        "-q",
        "-n",
        a.n,
        "-p",
        "no:cacheprovider",
    ]
    subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    print(summarise(log, time.time() - t))
    print(f"\n(log: {log})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
