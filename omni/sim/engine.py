"""Event-driven simulation of one training step over the schedule the runtime executes.

Every (DP group, pipeline rank) pair is a *cell*: its TP x CP GPUs run in lockstep, so one
timeline stands for them. Each cell runs its pipeline rank's program from
``parallel.pipeline_executor`` (GPipe, 1F1B or interleaved 1F1B, with the consistent cuts
where encoder work joins in; without PP: a cut before each micro-batch's forward), and the
encoder chunks run at the cuts in the order ``omni.step.multiplex_rules.encoder_segments`` gives
— the same lists the training runtime follows. An action starts when its cell is free and its
input has arrived (the previous stage's activation or the next stage's gradient, plus the
point-to-point transfer); an encoder chunk is a collective: it starts when every encoder cell
has reached its cut and ends for all of them together.

Placements: ``colocated`` (encoders on every GPU), ``stage0`` (first-stage GPUs only; each DP
group's items stay on its own GPUs), ``encoder_first`` (every chunk's forward before the
pipeline, every backward after it) and ``none`` (no encoder work: the LLM side of the
disaggregated baseline, see ``omni.sim.simulate``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from omni.step.multiplex_rules import BEFORE_PIPELINE, encoder_segments
from omni.sim.encoders import BubbleTimes, ChunkTimes
from omni.sim.timing import StageWork
from omni.step import StepShape, plan_step
from parallel.pipeline_schedule import Action


@dataclass
class CellTimeline:
    group: int
    stage: int  # pipeline rank
    llm_s: float = 0.0  # LLM compute
    encoder_s: float = 0.0  # encoder compute (this cell's GPUs, mean)
    comm_s: float = 0.0  # exposed communication (TP/CP/EP inside the stage work, gradient sync, chunk exchanges)
    end_s: float = 0.0
    live_llm_peak: float = 0.0  # bytes of LLM activations alive at once (the worst moment)
    live_encoder_peak: float = 0.0
    peak_activations: float = 0.0  # both together, at the worst moment
    events: list[tuple[str, str, float, float]] = field(default_factory=list)  # (kind, name, start, end) if recorded
    # Where the cell's time went, term by term (DECOMPOSITION); with the idle remainder they add
    # up to the step.
    parts: dict[str, float] = field(default_factory=dict)

    def idle_s(self, step_s: float) -> float:
        return max(0.0, step_s - self.llm_s - self.encoder_s - self.comm_s)

    def add(self, term: str, seconds: float) -> None:
        self.parts[term] = self.parts.get(term, 0.0) + seconds

    def decomposition(self, step_s: float) -> dict[str, float]:
        """Every DECOMPOSITION term of this cell; "bubble" is what none of them explains (the
        pipeline's fill and drain, waiting for a stage's input, finishing before the slowest cell)."""
        out = {term: self.parts.get(term, 0.0) for term in DECOMPOSITION if term != "bubble"}
        out["bubble"] = max(0.0, step_s - sum(out.values()))
        return out


# The terms of a simulated step (per cell; docs/simulate.md, "Step decomposition").
DECOMPOSITION = ("llm_compute", "llm_comm", "encoder_compute", "encoder_imbalance", "encoder_weights",
                 "row_exchange", "cut_wait", "grad_sync", "optimizer", "bubble")


@dataclass
class StepTimeline:
    step_s: float
    cells: list[CellTimeline] = field(default_factory=list)
    # Per micro-batch, when the first stage's backward of it ends in every DP group: its
    # embedding-row gradients exist from then (what an encoder pool outside the pipeline waits for).
    first_stage_backward_end: list[float] = field(default_factory=list)


def programs(schedule: str, pp: int, virtual: int, n: int,
             tail_cuts: bool = False) -> tuple[list[list[Action]], list[Optional[int]]]:
    """Every pipeline rank's program with cuts (and tail cuts where bubble calls can end), and
    the cut of each chunk's encoder backward: the step program the runtime runs
    (``omni.step.plan_step``; pp = 1 included)."""
    program = plan_step(StepShape(pp=pp, virtual=virtual, schedule=schedule, tail_cuts=tail_cuts), [], n)
    return [list(p) for p in program.programs], list(program.backward_cuts)


def simulate_step(*, pp: int, virtual: int, schedule: str, groups: int, n_micro: int,
                  work: dict[tuple[int, int, int], StageWork], p2p_s: float | dict[tuple[int, int], float],
                  placement: str,
                  chunks: list[ChunkTimes], encoder_cells: dict[tuple[int, int], list[int]],
                  llm_activation: dict[tuple[int, int, int], float], tail_s: dict[tuple[int, int], float],
                  tail_comm_s: dict[tuple[int, int], float], record: bool = False,
                  chunks_per_cut: int = 1, lookahead: int = 0, call_of: Optional[list[int]] = None,
                  exchange: str = "all_to_all", bubbles: Sequence[BubbleTimes] = (),
                  first_stage_ready: Optional[Sequence[float]] = None) -> StepTimeline:
    """``work[(g, stage, i)]``: group g's micro-batch i through global stage ``stage``;
    ``encoder_cells[(g, s)]``: indices into each chunk's member GPUs that the cell holds (empty
    or missing: the cell runs no encoder work); ``p2p_s``: one stage-to-stage transfer (per
    (group, micro-batch) when a dict: each row has its own length); ``llm_activation[(g, stage, i)]``: bytes that
    forward keeps until backward; ``tail_s``/``tail_comm_s``: what each cell runs after its
    program (optimizer; exposed gradient sync). ``record``: keep every cell's events.
    ``chunks_per_cut``, ``lookahead``: multiplex.chunks_per_cut, multiplex.lookahead.
    ``chunks``: the step's encoder calls, ``call_of[j]`` the one that encodes chunk j (None:
    one call per chunk); a call's forward runs at its first chunk's F action, its backward at
    its first B action (the runtime's Multiplexer runs a cut group as one call).
    ``bubbles``: the step's bubble calls (``omni.step.bubbles``), which run as the
    runtime's Multiplexer runs them: each cell of their pipeline rank encodes right after
    its cut 0, its rows go to its group's first-stage cell at the window's delivery cut and
    their gradients come back at its tail cut, each a point-to-point exchange between the
    two cells (either waits for the other), and the cell runs the backward there.
    ``first_stage_ready[i]``: the earliest the first stage's forward of micro-batch i may start
    (its encoder rows come from outside the pipeline: the disaggregated pool); None: no wait."""
    progs, bwd_cuts = programs(schedule, pp, virtual, n_micro, tail_cuts=bool(bubbles))
    has_media = placement != "none" and any(c.items for c in chunks)
    call_of = list(range(n_micro)) if call_of is None else call_of
    p2p_exchange = exchange == "p2p"
    ran_by: set = set()  # (cell, kind, call) already booked
    released_by: dict = {}  # (cut, cell) -> end, p2p

    def has_work(k: int) -> bool:
        """Cut k runs a call with items (a cut group without media is skipped, no collective)."""
        return any(chunks[call_of[j]].items for _, j in at_cut.get(k, []))
    # The actions each insertion point runs (BEFORE_PIPELINE: encoder_first's forwards; n_micro:
    # after the pipeline), exactly as the runtime's Multiplexer runs them.
    at_cut = encoder_segments(placement if placement != "none" else "colocated", n_micro, bwd_cuts,
                              chunks_per_cut, lookahead) if has_media else {}
    members = [c for c, idx in encoder_cells.items() if idx] if has_media else []
    last_stage = pp * virtual - 1
    cells = {(g, s): CellTimeline(g, s) for g in range(groups) for s in range(pp)}
    free = {c: 0.0 for c in cells}
    cursor = {c: 0 for c in cells}
    done: dict[tuple[str, int, int, int], float] = {}  # (kind, g, stage, i) -> end
    arrived: dict[int, dict[tuple[int, int], float]] = {}
    released: dict[int, float] = {}
    live_llm = {c: 0.0 for c in cells}
    live_enc = {c: 0.0 for c in cells}

    def segment_calls(k: int) -> list[tuple[str, int]]:
        """Cut k's calls (kind, call), each once, in order."""
        out: list[tuple[str, int]] = []
        for kind, j in at_cut.get(k, []):
            if (kind, call_of[j]) not in out:
                out.append((kind, call_of[j]))
        return out

    def run_segment(k: int, start: float, booked: list, scope: Optional[list[int]] = None) -> float:
        """Duration of the encoder calls of cut k for the cells ``booked``, whose GPUs wait for
        the member GPUs ``scope`` (None: every member, a collective); books the cells' busy
        time and memory."""
        total = 0.0
        for kind, call in segment_calls(k):
            if any((c, kind, call) in ran_by for c in booked):
                continue
            ch = chunks[call]
            gpu = ch.gpu_forward_s if kind == "F" else ch.gpu_backward_s
            extra = (ch.forward_s if kind == "F" else ch.backward_s) - max(gpu, default=0.0)  # exchanges, weights
            slowest = max((gpu[i] for i in scope), default=0.0) if scope is not None else max(gpu, default=0.0)
            dur = slowest + extra
            weights = ch.weights_forward_s if kind == "F" else ch.weights_backward_s
            for c in booked:
                ran_by.add((c, kind, call))
                idx = encoder_cells[c]
                own = sum(gpu[i] for i in idx) / len(idx)
                cells[c].encoder_s += own
                cells[c].comm_s += extra
                cells[c].add("encoder_compute", own)
                cells[c].add("encoder_imbalance", slowest - own)
                cells[c].add("encoder_weights", weights)
                cells[c].add("row_exchange", extra - weights)
                act = max(ch.gpu_activation_bytes[i] for i in idx)
                live_enc[c] += act if kind == "F" else -act
                _peak(cells[c], live_llm[c], live_enc[c])
                if record:
                    cells[c].events.append(("encoder", f"{kind}{ch.chunks[0]}", start + total, start + total + dur))
            total += dur
        return total

    def partners(k: int, c) -> set:
        """The cells cell c waits for at cut k under multiplex.exchange=p2p: those it trades
        features or rows with in the cut's calls, and those that share a weight collective
        (FSDP gathers and reductions are collectives over their shard group)."""
        need = {c}
        mine = set(encoder_cells[c])
        for kind, call in segment_calls(k):
            ch = chunks[call]
            if not ch.items:
                continue
            span = ch.weights_span_forward if kind == "F" else ch.weights_span_backward
            blocks = {i // span for i in mine} if span else set()
            for p in members:
                theirs = encoder_cells[p]
                if any(g == p[0] and p[1] == 0 for i in mine for g in ch.trades[i]):
                    need.add(p)  # c encodes items of p's group: features from p, rows to p
                elif c[1] == 0 and any(c[0] in ch.trades[i] for i in theirs):
                    need.add(p)  # p encodes items of c's group
                elif blocks and any(i // span in blocks for i in theirs):
                    need.add(p)
        return need

    def collective(k: int, c) -> Optional[float]:
        """Arrival of cell c at cut k: the end of the cut's encoder work once everyone it waits
        for is there (every member: all_to_all exchanges; its partners: p2p)."""
        if (k, c) in released_by:
            return released_by[(k, c)]
        if k in released:
            return released[k]
        arrived.setdefault(k, {})[c] = free[c]
        if p2p_exchange:
            need = partners(k, c)
            if not need <= set(arrived[k]):
                return None
            start = max(arrived[k][p] for p in need)
            cells[c].add("cut_wait", start - arrived[k][c])
            scope = sorted({i for p in need for i in encoder_cells[p]})
            released_by[(k, c)] = start + run_segment(k, start, [c], scope)
            return released_by[(k, c)]
        if len(arrived[k]) < len(members):
            return None
        start = max(arrived[k].values())
        for cell, t in arrived[k].items():
            cells[cell].add("cut_wait", start - t)
        released[k] = start + run_segment(k, start, members)
        return released[k]

    def marker_ops(kind: str, k: int, c) -> list[tuple]:
        """What cell c runs at cut k (kind "cut") or tail cut k ("tail"), in the runtime's order
        (``Multiplexer.cut`` / ``tail``)."""
        g, s = c
        ops: list[tuple] = []
        for b in bubbles:
            ends_here = b.deliver_cut == k if kind == "cut" else b.tail == k
            if ends_here and g in b.transfer_s and s in (0, b.stage):
                ops.append(("pair", "deliver" if kind == "cut" else "return", b))
            if kind == "tail" and b.tail == k and s == b.stage and c in b.backward_s:
                ops.append(("bubble", "B", b))
        if kind == "cut":
            ops.append(("regular", k))
            if k == 0:
                ops += [("bubble", "F", b) for b in bubbles if b.stage == s and c in b.forward_s]
        return ops

    paired: dict[tuple, dict] = {}

    def pair(what: str, b: BubbleTimes, c) -> Optional[float]:
        """A bubble call's exchange between cell c and its partner (its group's first-stage
        cell, or the producing cell): the end once both have arrived."""
        g = c[0]
        key = (what, id(b), g)
        arrived_at = paired.setdefault(key, {})
        arrived_at.setdefault(c, free[c])
        if len(arrived_at) < 2:
            return None
        start = max(arrived_at.values())
        cells[c].add("cut_wait", start - arrived_at[c])
        dur = b.transfer_s[g]
        cells[c].add("row_exchange", dur)
        cells[c].comm_s += dur
        return start + dur

    def bubble_work(kind: str, b: BubbleTimes, c) -> float:
        dur = b.forward_s[c] if kind == "F" else b.backward_s[c]
        mean = b.mean_forward_s[c] if kind == "F" else b.mean_backward_s[c]
        weights = b.weights_backward_s if kind == "B" else 0.0
        cells[c].encoder_s += mean
        cells[c].comm_s += weights
        cells[c].add("encoder_compute", mean)
        cells[c].add("encoder_imbalance", dur - mean - weights)
        cells[c].add("encoder_weights", weights)
        live_enc[c] += b.activation[c] if kind == "F" else -b.activation[c]
        _peak(cells[c], live_llm[c], live_enc[c])
        if record:
            cells[c].events.append(("encoder", f"{kind}bubble{b.stage}", free[c], free[c] + dur))
        return free[c] + dur

    op_at = {c: 0 for c in cells}

    def run_marker(kind: str, k: int, c) -> bool:
        """Run cell c's ops at a cut or tail cut from where it stopped; False: it waits."""
        ops = marker_ops(kind, k, c)
        while op_at[c] < len(ops):
            op = ops[op_at[c]]
            if op[0] == "pair":
                end = pair(op[1], op[2], c)
            elif op[0] == "bubble":
                end = bubble_work(op[1], op[2], c)
            elif has_work(k) and c in members and placement != "encoder_first":
                end = collective(k, c)
            else:
                end = free[c]
            if end is None:
                return False
            free[c] = end
            op_at[c] += 1
        op_at[c] = 0
        return True

    if BEFORE_PIPELINE in at_cut:  # encoder_first: every forward before the pipeline
        t = run_segment(BEFORE_PIPELINE, 0.0, members)
        for c in members:
            free[c] = t
    remaining = sum(len(progs[s]) for s in range(pp)) * groups
    while remaining:
        progressed = False
        for c, tl in cells.items():
            g, s = c
            prog = progs[s]
            while cursor[c] < len(prog):
                kind, chunk, i = prog[cursor[c]]
                if kind in ("cut", "tail"):
                    if not run_marker(kind, chunk, c):
                        break
                    cursor[c] += 1
                    remaining -= 1
                    progressed = True
                    continue
                stage = chunk * pp + s
                if kind == "f":
                    dep = ("f", g, stage - 1, i) if stage > 0 else None
                else:
                    dep = ("b", g, stage + 1, i) if stage < last_stage else ("f", g, stage, i)
                if dep is not None and dep not in done:
                    break
                send = p2p_s[(g, i)] if isinstance(p2p_s, dict) else p2p_s
                ready = done[dep] + (send if dep[2] != stage else 0.0) if dep is not None else 0.0
                if kind == "f" and stage == 0 and first_stage_ready is not None:
                    ready = max(ready, first_stage_ready[i])
                w = work[(g, stage, i)]
                begin = max(free[c], ready)
                dur = w.forward_s if kind == "f" else w.backward_s
                compute = w.forward_compute_s if kind == "f" else w.backward_compute_s
                compute = min(compute, dur)
                tl.llm_s += compute
                tl.comm_s += dur - compute
                tl.add("llm_compute", compute)
                tl.add("llm_comm", dur - compute)
                free[c] = done[(kind, g, stage, i)] = begin + dur
                if record:
                    tl.events.append(("llm", f"{'F' if kind == 'f' else 'B'}{i} s{stage}", begin, begin + dur))
                act = llm_activation[(g, stage, i)]
                live_llm[c] += act if kind == "f" else -act
                _peak(tl, live_llm[c], live_enc[c])
                cursor[c] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("simulated pipeline deadlocked (a bug in the simulator's schedule)")
    # After the pipeline: the remaining encoder backwards (every cell has arrived: the same
    # rule as at a cut), then each cell's tail.
    if has_work(n_micro):
        for c in members:
            arrived.setdefault(n_micro, {})[c] = free[c]
        free.update({c: collective(n_micro, c) for c in members})
    for c, tl in cells.items():
        tl.comm_s += tail_comm_s.get(c, 0.0)
        tl.llm_s += tail_s.get(c, 0.0)
        tl.add("grad_sync", tail_comm_s.get(c, 0.0))
        tl.add("optimizer", tail_s.get(c, 0.0))
        tl.end_s = free[c] + tail_comm_s.get(c, 0.0) + tail_s.get(c, 0.0)
    return StepTimeline(max(tl.end_s for tl in cells.values()), list(cells.values()),
                        [max(done[("b", g, 0, i)] for g in range(groups)) for i in range(n_micro)])


def _peak(tl: CellTimeline, llm: float, enc: float) -> None:
    tl.live_llm_peak = max(tl.live_llm_peak, llm)
    tl.live_encoder_peak = max(tl.live_encoder_peak, enc)
    tl.peak_activations = max(tl.peak_activations, llm + enc)
