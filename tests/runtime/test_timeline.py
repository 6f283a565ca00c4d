"""Timeline accounting, rank summaries, the Chrome trace and the run digest, on a fake clock so
every figure is exact."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from omni.runtime.timeline import (
    RunSummary, StepTimes, Timeline, chrome_trace, gather_step_times, peak_memory, reset_peak_memory,
    summarise_ranks, write_chrome_trace,
)

# dist_helpers lives beside the parallel tests; spawned ranks inherit sys.path, so this also
# lets them unpickle run_ranks' entry point.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel"))
from dist_helpers import run_ranks  # noqa: E402


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _nested_step(tl: Timeline, clock: FakeClock, step: int = 0, end: float = 12.0):
    """llm 0..10 containing encoder 2..6 containing comm 3..4; step ends at `end`."""
    clock.now = 0.0
    tl.begin_step(step)
    with tl.span("llm", "stage0.fwd", mb=0):
        clock.now = 2.0
        with tl.span("encoder", "vision"):
            clock.now = 3.0
            with tl.span("comm", "a2a"):
                clock.now = 4.0
            clock.now = 6.0
        clock.now = 10.0
    clock.now = end
    return tl.end_step()


def test_nested_spans_are_accounted_exclusively():
    clock = FakeClock()
    st = _nested_step(Timeline(rank=3, clock=clock), clock)
    assert (st.step, st.rank, st.step_time_s) == (0, 3, 12.0)
    assert st.busy_s == {"llm": 6.0, "encoder": 3.0, "comm": 1.0, "optim": 0.0}
    assert st.idle_s == 2.0
    assert [(e.kind, e.name, e.start_s, e.dur_s, e.args) for e in st.events] == [
        ("llm", "stage0.fwd", 0.0, 10.0, {"mb": 0}), ("encoder", "vision", 2.0, 4.0, {}), ("comm", "a2a", 3.0, 1.0, {})]


def test_step_start_is_the_time_origin_and_steps_do_not_leak():
    clock = FakeClock()
    tl = Timeline(rank=0, clock=clock)
    _nested_step(tl, clock, step=0)
    clock.now = 100.0
    tl.begin_step(1)
    with tl.span("comm"):
        clock.now = 101.5
    clock.now = 102.0
    st = tl.end_step()
    assert st.busy_s == {"encoder": 0.0, "llm": 0.0, "comm": 1.5, "optim": 0.0}
    assert st.idle_s == 0.5
    assert [(e.name, e.start_s) for e in st.events] == [("comm", 0.0)]


def test_add_intervals_follow_the_same_innermost_rule():
    clock = FakeClock()
    tl = Timeline(rank=0, clock=clock)
    tl.begin_step(0)
    with tl.span("llm", "bwd"):
        clock.now = 10.0
    # Measured elsewhere and recorded after the fact: an encoder backward 4..8 inside the llm span
    # with a comm 5..6 in it, an encoder interval reaching past the step end (clipped), and one
    # starting together with the llm span (same start: the shorter one is the inner one).
    tl.add("encoder", "vis.bwd", 4.0, 8.0)
    tl.add("comm", "a2a.bwd", 5.0, 6.0, bytes=64)
    tl.add("comm", "early", 0.0, 1.0)
    tl.add("encoder", "tail", 11.0, 20.0)
    clock.now = 12.0
    st = tl.end_step()
    assert st.busy_s == {"llm": 10.0 - 4.0 - 1.0, "encoder": 3.0 + 1.0, "comm": 1.0 + 1.0, "optim": 0.0}
    assert st.idle_s == 1.0
    assert sum(st.busy_s.values()) + st.idle_s == st.step_time_s
    tail = [e for e in st.events if e.name == "tail"]
    assert [(e.start_s, e.dur_s) for e in tail] == [(11.0, 1.0)]
    with pytest.raises(ValueError, match="end 1.0 is before start 2.0"):
        tl.begin_step(1)
        tl.add("comm", "x", 2.0, 1.0)


def test_overlapping_add_intervals_latest_start_wins():
    clock = FakeClock()
    tl = Timeline(rank=0, clock=clock)
    tl.begin_step(0)
    tl.add("encoder", "a", 0.0, 6.0)
    tl.add("comm", "b", 4.0, 9.0)  # overlaps a without nesting: from 4 on, b started last
    clock.now = 10.0
    st = tl.end_step()
    assert st.busy_s == {"encoder": 4.0, "llm": 0.0, "comm": 5.0, "optim": 0.0}
    assert st.idle_s == 1.0


def test_disabled_timeline_records_nothing():
    clock = FakeClock()
    tl = Timeline(rank=1, enabled=False, clock=clock)
    st = _nested_step(tl, clock, step=7)
    assert (st.step, st.rank, st.step_time_s, st.busy_s, st.idle_s, st.events) == (7, 1, 0.0, {}, 0.0, [])
    assert tl.span("llm") is tl.span("encoder")  # one shared no-op, no allocation per span


def test_misuse_is_named():
    clock = FakeClock()
    tl = Timeline(rank=0, clock=clock)
    with pytest.raises(RuntimeError, match="no step in progress"):
        tl.end_step()
    tl.begin_step(0)
    with pytest.raises(RuntimeError, match="step 0 was never ended"):
        tl.begin_step(1)
    span = tl.span("llm")
    span.__enter__()
    with pytest.raises(RuntimeError, match="1 span"):
        tl.end_step()


def test_sync_is_called_around_spans():
    calls = []
    clock = FakeClock()
    tl = Timeline(rank=0, clock=clock, sync=lambda: calls.append(clock.now))
    tl.begin_step(0)
    with tl.span("llm"):
        clock.now = 1.0
    tl.end_step()
    assert calls == [0.0, 0.0, 1.0, 1.0]


def _st(rank, step_time, idle, **busy):
    return StepTimes(step=5, rank=rank, step_time_s=step_time, busy_s=dict(busy), idle_s=idle)


def test_summarise_ranks_numbers():
    per_rank = [_st(0, 10.0, 4.0, encoder=2.0, llm=3.0, comm=1.0),
                _st(1, 8.0, 0.0, encoder=1.0, llm=6.0, comm=1.0),
                _st(2, 10.0, 6.0, llm=4.0, zero=0.0)]
    m = summarise_ranks(per_rank)
    assert m == pytest.approx({
        "busy_encoder_s": 1.0, "busy_llm_s": 13.0 / 3, "busy_comm_s": 2.0 / 3, "busy_optim_s": 0.0, "busy_zero_s": 0.0,
        "idle_s": 10.0 / 3, "bubble_fraction": (0.4 + 0.0 + 0.6) / 3,
        "imbalance": 8.0 / 6.0, "busy_max_rank": 1, "step_time_s": 10.0})
    assert json.loads(json.dumps(m)) == m


def test_summarise_ranks_all_idle_and_empty():
    m = summarise_ranks([_st(0, 0.0, 0.0), _st(1, 2.0, 2.0)])
    assert (m["imbalance"], m["bubble_fraction"], m["busy_llm_s"]) == (1.0, 0.5, 0.0)
    with pytest.raises(ValueError, match="no StepTimes"):
        summarise_ranks([])


def test_chrome_trace_has_every_interval_in_microseconds(tmp_path):
    clock = FakeClock()
    per_rank = [_nested_step(Timeline(rank=r, clock=clock), clock, step=4) for r in range(2)]
    path = write_chrome_trace(tmp_path / "traces" / "step4.json", per_rank)
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    ev = trace["traceEvents"]
    meta = {(e["pid"], e["name"], e["tid"]): e["args"] for e in ev if e["ph"] == "M"}
    lanes = {}
    for r in range(2):
        assert meta[(r, "process_name", 0)] == {"name": f"rank {r}"}
        lanes[r] = {args["name"]: tid for (pid, name, tid), args in meta.items() if pid == r and name == "thread_name"}
        assert set(lanes[r]) == {"encoder", "llm", "comm", "optim"}
    spans = sorted((e["pid"], e["tid"], e["name"], e["ts"], e["dur"], e["args"]["step"])
                   for e in ev if e["ph"] == "X")
    expected = sorted((r, lanes[r][kind], name, ts, dur, 4) for r in range(2) for kind, name, ts, dur in [
        ("llm", "stage0.fwd", 0.0, 10e6), ("encoder", "vision", 2e6, 4e6), ("comm", "a2a", 3e6, 1e6)])
    assert spans == expected
    assert chrome_trace(per_rank) == trace


def test_run_summary_lines_mention_the_figures():
    rs = RunSummary()
    assert rs.lines() == ["timeline: no step was timed (multiplex.timeline_every sets which are)"]
    rs.add({"step": 1, "loss": 2.0})  # a record without timeline fields is ignored
    rs.add({"step": 1, "step_time_s": 2.0, "bubble_fraction": 0.25, "imbalance": 1.5, "busy_encoder_s": 0.5,
            "busy_llm_s": 1.0, "busy_comm_s": 0.0, "idle_s": 0.5, "busy_max_rank": 1, "peak_mem_gib": 3.0})
    rs.add({"step": 2, "step_time_s": 4.0, "bubble_fraction": 0.75, "imbalance": 1.1, "busy_encoder_s": 0.5,
            "busy_llm_s": 1.0, "busy_comm_s": 1.0, "idle_s": 1.5, "busy_max_rank": 0, "peak_mem_gib": 5.5})
    text = "\n".join(rs.lines())
    for figure in ("2 steps", "mean 3.000s", "max 4.000s", "bubble fraction mean 50.0%", "imbalance mean 1.30",
                   "encoder 16.7%", "llm 33.3%", "comm 16.7%", "idle 33.3%", "peak_mem 5.50 GiB"):
        assert figure in text, (figure, text)


def test_peak_memory_on_cpu():
    reset_peak_memory("cpu")  # a no-op on CPU, but callable every step
    m = peak_memory(torch.device("cpu"))
    assert list(m) == ["peak_rss_gib"]
    assert 0.01 < m["peak_rss_gib"] < 1024  # this process holds torch: tens of MiB at least


def test_gather_without_distributed_returns_local():
    clock = FakeClock()
    st = _nested_step(Timeline(rank=0, clock=clock), clock)
    assert gather_step_times(st) == [st]
    slim = gather_step_times(st, keep_events=False)
    assert slim[0].events == [] and slim[0].busy_s == st.busy_s and st.events


def _gather_worker(rank: int, world_size: int) -> None:
    clock = FakeClock()
    tl = Timeline(rank=rank, clock=clock)
    tl.begin_step(3)
    with tl.span("encoder" if rank == 0 else "llm", f"r{rank}"):
        clock.now = 1.0 + rank
    clock.now = 4.0
    got = gather_step_times(tl.end_step())
    assert [(s.rank, s.step, s.busy_s, s.idle_s, [e.name for e in s.events]) for s in got] == [
        (0, 3, {"encoder": 1.0, "llm": 0.0, "comm": 0.0, "optim": 0.0}, 3.0, ["r0"]),
        (1, 3, {"encoder": 0.0, "llm": 2.0, "comm": 0.0, "optim": 0.0}, 2.0, ["r1"])]
    assert summarise_ranks(got)["busy_max_rank"] == 1


def test_gather_step_times_two_gloo_ranks():
    run_ranks(_gather_worker, 2)


class _FakeCudaEvent:
    """Stands in for torch.cuda.Event on the CPU: records the fake clock, counts waits."""

    clock: FakeClock
    waits = 0
    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        type(self).made += 1
        self.t = None

    def record(self) -> None:
        self.t = self.clock()

    def synchronize(self) -> None:
        type(self).waits += 1

    def elapsed_time(self, other: "_FakeCudaEvent") -> float:
        return (other.t - self.t) * 1e3  # milliseconds, as CUDA reports them


@pytest.fixture
def fake_cuda_events(monkeypatch):
    clock = FakeClock()
    event = type("Event", (_FakeCudaEvent,), {"clock": clock, "waits": 0, "made": 0})
    monkeypatch.setattr(torch.cuda, "Event", event)
    return clock, event


def test_cuda_timeline_times_events_and_waits_once_per_step(fake_cuda_events):
    clock, event = fake_cuda_events
    tl = Timeline(rank=0, device="cuda", clock=lambda: 0.0)  # the host clock is never used for spans
    st = _nested_step(tl, clock)
    assert event.waits == 1  # end_step waits for its last event, nothing else does
    assert st.step_time_s == 12.0
    assert st.busy_s == {"encoder": 3.0, "llm": 6.0, "comm": 1.0, "optim": 0.0}
    assert [(e.kind, e.start_s, e.dur_s) for e in st.events] == [("llm", 0.0, 10.0), ("encoder", 2.0, 4.0),
                                                                 ("comm", 3.0, 1.0)]


def test_disabled_cuda_timeline_touches_nothing(fake_cuda_events):
    clock, event = fake_cuda_events
    tl = Timeline(rank=0, enabled=False, device="cuda")
    _nested_step(tl, clock)
    assert event.made == 0 and event.waits == 0
