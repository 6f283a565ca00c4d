"""The loader-memory benchmark's bookkeeping (scripts/bench/loader_memory.py): what it reads from
/proc, how a rank's forked workers are found, how sampled ranks are scaled and shared processes
counted once, and that results written before the --workers runs still print. The benchmark
itself (minutes, many processes) is not run here."""
from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
MIB = 2 ** 20


@pytest.fixture(scope="module")
def lm():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("loader_memory")
    finally:
        sys.path.remove(str(BENCH))


linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs /proc smaps_rollup")


@linux_only
def test_proc_memory_reads_smaps_rollup(lm):
    m = lm.proc_memory()
    assert set(lm.MEM_KEYS) <= set(m)
    assert 0 < m["uss"] <= m["rss"] and 0 < m["pss"] <= m["rss"]
    assert m["pss_anon"] + m["pss_file"] + m["pss_shmem"] <= m["pss"] + 4096 * 4  # kB rounding per field


def _wait(conn):
    conn.recv()


@linux_only
def test_measure_tree_finds_a_forked_worker(lm):
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_wait, args=(child,))
    proc.start()
    try:
        tree = lm.measure_tree(os.getpid())
        assert tree[0]["pid"] == os.getpid() and tree[0]["tree"] == "root"
        worker = [t for t in tree if t["pid"] == proc.pid]
        assert worker and worker[0]["tree"] == "child"
        # a forked child shares its parent's pages: its PSS exceeds what is private to it
        assert worker[0]["pss"] > worker[0]["uss"]
    finally:
        parent.send(None)
        proc.join(10)


def _proc(rank, group, tree="root", mib=100, **kw):
    return {"rank": rank, "group": group, "tree": tree, **{k: mib * MIB for k in
            ("rss", "uss", "pss", "anon", "pss_anon", "pss_file", "pss_shmem")}, **kw}


def test_totals_scale_the_measured_ranks_and_count_shared_once(lm):
    procs = [_proc(None, "shared", mib=200),  # e.g. the planner
             _proc(0, "rank"), _proc(0, "rank", "child", mib=50),
             _proc(4, "rank"), _proc(4, "rank", "child", mib=50)]
    tot = lm.totals(procs, ranks=8, measured=2)
    assert tot["pss"] == (200 + (150 + 150) * 8 / 2) * MIB
    assert tot["processes"] == 1 + 4 * 4 and tot["estimated"]
    assert lm.totals(procs, ranks=2, measured=2)["estimated"] is False
    trees = lm._trees(procs)
    assert {r: t["pss"] for r, t in trees.items()} == {0: 150 * MIB, 4: 150 * MIB}


def test_ray_constructors_are_per_rank_but_not_under_a_rank(lm):
    procs = [_proc(0, "rank"), _proc(1, "rank"),
             _proc(None, "rank", mib=80, name="ray::ConstructorActor"),
             _proc(None, "rank", mib=80, name="ray::ConstructorActor"),
             _proc(None, "shared", mib=40, name="raylet")]
    assert lm.totals(procs, ranks=4, measured=2)["pss"] == (40 + (100 + 100 + 80 + 80) * 2) * MIB
    assert all(t["pss"] == 180 * MIB for t in lm._trees(procs).values())


def test_results_from_before_the_worker_runs_still_print(lm, tmp_path):
    old = {"config": {"ranks": 4, "sources": 3, "shards_per_source": 4, "samples_per_shard": 50, "image_side": 32,
                      "steps": 5, "samples_per_rank_per_step": 8, "measured_ranks": [0, 2]},
           "idle": {"rss": 200 * MIB, "uss": 150 * MIB, "pss": 160 * MIB, "anon": 150 * MIB},
           "designs": {d: {"processes": [{"process": "rank", "rank": r, "role": d, "rss": 300 * MIB, "uss": u * MIB,
                                          "pss": u * MIB, "anon": u * MIB, "wall_s": 1.0, "import_s": 0.5,
                                          "sources_touched": 3, "open_shards": 2} for r in (0, 2)]}
                       for d, u in (("replicated", 300), ("inline", 200))}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    res = lm._upgrade(json.loads(path.read_text()))
    lm._retotal(res)
    text = lm.report(res)
    assert "| 0 | inline |" in text and "**1.50x**" in text  # replicated / inline PSS: 300 / 200
    lm.plot(res, tmp_path / "old.png")
    assert (tmp_path / "old.png").stat().st_size > 0
