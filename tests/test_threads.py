"""CPU threads (issue 36): each rank's intra-op threads follow the cores it may use (affinity,
cgroup quota) over the node's ranks less its data workers, an OMP_NUM_THREADS wins, the banner
says what was chosen, oversubscription is one warning line, and the data plane's pool workers
compute with one thread."""
from __future__ import annotations

import re

import pytest
import torch

from recipe_helpers import tiny_overrides
from recipes.cli import main
from recipes.threads import (ThreadChoice, available_cores, cgroup_quota, choose_threads, oversubscription,
                             parse_cfs, parse_cpu_max)


def test_cgroup_quota_text():
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cpu_max("") is None and parse_cpu_max(None) is None
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("200000\n", "100000\n") == 2.0
    assert parse_cfs(None, "100000") is None


def test_cgroup_quota_is_the_smallest_on_the_process_path(tmp_path):
    # v2: the process's own cgroup has no limit, its parent allows 3 cores, the root 6.
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("600000 100000\n")
    (tmp_path / "job" / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "job" / "step" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path, "0::/job/step\n") == 3.0
    assert cgroup_quota(tmp_path, "0::/\n") == 6.0
    # v1: the cpu controller's tree (mounted as cpu,cpuacct), no quota above.
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "slurm").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "slurm" / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu,cpuacct" / "slurm" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(v1, "4:memory:/x\n2:cpu,cpuacct:/slurm\n") == 2.5
    assert cgroup_quota(tmp_path / "none", "0::/\n") is None


def test_the_choice():
    # the quota caps the affinity, rounded down, never below one core
    assert available_cores(8, None) == 8 and available_cores(8, 2.5) == 2 and available_cores(8, 0.5) == 1
    assert available_cores(2, 16.0) == 2
    # the node's cores over its ranks, less each rank's data workers
    assert choose_threads({}, cores=8, data_workers=0, current=8).threads == 8
    assert choose_threads({"LOCAL_WORLD_SIZE": "4"}, cores=8, data_workers=0, current=8).threads == 2
    assert choose_threads({"LOCAL_WORLD_SIZE": "2"}, cores=8, data_workers=1, current=8).threads == 3
    assert choose_threads({}, cores=2, data_workers=1, current=2).threads == 1  # the demo on 2 cores
    assert choose_threads({"LOCAL_WORLD_SIZE": "8"}, cores=2, data_workers=1, current=2).threads == 1
    # an explicit OMP_NUM_THREADS is kept: the threads torch took from it are reported
    kept = choose_threads({"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "4"}, cores=8, data_workers=1, current=3)
    assert kept.threads == 3 and kept.explicit == "3"
    assert kept.describe() == "3 CPU threads per rank (OMP_NUM_THREADS=3)"
    assert choose_threads({}, cores=2, data_workers=1, current=2).describe() == \
        "1 CPU thread per rank (2 cores, 1 rank, 1 data worker each; OMP_NUM_THREADS overrides)"


def test_oversubscription_is_one_warning():
    fits = ThreadChoice(threads=1, cores=2, ranks=1, data_workers=1)
    assert oversubscription(fits, machine_cores=2, load=0.3) is None
    assert oversubscription(fits, machine_cores=2, load=None) is None
    busy = oversubscription(fits, machine_cores=2, load=3.6)
    assert busy.startswith("omni: warning: the machine is oversubscribed: the load average is 3.6 on 2 core(s)")
    assert "\n" not in busy
    # a team of two beside one other busy process: the team waits for its descheduled thread
    team = ThreadChoice(threads=2, cores=2, ranks=1, data_workers=0)
    assert oversubscription(team, machine_cores=2, load=0.2) is None
    assert "many times slower" in oversubscription(team, machine_cores=2, load=1.0)
    assert "OMP_NUM_THREADS=1" in oversubscription(team, machine_cores=2, load=1.0)
    # several ranks on too few cores, or teams that with the data workers do not fit
    crowded = oversubscription(ThreadChoice(threads=1, cores=2, ranks=4, data_workers=1), 2, 0.0)
    assert "4 ranks share 2 core(s)" in crowded
    explicit = oversubscription(ThreadChoice(threads=4, cores=8, ranks=2, data_workers=1, explicit="4"), 8, 0.0)
    assert "2 rank(s) x (4 threads + 1 data worker(s)) on 8 core(s)" in explicit


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_set_threads_follows_the_environment(monkeypatch, threads_restored, capsys):
    from recipes import threads

    monkeypatch.setattr(threads, "affinity_cores", lambda: 3)
    monkeypatch.setattr(threads, "cgroup_quota", lambda: None)
    monkeypatch.setattr(threads, "_load", lambda: 0.0)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 3)
    torch.set_num_threads(1)
    assert threads.set_threads(1, env={}).threads == 2 and torch.get_num_threads() == 2
    # OMP_NUM_THREADS set: torch's threads are left as they are
    choice = threads.set_threads(0, env={"OMP_NUM_THREADS": "1"})
    assert choice.explicit == "1" and torch.get_num_threads() == 2
    assert capsys.readouterr().err == ""
    # an oversubscribed machine: one warning line, from local rank 0 only
    monkeypatch.setattr(threads, "_load", lambda: 5.0)
    threads.set_threads(0, env={"LOCAL_RANK": "1"})
    assert capsys.readouterr().err == ""
    threads.set_threads(0, env={})
    err = capsys.readouterr().err
    assert err.startswith("omni: warning: the machine is oversubscribed") and err.count("\n") == 1


def _worker_threads(_):
    return torch.get_num_threads()


def test_pool_workers_compute_with_one_thread(threads_restored):
    from dataloading.processes import imap_in_workers

    torch.set_num_threads(2)  # a forked worker would start a team of the parent's size
    assert list(imap_in_workers(_worker_threads, range(2), workers=2)) == [1, 1]
    assert torch.get_num_threads() == 2  # the parent's own are untouched


def test_the_banner_says_the_threads(demo_root, tmp_path, capsys, monkeypatch, threads_restored):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    from recipes import threads

    monkeypatch.setattr(threads, "affinity_cores", lambda: 2)
    monkeypatch.setattr(threads, "cgroup_quota", lambda: None)
    from omni.runtime.trainer import Trainer

    during = []
    fit = Trainer.fit
    monkeypatch.setattr(Trainer, "fit", lambda self: during.append(torch.get_num_threads()) or fit(self))
    torch.set_num_threads(5)
    assert main(["train", *tiny_overrides(demo_root, tmp_path / "r", **{"trainer.max_steps": 1,
                                                                         "data.num_workers": 1})]) == 0
    banner = next(l for l in capsys.readouterr().out.splitlines() if "run dir" in l)
    assert re.search(r"layout [^,]+, 1 CPU thread per rank \(2 cores, 1 rank, 1 data worker each; "
                     r"OMP_NUM_THREADS overrides\), data ", banner), banner
    assert during == [1]  # the run trained with the threads it announced
    assert torch.get_num_threads() == 5  # as the run found them: a run from Python leaves its process's threads
