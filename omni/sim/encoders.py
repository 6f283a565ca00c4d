"""The encoder side of a simulated step: each encoder call (a cut group of
multiplex.chunks_per_cut chunks, encoded together as the runtime does) assigned by the
runtime's own planner (``omni.step.encoder_plan.assign_items``: long-short split and cost
balancing, with the loads of the step's earlier calls carried over as in the runtime), then
timed per GPU. The routes themselves are not built: the exchanges are timed from the bytes
each GPU sends.

A call is a collective over its encoder GPUs (feature exchange, encode, output exchange), so
it ends for all of them when the slowest is done: its duration is the largest GPU's work plus
the exchanges. Every encoder GPU calls each modality of a call, with no items if it has none
(``Multiplexer._forward``: sharded weights are gathered by all of them), so a GPU without
items still pays each call's fixed cost; a call with no item anywhere is skipped by the
runtime and costs nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from omni.step.bubbles import BubbleCall, select_bubble_items
from omni.step.encoder_plan import ItemMeta, SplitRules, assign_items
from omni.step.config import MultiplexConfig
from omni.step.multiplex_rules import chunks_per_call
from omni.sim.work import MicroBatchWork
from omni.sim.memory import encoder_activation_bytes
from omni.sim.spec import ModelSpec
from omni.sim.machine import CommGroup, Machine
from omni.sim.timing import BF16, EncoderWork, encoder_work


@dataclass
class ChunkTimes:
    """One encoder chunk (micro-batch j of every DP group) on its encoder GPUs."""

    forward_s: float  # collective duration, forward (work of the slowest GPU + exchanges)
    backward_s: float
    gpu_forward_s: list[float] = field(default_factory=list)  # each member GPU's own work
    gpu_backward_s: list[float] = field(default_factory=list)
    gpu_activation_bytes: list[float] = field(default_factory=list)  # kept from forward to backward
    items: int = 0
    long_items: int = 0
    balance: float = 1.0  # max / mean planned cost over member GPUs
    modalities: list[str] = field(default_factory=list)  # with an item anywhere: every member GPU calls them
    chunks: list[int] = field(default_factory=list)  # the micro-batches (chunks) this call encodes
    # Of forward_s / backward_s beyond the slowest GPU's work: the exposed weight collectives
    # (sharded/hybrid gathers and reduce-scatters; the rest is the row exchange).
    weights_forward_s: float = 0.0
    weights_backward_s: float = 0.0
    # Per member GPU, the DP groups whose items it encodes (it trades features and rows with
    # their first-stage GPUs); and the span of the weight collectives in this call's passes
    # (member GPUs per group; 0: none), which couple those GPUs as a collective does.
    trades: list[list[int]] = field(default_factory=list)
    weights_span_forward: int = 0
    weights_span_backward: int = 0


def empty_call(m: Machine, spec: ModelSpec, modality: str) -> EncoderWork:
    """One GPU's call of ``modality``'s encoder with no items: every layer still runs once
    (``encode_chunk`` on empty inputs), so its kernels launch — the per-call launches that
    ``timing.encoder_work`` counts, 12 per layer, twice in the backward — but no matmul reads a
    weight (an empty input skips them); the backward writes the (zero) weight gradients, one
    compute-dtype pass over the trainable weights. A frozen encoder runs no backward."""
    e = spec.encoders[modality]
    launches = m.overhead(12 * e.num_layers)
    eff = m.cluster.encoder_efficiency
    backward = (2.0 * launches + m.memory(BF16 * e.params)) / eff if e.trainable else 0.0
    return EncoderWork(launches / eff, backward)


def chunk_items(mb: MicroBatchWork, group: int, spec: ModelSpec) -> list[ItemMeta]:
    """One DP group's micro-batch's media items as the runtime's planner names and counts them:
    an index per modality, in the micro-batch's order; ``tokens`` its output rows (LLM
    placeholders), ``units`` its encoder tokens (what the encoder runs)."""
    counters: dict[str, int] = {}
    out = []
    for modality, tokens, rows in mb.media:
        k = counters.get(modality, 0)
        counters[modality] = k + 1
        out.append(ItemMeta(group, modality, k, int(rows), int(tokens)))
    return out


def item_activation_bytes(spec: ModelSpec, modality: str, rows: int) -> float:
    """What autograd keeps for one item of ``rows`` output rows (LLM placeholders) on the GPU
    that encodes it: the runtime's ``item_bytes`` (``Encoder.activation_bytes`` of its encoder
    tokens), per the model's anchor."""
    e = spec.encoders[modality]
    return e.activation_bytes_per_token * rows * e.tokens_per_row


def plan_chunks(m: Machine, spec: ModelSpec, mux: MultiplexConfig, micro_batches: list[list[MicroBatchWork]],
                group_of: list[int], eligible: dict[int, list[int]] | None, gpus_per_node: int,
                receivers: int, memory_limit: float | None, placement: str = "colocated",
                member_ranks: list[int] | None = None, group_node: dict[int, int] | None = None,
                taken: frozenset | set = frozenset(), busy: Callable[[int], set[int]] | None = None) -> list[ChunkTimes]:
    """The step's encoder calls, one per cut group (``omni.step.multiplex_rules.chunks_per_call``:
    multiplex.chunks_per_cut chunks, or the whole step under encoder_first), each planned as
    one assignment as the runtime's ``plan_cut`` does (item indices continue over the group's
    chunks), balanced on top of the step's earlier calls. ``micro_batches[g][j]``: DP group
    g's micro-batch j; ``group_of[i]``: member GPU i's DP group; ``receivers``: GPUs that embed
    one group's rows (its first-stage TP x CP GPUs). A call without items is not run (the
    runtime skips a cut group with no media). ``member_ranks``: the member GPUs' global ranks
    (None: 0..n-1) and ``group_node``: the node of each DP group's first-stage GPUs (the
    features' senders and the rows' receivers; None: the node of its first member), for the
    exchanges: ``multiplex.exchange=all_to_all`` is a collective over every member,
    ``p2p`` sends over NVLink to a peer in the node and over the NIC share to one outside.
    ``taken``: items (chunk, modality, group, index) that bubble calls encode instead
    (``plan_bubble_calls``); ``busy(c)``: the member GPUs still in a bubble call when call c's
    forward runs, which take none of its items (as ``omni.step.bubbles.busy_ranks``)."""
    n = max((len(g) for g in micro_batches), default=0)
    world = len(group_of)
    sp = int(mux.encoder_sp)
    threshold = None if str(mux.long_threshold).lower() == "auto" else int(mux.long_threshold)
    sp_modalities = [mod for mod, e in spec.encoders.items() if e.supports_sp and e.heads % sp == 0]
    ranks = list(range(world)) if member_ranks is None else list(member_ranks)
    members_g = CommGroup.from_ranks(ranks, gpus_per_node) if world else None
    node = [r // gpus_per_node for r in ranks]
    if group_node is None:
        group_node = {}
        for i, g in enumerate(group_of):
            group_node.setdefault(g, node[i])
    p2p = str(getattr(mux, "exchange", "all_to_all")) == "p2p"
    size = chunks_per_call(placement, n, int(mux.chunks_per_cut))

    def item_bytes(modality: str, rows: int) -> float:
        return item_activation_bytes(spec, modality, rows)

    split = SplitRules(sp, threshold, tuple(sp_modalities), item_bytes, memory_limit)
    out = []
    carried = np.zeros(world)
    for c, first in enumerate(range(0, n, size)):
        chunks = list(range(first, min(first + size, n)))
        items, counters = [], {}
        for j in chunks:
            for g, mbs in enumerate(micro_batches):
                for it in chunk_items(mbs[j], g, spec) if j < len(mbs) else []:
                    if (j, it.modality, g, it.index) in taken:
                        continue
                    k = counters.get((g, it.modality), 0)
                    counters[(g, it.modality)] = k + 1
                    items.append(ItemMeta(g, it.modality, k, it.tokens, it.units))
        if not items:
            out.append(ChunkTimes(0.0, 0.0, [0.0] * world, [0.0] * world, [0.0] * world, chunks=chunks))
            continue
        allowed = eligible
        skip = busy(c) if busy is not None else set()
        if skip:
            allowed = {g: [i for i in (eligible or {}).get(g, range(world)) if i not in skip]
                       for g in set(group_of) | {it.group for it in items}}
        a = assign_items(items, group_of, world, spec.cost, split, eligible=allowed, base_loads=carried)
        carried = a.loads
        # (modality, encoder tokens, sp, group, LLM rows)
        per_gpu: list[list[tuple[str, int, int, int, int]]] = [[] for _ in range(world)]
        for it in items:
            if it.key in a.placed:
                per_gpu[a.placed[it.key]].append((it.modality, it.units, 1, it.group, it.tokens))
            else:
                for r in a.block(a.block_of[it.key]):
                    per_gpu[r].append((it.modality, it.units, sp, it.group, it.tokens))
        called = sorted({it.modality for it in items})
        fwd, bwd, act, sent, trades = [], [], [], [], []
        for r, work in enumerate(per_gpu):
            trades.append(sorted({g for _, _, _, g, _ in work}))
            w = encoder_work(m, spec, [(mod, t, s_) for mod, t, s_, _, _ in work], gpus_per_node)
            idle = [empty_call(m, spec, mod) for mod in called if mod not in {x[0] for x in work}]
            fwd.append(w.forward_s + sum(x.forward_s for x in idle))
            bwd.append(w.backward_s + sum(x.backward_s for x in idle))
            act.append(sum(encoder_activation_bytes(spec, mod, t, sp=s_) for mod, t, s_, _, _ in work))
            # Features come from the item's own group unless this GPU holds them already.
            feat = sum(t * spec.encoders[mod].feature_bytes_per_token for mod, t, _, g, _ in work if g != group_of[r])
            rows = sum(n / s_ for _, _, s_, _, n in work)
            sent.append((feat, rows * spec.media_row_width * BF16))
        if p2p:
            feat_s, out_s = _p2p_exchange(m, spec, per_gpu, node, group_node, receivers)
        else:
            # What one group's receiving GPU takes in: its share of the group's output rows.
            recv = max((sum(it.tokens for it in items if it.group == g) * spec.media_row_width * BF16 / receivers
                        for g in set(group_of)), default=0.0)
            feat_s = m.all_to_all_group(max((f for f, _ in sent), default=0.0), members_g)
            out_s = m.all_to_all_group(max(max((o for _, o in sent), default=0.0), recv), members_g)
        out.append(ChunkTimes(
            forward_s=max(fwd, default=0.0) + feat_s + out_s, backward_s=max(bwd, default=0.0) + out_s,
            gpu_forward_s=fwd, gpu_backward_s=bwd, gpu_activation_bytes=act, items=len(items),
            long_items=len(a.block_of), balance=a.balance, modalities=called, chunks=chunks, trades=trades))
    return out


def _p2p_exchange(m: Machine, spec: ModelSpec, per_gpu: list[list[tuple[str, int, int, int, int]]], node: list[int],
                  group_node: dict[int, int], receivers: int) -> tuple[float, float]:
    """(feature, output) exchange times of one call with ``multiplex.exchange=p2p``: each GPU
    receives its items' features from their group's first-stage GPUs and sends their rows
    back, all its transfers posted at once (one batch), NVLink to a peer in its node and its
    NIC share to one outside; a group's receiving GPUs take in their share of the group's rows
    the same way. The slowest GPU sets the call's exchange time."""
    def time(local: float, remote: float) -> float:
        t = max(local / m.nvlink_bw(), remote / m.nic_share_bw())
        return t + (m.latency(remote > 0) if local + remote > 0 else 0.0)

    feat, rows = [], []
    recv: dict[int, list[float]] = {}  # group -> [local, remote] row bytes its receivers take in
    for r, work in enumerate(per_gpu):
        f_loc = f_rem = o_loc = o_rem = 0.0
        for mod, t, s_, g, n in work:
            local = group_node[g] == node[r]
            fb = t / s_ * spec.encoders[mod].feature_bytes_per_token
            ob = n / s_ * spec.media_row_width * BF16
            if local:
                f_loc, o_loc = f_loc + fb, o_loc + ob
            else:
                f_rem, o_rem = f_rem + fb, o_rem + ob
            into = recv.setdefault(g, [0.0, 0.0])
            into[0 if local else 1] += ob / receivers
        feat.append(time(f_loc, f_rem))
        rows.append(time(o_loc, o_rem))
    taken = [time(loc, rem) for loc, rem in recv.values()]
    return max(feat, default=0.0), max(max(rows, default=0.0), max(taken, default=0.0))


def call_of_chunks(calls: list[ChunkTimes]) -> list[int]:
    """Chunk index -> the call (cut group) that encodes it."""
    return [c for c, call in enumerate(calls) for _ in call.chunks]


def call_actions(actions: list[tuple[str, int]], calls: list[ChunkTimes]) -> list[tuple[str, int]]:
    """The runtime's chunk actions as call actions: a cut group's forwards are one call, its
    backwards one (``omni.step.multiplex_rules.encoder_segments`` keeps each set together)."""
    of = call_of_chunks(calls)
    out: list[tuple[str, int]] = []
    for kind, j in actions:
        if (kind, of[j]) not in out:
            out.append((kind, of[j]))
    return out


@dataclass
class BubbleTimes:
    """One bubble call (``omni.step.bubbles``) on the GPUs of its pipeline rank: per cell
    (DP group, pipeline rank) its forward and backward, on its slowest GPU (the cell's GPUs go
    on to the LLM's work together) and on average, the activations its largest GPU keeps from
    the forward to the backward; per DP group the transfer of its rows to the group's first
    stage (at the window's delivery cut) and of their gradients back (at its tail cut)."""

    call: BubbleCall
    forward_s: dict[tuple[int, int], float] = field(default_factory=dict)
    backward_s: dict[tuple[int, int], float] = field(default_factory=dict)
    mean_forward_s: dict[tuple[int, int], float] = field(default_factory=dict)
    mean_backward_s: dict[tuple[int, int], float] = field(default_factory=dict)
    activation: dict[tuple[int, int], float] = field(default_factory=dict)
    transfer_s: dict[int, float] = field(default_factory=dict)
    modalities: list[str] = field(default_factory=list)
    weights_backward_s: float = 0.0  # exposed weight collectives of each backward (hybrid)

    @property
    def stage(self) -> int:
        return self.call.stage

    @property
    def deliver_cut(self) -> int:
        return self.call.window.deliver_cut

    @property
    def tail(self) -> int:
        return self.call.window.tail


def plan_bubble_calls(m: Machine, spec: ModelSpec, mux: MultiplexConfig, micro_batches: list[list[MicroBatchWork]],
                      windows: list, member_ranks: list[int], member_stage: list[int], group_of: list[int],
                      unit_cost: dict[int, float], gpus_per_node: int, receivers: int, memory_limit: float | None,
                      group_node: dict[int, int], modalities: dict[str, int] | None) -> list[BubbleTimes]:
    """The step's bubble calls, chosen by the runtime's own rule (``select_bubble_items``) and
    timed per GPU as the cut groups' calls are (``encoder_work``; a GPU of the pipeline rank
    without items still calls each of the call's modalities, as the runtime does)."""
    n = max((len(g) for g in micro_batches), default=0)
    items = [[it for g, mbs in enumerate(micro_batches) if j < len(mbs) for it in chunk_items(mbs[j], g, spec)]
             for j in range(n)]

    def item_bytes(modality: str, rows: int) -> float:
        return item_activation_bytes(spec, modality, rows)

    calls = select_bubble_items(items, windows, member_stage, group_of, unit_cost, spec.cost, modalities,
                                item_bytes, memory_limit)
    node = [r // gpus_per_node for r in member_ranks]
    out = []
    for call in calls:
        times = BubbleTimes(call, modalities=sorted({m_ for (_, m_, _, _) in call.placed}))
        per_gpu: dict[int, list[tuple[str, int, int, int]]] = {i: [] for i, s in enumerate(member_stage)
                                                               if s == call.stage}
        rows_of = {(j, it.modality, it.group, it.index): it.tokens for j, its in enumerate(items) for it in its}
        tokens_of = {(j, it.modality, it.group, it.index): it.units for j, its in enumerate(items) for it in its}
        for key, i in call.placed.items():
            per_gpu[i].append((key[1], tokens_of[key], key[2], rows_of[key]))
        cells: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
        sent: dict[int, list[float]] = {}
        crosses: dict[int, bool] = {}
        for i, work in per_gpu.items():
            w = encoder_work(m, spec, [(mod, t, 1) for mod, t, _, _ in work], gpus_per_node)
            idle = [empty_call(m, spec, mod) for mod in times.modalities if mod not in {x[0] for x in work}]
            fwd = w.forward_s + sum(x.forward_s for x in idle)
            bwd = w.backward_s + sum(x.backward_s for x in idle)
            act = sum(encoder_activation_bytes(spec, mod, t) for mod, t, _, _ in work)
            cells.setdefault((group_of[i], call.stage), []).append((fwd, bwd, act))
            rows = sum(n for _, _, _, n in work) * spec.media_row_width * BF16
            if rows:
                far = node[i] != group_node[group_of[i]]
                sent.setdefault(group_of[i], []).append(m.p2p(rows, far))
                crosses[group_of[i]] = crosses.get(group_of[i], False) or far
        for cell, vals in cells.items():
            times.forward_s[cell] = max(v[0] for v in vals)
            times.backward_s[cell] = max(v[1] for v in vals)
            times.mean_forward_s[cell] = float(np.mean([v[0] for v in vals]))
            times.mean_backward_s[cell] = float(np.mean([v[1] for v in vals]))
            times.activation[cell] = max(v[2] for v in vals)
        for g, sends in sent.items():
            rows = sum(rows_of[key] for key in call.placed if key[2] == g)
            # the group's first-stage GPUs each take in their share of the rows
            taken_in = m.p2p(rows * spec.media_row_width * BF16 / max(receivers, 1), crosses[g])
            times.transfer_s[g] = max(max(sends), taken_in)
        out.append(times)
    return out
