"""The launcher's watch over a running job: who failed first, who left early, nothing moves."""

from __future__ import annotations

import argparse
import signal
import subprocess
import threading
import time

from ._options import TIMEOUT_STATUS
from ._ranks import Rank, describe, exit_status, say, stop
from ._stacks import dump_stacks, main_stack, portrait, where

__all__ = ["Job"]


class Job:
    """The ranks of one launch and the rules that end it early (see ``jsbp.launch``)."""

    def __init__(
        self, a: argparse.Namespace, ranks: list[Rank], lock: threading.Lock, coordinator: str
    ):
        self.a = a
        self.ranks = ranks
        self.lock = lock
        self._next_read = 0.0
        self._finished: dict[int, float] = {}
        self.coordinator = coordinator  # MASTER_ADDR:MASTER_PORT: rank 0's coordination service

    def procs(self) -> list[subprocess.Popen]:
        return [r.proc for r in self.ranks]

    def stop(self, sig: int = signal.SIGTERM) -> float:
        for r in self.ranks:
            r.freeze_fatal()
        t = time.time()
        stop(self.procs(), sig, self.a.grace_period)
        return t

    def _name(self, r: Rank) -> str:
        """``rank R``; rank 0 of a multi-process job is also the coordinator the others join."""
        if r.rank == 0 and self.a.nnodes * self.a.nproc_per_node > 1:
            return (
                f"rank 0 (the coordinator: it serves JAX's coordination service at "
                f"{self.coordinator}, which every other rank needs)"
            )
        return f"rank {r.rank}"

    def failure(self) -> int | None:
        """If a rank failed (exited non-zero): stop the others, blame the first; the status."""
        if not any(r.exited and r.code != 0 for r in self.ranks):
            return None
        cands = [r for r in self.ranks if r.failed_at() is not None]
        first = min(cands, key=lambda r: (r.failed_at(), r.rank))
        if not first.exited:  # it noted its failure and is exiting: let it finish, briefly
            deadline = time.monotonic() + min(2.0, self.a.grace_period)
            while not first.exited and time.monotonic() < deadline:
                time.sleep(0.02)
        alive = sum(not r.exited for r in self.ranks)
        if alive:
            what = (
                describe(first.code) if first.exited and not first.vanished()
                else self._how(first, float("inf"))
            )  # fmt: skip
            others = "the other " if first.exited else ""
            say(f"rank {first.rank} {what}; stopping {others}{alive} process(es)")
        stopped_at = self.stop()
        fails = sorted(
            (
                (r.failed_at(before=stopped_at), r)
                for r in self.ranks
                if r.failed_at(before=stopped_at) is not None
            ),
            key=lambda tr: (tr[0], tr[1].rank),
        )
        t0, first = fails[0]
        rep = first.report()
        if first.exit_t is not None and first.exit_t < stopped_at:
            code = first.code
            what = self._how(first, stopped_at)
        else:  # stopped while it was exiting after its failure
            code = (rep or {}).get("code") or 1
            what = self._how(first, stopped_at) + ", stopped while exiting"
        lines = [
            f"failed: {self._name(first)} {what}"
            + (" (the first rank to fail)" if len(fails) > 1 else "")
        ]
        fatal = first.fatal()
        if fatal is not None:
            w = where(main_stack(fatal[1]))
            head = [ln.strip() for ln in fatal[1][:1] if ln.startswith("Fatal Python error")]
            if head or w:
                lines.append(f"rank {first.rank}: " + ", ".join(head + ([w] if w else [])))
        tail = first.tail(8)
        if tail:
            lines.append(f"last lines of rank {first.rank}:")
            lines += [f"  | {ln}" for ln in tail]
        rest = [
            f"rank {r.rank} {self._how(r, stopped_at)} {_after(_seen(r) - _seen(first), first.rank)}"
            for _, r in fails[1:]
        ]
        others = [
            r.rank
            for r in self.ranks
            if r is not first
            and r.failed_at(before=stopped_at) is None
            and r.exit_t is not None
            and r.exit_t >= stopped_at
        ]
        if rest:
            lines.append("consequences: " + "; ".join(rest))
        if others:
            lines.append(f"stopped by the launcher: rank(s) {', '.join(map(str, others))}")
        say("\n".join(lines))
        return exit_status(code) or 1

    @staticmethod
    def _how(r: Rank, stopped_at: float) -> str:
        """How a rank failed: its exit, and the error it reported."""
        rep = r.report()
        error = (
            f" ({rep['error']})"
            if rep and rep.get("state") == "failed" and rep.get("error")
            else ""
        )
        if r.exit_t is not None and r.exit_t < stopped_at:
            if r.vanished():
                return (
                    "exited with code 0 before its script finished (os._exit, or the process "
                    "ended under it) while the other ranks still ran"
                )
            return describe(r.code) + error
        code = rep.get("code") if rep else None
        return f"failed with code {code}{error}"

    def _refresh(self, now: float) -> None:
        if now < self._next_read:
            return
        self._next_read = now + 0.25
        for r in self.ranks:
            if r.rank not in self._finished:
                t = r.finished_at()
                if t is not None:
                    self._finished[r.rank] = t

    def watch(self, now: float) -> int | None:
        """End the job if a rank left early or nothing moves; the status, or None to go on."""
        self._refresh(now)
        a = self.a
        running = [r for r in self.ranks if not r.exited and r.rank not in self._finished]
        if not running:
            return None
        if self._finished and a.exit_timeout > 0:
            rank, t = min(self._finished.items(), key=lambda kv: kv[1])
            since = max([t] + [r.progress() for r in running])
            if now - since >= a.exit_timeout:
                left = next(r for r in self.ranks if r.rank == rank)
                names = ", ".join(str(r.rank) for r in running)
                how = (
                    "left (its process exited with code 0 before its script finished)"
                    if (left.vanished())
                    else "finished (exit code 0)"
                )
                say(
                    f"rank {rank} {how} {now - t:.1f} s ago while rank(s) {names} still run and "
                    f"made no progress for {now - since:.1f} s (--exit-timeout {a.exit_timeout:g} "
                    "s): a rank that leaves early makes the others wait for it in their next "
                    f"collective. Stopping {sum(not r.exited for r in self.ranks)} process(es). "
                    "Where they were:"
                )
                self._explain(running, now, also=[left])
                say(
                    f"failed: {self._name(left)} left early: it finished while rank(s) {names} "
                    f"kept running for {now - t:.1f} s"
                )
                return TIMEOUT_STATUS
        if a.timeout > 0:
            last = max(r.progress() for r in running)
            if now - last >= a.timeout:
                names = ", ".join(str(r.rank) for r in running)
                say(
                    f"no progress for {now - last:.1f} s (--timeout {a.timeout:g} s): no running rank "
                    f"({names}) printed a line or called jsbp.distributed.heartbeat(). Hung or "
                    "deadlocked (a rank that skipped a collective, or ranks in different "
                    f"collectives); stopping {sum(not r.exited for r in self.ranks)} process(es). "
                    "Where they were:"
                )
                stacks = self._explain(running, now)
                where_ = "; ".join(
                    f"rank {r.rank} {stacks.get(r.rank, '(no stack)')}" for r in running
                )
                say(f"failed: no progress for {now - last:.1f} s: {where_}")
                return TIMEOUT_STATUS
        return None

    def _explain(self, running: list[Rank], now: float, also: list[Rank] = ()) -> dict[int, str]:
        stacks = dump_stacks(running + [r for r in also if not r.exited], self.lock)
        now = time.time()
        for r in list(also) + running:
            say("  " + portrait(r, stacks, now))
        self.stop()
        return stacks


def _seen(r: Rank) -> float:
    """When the launcher learnt that ``r`` failed: its report or fatal record, else its exit."""
    rep, fatal = r.report(), r.fatal()
    times = [t for t in (rep["t"] if rep and rep.get("state") == "failed" else None,
                         fatal[0] if fatal else None, r.exit_t) if t is not None]  # fmt: skip
    return min(times) if times else time.time()


def _after(dt: float, first: int) -> str:
    if dt >= 0:
        return f"{dt:.3f} s after rank {first}"
    return f"{-dt:.3f} s before the launcher saw rank {first} end (it ended without a word)"
