"""Per-rank step timeline: where each rank's step time goes (encoder / llm / comm / idle).

Encoder-LLM multiplexing only pays off if encoder work fills the LLM pipeline bubbles instead of
adding to them, so the figures that matter are per rank and per step: exclusive busy time per kind,
the idle rest (bubbles, waiting on peers), and how unevenly the busy time is spread over ranks.
`Timeline` records intervals on one rank, `gather_step_times` brings every rank's `StepTimes`
together, `summarise_ranks` turns them into flat metrics.jsonl fields, `chrome_trace` draws one
step of every rank for chrome://tracing / Perfetto, and `RunSummary` prints the end-of-run digest.

Timings: on CUDA (``device``), spans are CUDA events on the current stream, so they measure the
device's execution, not kernel launches; the step waits for its last event once, at
``end_step``, and reads every elapsed time then. Elsewhere they are host-clock intervals (an
optional ``sync`` callable runs before every clock read). A disabled timeline records, waits
for and reads nothing. `gather_step_times` is an object collective: give it a gloo group
(``parallel.layout.host_group``), never NCCL's.
"""
from __future__ import annotations

import contextlib
import heapq
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

# The kinds the summary always reports (other kinds are accepted and reported when they occur).
KINDS = ("encoder", "llm", "comm", "optim")


class Event(NamedTuple):
    """One recorded interval; times in seconds relative to the start of its step."""

    kind: str
    name: str
    start_s: float
    dur_s: float
    args: dict[str, Any]


@dataclass
class StepTimes:
    """One rank's step. ``busy_s`` is exclusive per kind (no overlap), so
    ``sum(busy_s.values()) + idle_s == step_time_s``."""

    step: int
    rank: int
    step_time_s: float = 0.0
    busy_s: dict[str, float] = field(default_factory=dict)
    idle_s: float = 0.0
    events: list[Event] = field(default_factory=list)

    @property
    def total_busy_s(self) -> float:
        return sum(self.busy_s.values())


class _Interval(NamedTuple):
    start: float
    end: float
    seq: int  # recording order: the last tie-break of "innermost"
    kind: str
    name: str
    args: dict[str, Any]


class _Span:
    """Context manager for one `Timeline.span`; a class rather than @contextmanager because it
    runs around every encoder chunk and pipeline stage, and a generator costs more."""

    __slots__ = ("_tl", "_kind", "_name", "_args", "_start")

    def __init__(self, tl: Timeline, kind: str, name: str, args: dict[str, Any]):
        self._tl, self._kind, self._name, self._args = tl, kind, name, args

    def __enter__(self) -> _Span:
        self._start = self._tl._now()
        self._tl._open += 1
        return self

    def __exit__(self, *exc) -> None:
        end = self._tl._now()
        self._tl._open -= 1
        self._tl._record(self._kind, self._name, self._start, end, self._args)


class Timeline:
    """Records the intervals of one rank's steps and accounts them exclusively.

    Exclusive accounting rule: every instant of the step belongs to at most one interval, the
    *innermost* one covering it, i.e. the one with the latest start; on equal starts the one that
    ends first (it is the nested one), then the one recorded last. Instants that no interval
    covers are idle. Spans and `add` intervals follow the same rule, because it is applied once
    at `end_step` by a sweep over all of the step's intervals, whatever order they came in.

    Spans and intervals recorded outside ``begin_step``/``end_step`` (evaluation, checkpointing)
    are not part of any step and are not recorded. ``sync``, when given, is called before every
    clock read so that asynchronous device work is attributed to the span that launched it.
    ``device``: a CUDA device times spans with CUDA events instead (no ``sync``, no clock); `add`
    intervals stay on the host clock, placed from the host time of the step start.
    """

    def __init__(self, rank: int, enabled: bool = True, clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] | None = None, device: torch.device | str | None = None,
                 every: int = 1):
        self.rank = rank
        self.enabled = enabled
        if every < 1:
            raise ValueError(f"multiplex.timeline_every={every} must be >= 1")
        self.every = every  # the steps it times (``times``)
        self._clock = clock
        self._sync_fn = sync
        self._cuda = device is not None and torch.device(device).type == "cuda" and sync is None
        self._t0_event = None
        self._noop = contextlib.nullcontext()  # reused: a disabled span() allocates nothing
        self._step: int | None = None
        self._t0 = 0.0
        self._open = 0
        self._intervals: list[_Interval] = []

    def _sync(self) -> None:
        if self._sync_fn is not None:
            self._sync_fn()

    def _now(self):
        """A time mark: a recorded CUDA event (read at ``end_step``), or the synced host clock."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        self._sync()
        return self._clock()

    def _seconds(self, mark) -> float:
        """A mark as seconds since the step start (events: their elapsed time, read now)."""
        if isinstance(mark, float | int):
            return mark - self._t0
        return self._t0_event.elapsed_time(mark) / 1e3

    def times(self, step: int) -> bool:
        """Whether step ``step`` is timed: an enabled timeline's every ``every``-th step. The
        others record, wait for and gather nothing."""
        return self.enabled and step % self.every == 0

    def begin_step(self, step: int) -> None:
        if self._step is not None:
            raise RuntimeError(f"Timeline.begin_step({step}): step {self._step} was never ended; call end_step first")
        self._step = step
        self._intervals = []
        self._open = 0
        if self.enabled:
            if self._cuda:
                self._t0_event = self._now()
                self._t0 = self._clock()  # the host origin of `add` intervals
            else:
                self._sync()
                self._t0 = self._clock()

    def span(self, kind: str, name: str = "", **args: Any):
        """``with timeline.span("encoder", "vision", items=12): ...`` records that interval."""
        if not self.enabled or self._step is None:
            return self._noop
        return _Span(self, kind, name, args)

    def add(self, kind: str, name: str, start: float, end: float, **args: Any) -> None:
        """Records an interval measured elsewhere on the same clock (e.g. by autograd hooks)."""
        if not self.enabled or self._step is None:
            return
        if float(end) < float(start):
            raise ValueError(f"Timeline.add({kind!r}, {name!r}): end {end} is before start {start}")
        self._record(kind, name, start, end, args)

    def _record(self, kind: str, name: str, start: float, end: float, args: dict[str, Any]) -> None:
        self._intervals.append(_Interval(start, end, len(self._intervals), kind, name or kind, args))

    def end_step(self) -> StepTimes:
        if self._step is None:
            raise RuntimeError("Timeline.end_step: no step in progress; call begin_step first")
        step, self._step = self._step, None
        if not self.enabled:
            return StepTimes(step=step, rank=self.rank)
        if self._open:
            raise RuntimeError(f"Timeline.end_step({step}): {self._open} span(s) still open; end_step "
                               "must come after every span of the step has exited")
        end = self._now()
        if self._cuda:
            end.synchronize()  # the step's one wait: every event before it has completed
        step_time = self._seconds(end)
        # Intervals measured elsewhere may reach outside the step: only the part inside counts.
        clipped = [iv._replace(start=max(self._seconds(iv.start), 0.0), end=min(self._seconds(iv.end), step_time))
                   for iv in self._intervals]
        clipped = [iv for iv in clipped if iv.end >= iv.start]
        busy = _exclusive_busy(clipped)
        events = [Event(iv.kind, iv.name, iv.start, iv.end - iv.start, iv.args)
                  for iv in sorted(clipped, key=lambda iv: (iv.start, iv.seq))]
        self._intervals = []
        total = sum(busy.values())
        return StepTimes(step=step, rank=self.rank, step_time_s=step_time, busy_s=busy,
                         idle_s=max(0.0, step_time - total), events=events)


def _exclusive_busy(intervals: list[_Interval]) -> dict[str, float]:
    """Sweep over the interval boundaries; each elementary segment goes to the innermost
    interval covering it (see `Timeline`). A max-heap with lazy removal keeps this O(n log n)."""
    busy: dict[str, float] = {kind: 0.0 for kind in KINDS}
    starts = sorted(intervals, key=lambda iv: iv.start)
    points = sorted({p for iv in intervals for p in (iv.start, iv.end)})
    heap: list[tuple[float, float, int, _Interval]] = []
    i = 0
    for a, b in zip(points, points[1:]):
        while i < len(starts) and starts[i].start <= a:
            iv = starts[i]
            heapq.heappush(heap, (-iv.start, iv.end, -iv.seq, iv))  # latest start, earliest end, last recorded
            i += 1
        while heap and heap[0][3].end <= a:
            heapq.heappop(heap)
        if heap:
            kind = heap[0][3].kind
            busy[kind] = busy.get(kind, 0.0) + (b - a)
    return busy


def summarise_ranks(per_rank: list[StepTimes]) -> dict[str, float]:
    """Flat metrics.jsonl fields for one step over all ranks: mean busy seconds per kind and mean
    idle, mean bubble fraction (idle / step time), imbalance (max busy / mean busy, 1.0 when
    nothing was busy), the busiest rank, and the step time (the slowest rank's)."""
    if not per_rank:
        raise ValueError("summarise_ranks: no StepTimes given")
    n = len(per_rank)
    kinds = list(KINDS) + sorted({k for st in per_rank for k in st.busy_s} - set(KINDS))
    out: dict[str, float] = {f"busy_{k}_s": sum(st.busy_s.get(k, 0.0) for st in per_rank) / n for k in kinds}
    out["idle_s"] = sum(st.idle_s for st in per_rank) / n
    out["bubble_fraction"] = sum(st.idle_s / st.step_time_s if st.step_time_s > 0 else 0.0 for st in per_rank) / n
    totals = [st.total_busy_s for st in per_rank]
    mean = sum(totals) / n
    out["imbalance"] = max(totals) / mean if mean > 0 else 1.0
    out["busy_max_rank"] = per_rank[max(range(n), key=totals.__getitem__)].rank
    out["step_time_s"] = max(st.step_time_s for st in per_rank)
    return out


def gather_step_times(local: StepTimes, group=None, keep_events: bool = True) -> list[StepTimes]:
    """Every rank's StepTimes, in group rank order, returned on *every* rank (all_gather_object:
    all ranks can then log or act on imbalance). ``[local]`` when torch.distributed is not
    initialised. ``keep_events=False`` sends only the sums: events are needed for a trace, not
    for metrics, and they dominate the payload. Collective: every rank of ``group`` must call it."""
    if not keep_events:
        local = StepTimes(local.step, local.rank, local.step_time_s, dict(local.busy_s), local.idle_s, [])
    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local, group=group)
    return out


def _lanes(per_rank: list[StepTimes]) -> dict[str, int]:
    # Fixed lane order for the known kinds so every trace reads the same way; extras follow.
    extra = sorted({e.kind for st in per_rank for e in st.events} - set(KINDS))
    return {kind: i for i, kind in enumerate(list(KINDS) + extra)}


def chrome_trace(per_rank: list[StepTimes]) -> dict[str, Any]:
    """Trace Event Format of one step: a process per rank, a thread lane per kind, one complete
    ("X") event per interval, times in microseconds from that rank's step start (rank clocks are
    not synchronised, so every rank starts at 0)."""
    lanes = _lanes(per_rank)
    events: list[dict[str, Any]] = []
    for st in per_rank:
        events.append(_meta("process_name", st.rank, 0, name=f"rank {st.rank}"))
        events.append(_meta("process_sort_index", st.rank, 0, sort_index=st.rank))
        for kind, tid in lanes.items():
            events.append(_meta("thread_name", st.rank, tid, name=kind))
            events.append(_meta("thread_sort_index", st.rank, tid, sort_index=tid))
        for e in st.events:
            events.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": st.rank, "tid": lanes[e.kind],
                           "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6, "args": {"step": st.step, **e.args}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _meta(event: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": event, "pid": pid, "tid": tid, "args": args}


def write_chrome_trace(path: str | Path, per_rank: list[StepTimes]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # default=str: span args are free-form (shapes, dtypes); a trace must not fail over one.
    path.write_text(json.dumps(chrome_trace(per_rank), default=str))
    return path


def reset_peak_memory(device: torch.device | str) -> None:
    """Call at each step start so that `peak_memory` is that step's peak (CUDA only)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device | str) -> dict[str, float]:
    """CUDA: the allocator's peak since the last `reset_peak_memory`, ``{"peak_mem_gib": ...}``.
    CPU: there is no per-step allocator peak, so this is the process's peak resident set size
    over its whole life, ``{"peak_rss_gib": ...}`` (it never goes down)."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return {"peak_rss_gib": rss * scale / 2**30}


class RunSummary:
    """Collects the per-step records (summarise_ranks + peak_memory fields, other keys ignored)
    and renders the end-of-run digest the trainer prints on rank 0."""

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        if "step_time_s" in record:
            self._records.append(record)

    def lines(self) -> list[str]:
        recs = self._records
        if not recs:
            return ["timeline: no step was timed (multiplex.timeline_every sets which are)"]
        n = len(recs)

        def mean(key: str) -> float:
            return sum(r.get(key) or 0.0 for r in recs) / n

        times = [r["step_time_s"] for r in recs]
        out = [
            f"timeline over {n} steps: step time mean {sum(times) / n:.3f}s, max {max(times):.3f}s",
            f"  bubble fraction mean {100 * mean('bubble_fraction'):.1f}%, imbalance mean {mean('imbalance'):.2f}",
        ]
        # Shares of the mean rank's time (busy kinds + idle add up to 100%).
        parts = sorted({k for r in recs for k in r if k.startswith("busy_") and k.endswith("_s")})
        totals = {k[len("busy_"):-2]: sum(r.get(k) or 0.0 for r in recs) for k in parts}
        totals["idle"] = sum(r.get("idle_s") or 0.0 for r in recs)
        whole = sum(totals.values())
        if whole > 0:
            out.append("  time split: " + ", ".join(f"{k} {100 * v / whole:.1f}%" for k, v in totals.items()))
        for key in sorted({k for r in recs for k in r if k.startswith("peak_") and k.endswith("_gib")}):
            out.append(f"  {key[:-4]} {max(r.get(key) or 0.0 for r in recs):.2f} GiB")
        return out
