"""CPU threads for a training rank: how many intra-op threads each rank gets, chosen from the
cores this process may use, and a warning when the machine has fewer cores than the work on it.

Why Omni chooses. torch starts one intra-op thread per core of the machine in every process. An
OpenMP team of that size is only fast while each of its threads has a core: the team waits at
every parallel region for its slowest thread, so when other processes (the run's own data
workers, other ranks, other jobs) take a core, every region waits for a time slice. On a busy
2-core machine the demo's 40 steps took 288 s with torch's two threads, 16 s with one (issue 36).

The choice is a function of the configuration alone (the CPU affinity, the cgroup quota, the
ranks on the node, the data workers per rank), never of the load at start-up: the thread count
changes how a CPU matmul splits its sums, and a run resumed on a busier machine must compute
what the first one computed. The load only earns a warning. An ``OMP_NUM_THREADS`` in the
environment wins (torchrun sets 1 when it starts several ranks on a node).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_max(text: Optional[str]) -> Optional[float]:
    """cgroup v2 ``cpu.max`` ("QUOTA PERIOD", "max PERIOD": no limit) as cores, or None."""
    parts = (text or "").split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: Optional[str], period_text: Optional[str]) -> Optional[float]:
    """cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1: no limit) as cores, or None."""
    try:
        quota, period = int((quota_text or "").strip()), int((period_text or "").strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except OSError:
        return None


def _up_to(folder: Path, root: Path) -> list[Path]:
    """``folder`` and its parents down to ``root``: a parent's quota caps its children too."""
    out = [folder]
    while folder != root and root in folder.parents:
        folder = folder.parent
        out.append(folder)
    return out


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Optional[str] = None) -> Optional[float]:
    """The CPU quota of this process's cgroup in cores (the smallest on its path), None when there
    is none. ``proc_cgroup``: the text of ``/proc/self/cgroup`` (read when None)."""
    text = _read(Path("/proc/self/cgroup")) if proc_cgroup is None else proc_cgroup
    limits: list[float] = []
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if controllers == "":  # v2: one unified tree
            for folder in _up_to(root / rel, root):
                limits.append(parse_cpu_max(_read(folder / "cpu.max")))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own tree
            for mount in {root / controllers, root / "cpu", root / "cpu,cpuacct"}:
                for folder in _up_to(mount / rel, mount):
                    limits.append(parse_cfs(_read(folder / "cpu.cfs_quota_us"),
                                            _read(folder / "cpu.cfs_period_us")))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def affinity_cores() -> int:
    """The cores the scheduler lets this process run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def available_cores(affinity: int, quota: Optional[float]) -> int:
    """Cores this process may keep busy: its affinity, capped by the cgroup quota (rounded down:
    a team larger than the quota is throttled mid-region), at least 1."""
    cores = affinity if quota is None else min(affinity, math.floor(quota))
    return max(1, cores)


@dataclass(frozen=True)
class ThreadChoice:
    """Each rank's intra-op threads and why."""

    threads: int
    cores: int  # available to the process (affinity, quota)
    ranks: int  # training ranks on this node
    data_workers: int  # data worker processes per rank
    explicit: Optional[str] = None  # OMP_NUM_THREADS as given: Omni left the threads alone

    def describe(self) -> str:
        """For the banner: "1 CPU thread per rank (2 cores, 1 rank, 1 data worker each; OMP_NUM_THREADS
        overrides)", or "4 CPU threads per rank (OMP_NUM_THREADS=4)"."""
        head = f"{self.threads} CPU thread{'s' * (self.threads != 1)} per rank"
        if self.explicit is not None:
            return f"{head} (OMP_NUM_THREADS={self.explicit})"
        return (f"{head} ({self.cores} core{'s' * (self.cores != 1)}, {self.ranks} rank{'s' * (self.ranks != 1)}, "
                f"{self.data_workers} data worker{'s' * (self.data_workers != 1)} each; OMP_NUM_THREADS overrides)")


def choose_threads(env: Mapping[str, str], cores: int, data_workers: int, current: int) -> ThreadChoice:
    """Each rank's threads: the node's available ``cores`` shared out over its ranks
    (``LOCAL_WORLD_SIZE``, torchrun's), less the rank's ``data_workers`` (processes that build the
    next steps while the rank computes), at least 1. An ``OMP_NUM_THREADS`` in ``env`` is kept:
    ``current`` (the threads torch took from it) is reported."""
    try:
        ranks = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    explicit = env.get("OMP_NUM_THREADS")
    if explicit is not None and explicit.strip():
        return ThreadChoice(current, cores, ranks, data_workers, explicit=explicit.strip())
    threads = max(1, cores // ranks - data_workers)
    return ThreadChoice(threads, cores, ranks, data_workers)


def oversubscription(choice: ThreadChoice, machine_cores: int, load: Optional[float]) -> Optional[str]:
    """A warning when the work will not fit the cores, None when it does: more ranks than cores,
    OpenMP teams that with the data workers need more cores than there are, or another load (the
    1-minute load average, rounded, against the machine's cores) beside this run's threads. A team
    that loses a core waits for it at every parallel region: that is "many times slower"."""
    ours = choice.ranks * choice.threads
    if choice.ranks > choice.cores:
        what, fix = f"{choice.ranks} ranks share {choice.cores} core(s)", "start fewer ranks per node"
    elif choice.threads > 1 and choice.ranks * (choice.threads + choice.data_workers) > choice.cores:
        what = (f"{choice.ranks} rank(s) x ({choice.threads} threads + {choice.data_workers} data worker(s)) "
                f"on {choice.cores} core(s)")
        fix = "set OMP_NUM_THREADS=1 (or unset it to let Omni choose)"
    elif load is not None and round(load) + ours > machine_cores:
        what = f"the load average is {load:.1f} on {machine_cores} core(s) before this run's {ours} thread(s)"
        fix = "run when the other jobs are done" + (", or set OMP_NUM_THREADS=1" if choice.threads > 1 else "")
    else:
        return None
    slower = "many times slower" if choice.threads > 1 or choice.ranks > choice.cores else "slower"
    return f"omni: warning: the machine is oversubscribed: {what}; steps will run {slower}: {fix}"


def _load() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def set_threads(data_workers: int, env: Optional[Mapping[str, str]] = None) -> ThreadChoice:
    """Choose and set this rank's intra-op threads (``torch.set_num_threads``, and the inter-op
    pool's size while torch still allows it: only before its first parallel work); print the
    oversubscription warning once per node (local rank 0). Returns the choice, for the banner."""
    import torch

    env = os.environ if env is None else env
    cores = available_cores(affinity_cores(), cgroup_quota())
    choice = choose_threads(env, cores, data_workers, torch.get_num_threads())
    if choice.explicit is None:
        torch.set_num_threads(choice.threads)
        try:
            torch.set_num_interop_threads(choice.threads)
        except RuntimeError:
            pass  # already started (an earlier run in this process): it keeps its size
    warning = oversubscription(choice, os.cpu_count() or cores, _load())
    if warning and env.get("LOCAL_RANK", "0") == "0":
        print(warning, file=sys.stderr, flush=True)
    return choice
