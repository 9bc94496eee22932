"""Where this process sits in a multi-process run, read from the environment (no JAX here).

Three sources, in this order of precedence:

1. **Launcher variables** (``python -m jsbp.launch``, ``torchrun``, OneFlow's launcher):
   ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` (and optionally
   ``LOCAL_WORLD_SIZE``). If any of the five is set they must be complete and consistent.
2. **A cluster JAX can bootstrap itself** (``jax/_src/clusters``): Open MPI's ``mpirun``
   (``OMPI_MCA_orte_hnp_uri``), a SLURM step (``srun``: ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``,
   ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``), a Kubernetes indexed Job
   (``KUBERNETES_SERVICE_HOST`` + ``JOB_COMPLETION_INDEX``, with the ``kubernetes`` package).
3. **Nothing**: a single process.

Everything here is a pure function of an environment mapping, so it is tested without starting
JAX. ``_runtime`` turns the resulting ``Config`` into a ``jax.distributed.initialize`` call.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping

from ._errors import DistributedError

__all__ = ["Config", "LAUNCH_VARS", "from_environ"]

LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
"""The variables ``python -m jsbp.launch`` (and ``torchrun``) set for every process."""

_SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)
_OMPI_URI = "OMPI_MCA_orte_hnp_uri"


@dataclasses.dataclass(frozen=True)
class Config:
    """How this process joins the run.

    ``source`` is ``"env"`` (launcher variables), ``"ompi"``, ``"slurm"``, ``"k8s"`` (JAX's own
    cluster detection does the bootstrap) or ``"single"``. ``coordinator_address`` is only known
    for ``"env"``; ``world_size`` may be ``None`` for ``"k8s"`` until JAX has asked the API server.
    """

    source: str
    rank: int
    world_size: int | None
    local_rank: int
    local_world_size: int | None = None
    coordinator_address: str | None = None

    @property
    def multi_process(self) -> bool:
        return self.world_size is None or self.world_size > 1


def _show(env: Mapping[str, str], names=LAUNCH_VARS) -> str:
    return ", ".join(f"{n}={env[n]!r}" if n in env else f"{n} unset" for n in names)


def _int(
    env: Mapping[str, str], name: str, *, lo: int, hi: int | None = None, what: str
) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        val = int(raw.strip())
    except ValueError:
        raise DistributedError(
            f"jsbp.distributed: {name}={raw!r} is not an integer; {name} must be {what}. "
            f"(launcher variables: {_show(env)})"
        ) from None
    if val < lo or (hi is not None and val > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise DistributedError(
            f"jsbp.distributed: {name}={val} is out of range; {name} must be {what} ({rng}). "
            f"(launcher variables: {_show(env)})"
        )
    return val


def _host(addr: str, env: Mapping[str, str]) -> str:
    addr = addr.strip()
    if not addr:
        raise DistributedError(
            f"jsbp.distributed: MASTER_ADDR is empty. (launcher variables: {_show(env)})"
        )
    if addr.startswith("["):  # bracketed IPv6, e.g. [::1]
        if not addr.endswith("]"):
            raise DistributedError(
                f"jsbp.distributed: MASTER_ADDR={addr!r} is not a host name or IP address; "
                "give the port in MASTER_PORT, not in MASTER_ADDR."
            )
        return addr
    if addr.count(":") == 1:
        raise DistributedError(
            f"jsbp.distributed: MASTER_ADDR={addr!r} contains a port; set MASTER_ADDR to the host "
            f"only ({addr.split(':')[0]!r}) and MASTER_PORT to the port ({addr.split(':')[1]!r})."
        )
    return f"[{addr}]" if ":" in addr else addr  # bare IPv6


def _from_launch_vars(env: Mapping[str, str]) -> Config:
    world = _int(env, "WORLD_SIZE", lo=1, what="the total number of processes")
    rank = _int(env, "RANK", lo=0, what="this process's global index")
    local_rank = _int(env, "LOCAL_RANK", lo=0, what="this process's index on its machine")
    local_world = _int(
        env, "LOCAL_WORLD_SIZE", lo=1, what="the number of processes on this machine"
    )
    port = _int(env, "MASTER_PORT", lo=1, hi=65535, what="the TCP port of the rank-0 coordinator")
    missing = [n for n, v in (("WORLD_SIZE", world), ("RANK", rank)) if v is None]
    if missing:
        raise DistributedError(
            f"jsbp.distributed: some launcher variables are set but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not ({_show(env)}). Set all of MASTER_ADDR, "
            "MASTER_PORT, WORLD_SIZE, RANK (python -m jsbp.launch does), or unset them all for a "
            "single process."
        )
    if rank >= world:
        raise DistributedError(
            f"jsbp.distributed: RANK={rank} is not smaller than WORLD_SIZE={world}; ranks run from 0 "
            f"to WORLD_SIZE - 1 = {world - 1}. ({_show(env)})"
        )
    if local_rank is None:
        local_rank = 0 if world == 1 else None
    if local_rank is not None and local_rank > rank:
        raise DistributedError(
            f"jsbp.distributed: LOCAL_RANK={local_rank} is larger than RANK={rank}; a process's index "
            f"on its machine cannot exceed its global index. ({_show(env)})"
        )
    if local_world is not None:
        if local_world > world:
            raise DistributedError(
                f"jsbp.distributed: LOCAL_WORLD_SIZE={local_world} is larger than WORLD_SIZE={world}. "
                f"({_show(env)})"
            )
        if local_rank is not None and local_rank >= local_world:
            raise DistributedError(
                f"jsbp.distributed: LOCAL_RANK={local_rank} is not smaller than "
                f"LOCAL_WORLD_SIZE={local_world}. ({_show(env)})"
            )
    if world == 1:
        return Config("single", 0, 1, 0, 1)
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK") if env.get(n) is None]
    if missing:
        raise DistributedError(
            f"jsbp.distributed: WORLD_SIZE={world} processes need "
            f"{' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not set "
            f"({_show(env)}). MASTER_ADDR:MASTER_PORT is where rank 0 serves the coordinator and "
            "LOCAL_RANK is the process's index on its machine; python -m jsbp.launch sets them."
        )
    addr = _host(env["MASTER_ADDR"], env)
    return Config("env", rank, world, local_rank, local_world, f"{addr}:{port}")


def _cluster(env: Mapping[str, str]) -> Config | None:
    """JAX's own cluster detection, read from environment variables only (same order as JAX)."""

    def ints(*names):
        try:
            return tuple(int(env[n]) for n in names)
        except (KeyError, ValueError):
            return None

    if _OMPI_URI in env:
        got = ints("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
        if got is not None:
            world, rank, local = got
            return Config("ompi" if world > 1 else "single", rank if world > 1 else 0, world, local)
    if all(n in env for n in _SLURM_VARS):
        got = ints("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
        if got is None:
            raise DistributedError(
                "jsbp.distributed: a SLURM step was detected but its variables are not integers: "
                + _show(env, ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"))
            )
        world, rank, local = got
        return Config("slurm" if world > 1 else "single", rank if world > 1 else 0, world, local)
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        if importlib.util.find_spec("kubernetes") is None:
            raise DistributedError(
                "jsbp.distributed: this looks like a Kubernetes indexed Job (KUBERNETES_SERVICE_HOST "
                "and JOB_COMPLETION_INDEX are set), but JAX needs the `kubernetes` package to find "
                "its peers: pip install 'jax[k8s]', or set MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, "
                "LOCAL_RANK yourself."
            )
        got = ints("JOB_COMPLETION_INDEX")
        return Config("k8s", got[0] if got else 0, None, 0)
    return None


def from_environ(env: Mapping[str, str]) -> Config:
    """The ``Config`` the environment ``env`` describes; raises ``DistributedError`` if it is
    partial or contradictory."""
    if any(env.get(n) is not None for n in LAUNCH_VARS):
        return _from_launch_vars(env)
    cluster = _cluster(env)
    if cluster is not None:
        return cluster
    return Config("single", 0, 1, 0, 1)


def devices_per_process(env: Mapping[str, str]) -> int | None:
    """``JSBP_DEVICES_PER_PROCESS``: the number of simulated CPU devices each process gets."""
    return _int(
        env,
        "JSBP_DEVICES_PER_PROCESS",
        lo=1,
        what="the number of simulated CPU devices per process",
    )
