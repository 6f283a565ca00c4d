"""The pipeline executor's point-to-point traffic, checked under nccl's rules and not only
gloo's, on the very batches ``PipelineExecutor.run`` issues (``p2p_programs``, which its
``p2p_programs`` method calls; the gloo run at the end checks that ``run`` posts them op for op):

(a) pairing: on each process group and each ordered pair of ranks, the k-th send of A to B
    is the k-th receive of B from A: the same message (sending stage, receiving stage,
    micro-batch), shape and dtype; and the messages are exactly the pipeline's;
(b) rendezvous: replaying every rank's program where a send completes only when its peer's
    matching receive is posted, a batch completes when all its operations are matched, the
    operations of one group run in the order they were issued (nccl's stream order) and every
    cut (and tail cut) is a barrier over all ranks (the strictest collective a cut may run), every rank
    reaches its end.

The replay is not blind: it deadlocks on the former executor's traffic (a blocking receive
before each action, an unbatched send after it) for interleaved stages, at pp = 2 and beyond
(``test_replay_catches_unbatched_sends``). It also checks the order that torch's zero-bubble
schedule (``parallel.pipeline``'s runner) really plans, which Omni does not batch.
"""
from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch

from dist_helpers import run_ranks
from parallel.pipeline_executor import DRAIN, Batch, P2P, p2p_programs
from parallel.pipeline_schedule import MARKERS, bubble_windows, place_cuts, rank_programs

SHAPE, DTYPE = (1, 5, 8), torch.bfloat16
CASES = ([(s, pp, 1, n) for s in ("gpipe", "1f1b") for pp in (2, 4) for n in (1, 2, pp, pp + 1, 2 * pp, 3 * pp)]
         + [("interleaved_1f1b", pp, v, n) for pp in (2, 4) for v in (2, 3) for n in (pp, 2 * pp, 3 * pp)]
         + [("1f1b", 3, 1, 5), ("interleaved_1f1b", 3, 2, 6)])
IDS = [f"{s}-pp{p}-v{v}-m{m}" for s, p, v, m in CASES]


def _programs(schedule, pp, virtual, n):
    """With the tail cuts of every bubble window too: they are barriers like the cuts."""
    tails = [w.tail for w in bubble_windows(schedule, pp, virtual, n) if w is not None]
    return p2p_programs(place_cuts(rank_programs(schedule, pp, virtual, n), pp, virtual, n, tails), pp, virtual,
                        [SHAPE] * n, DTYPE)


def _ops(items):
    for item in items:
        if isinstance(item, Batch):
            assert all(op.channel == item.channel for op in item.ops), item
            yield from item.ops


def _pairing_problems(programs, pp, virtual, n):
    """(a), and that the messages are exactly the pipeline's: one per cross-stage edge."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, items in enumerate(programs):
        for op in _ops(items):
            key = (op.channel, r, op.peer) if op.send else (op.channel, op.peer, r)
            (sends if op.send else recvs)[key].append(op)
    problems = []
    for key in sorted(set(sends) | set(recvs)):
        s, q = sends.get(key, []), recvs.get(key, [])
        if len(s) != len(q):
            problems.append(f"{key}: {len(s)} sends, {len(q)} receives")
        for k, (a, b) in enumerate(zip(s, q)):
            if (a.stage, a.dest, a.micro, a.shape, a.dtype) != (b.stage, b.dest, b.micro, b.shape, b.dtype):
                problems.append(f"{key} message {k}: sent {a}, received as {b}")
    last = pp * virtual - 1
    want = {(s, s + 1, i) for s in range(last) for i in range(n)} | {(s, s - 1, i) for s in range(1, last + 1)
                                                                    for i in range(n)}
    got = [(op.stage, op.dest, op.micro) for key in sends for op in sends[key]]
    if sorted(got) != sorted(want):
        problems.append(f"messages sent: {sorted(got)}; the pipeline's: {sorted(want)}")
    return problems


def _replay(programs, pp):
    """(b): None if every rank reaches its end, else where each one is stuck."""
    index = {}  # id(op) -> (direction, channel, sender, receiver, k): the k-th such message
    count = defaultdict(int)
    for r, items in enumerate(programs):
        for op in _ops(items):
            pair = (op.channel, r, op.peer) if op.send else (op.channel, op.peer, r)
            key = ("send" if op.send else "recv",) + pair
            index[id(op)] = key + (count[key],)
            count[key] += 1
    pc = [0] * pp
    posted = [set() for _ in range(pp)]  # positions of this rank's posted batches
    fifo = defaultdict(deque)  # (rank, channel) -> posted, unfinished batches [position, open op ids]
    finished = [set() for _ in range(pp)]
    arrived = defaultdict(set)
    progress = True
    while progress:
        progress = False
        for r, items in enumerate(programs):  # each host runs on until it has to wait
            while pc[r] < len(items):
                item = items[pc[r]]
                if isinstance(item, Batch):
                    if pc[r] not in posted[r]:
                        posted[r].add(pc[r])
                        fifo[(r, item.channel)].append([pc[r], {id(op) for op in item.ops}])
                        progress = True
                    if item.wait and pc[r] not in finished[r]:
                        break
                elif item == DRAIN:
                    if posted[r] - finished[r]:
                        break
                elif item[0] == "wait":  # for the batch at position item[1] (torch's receives)
                    if item[1] not in finished[r]:
                        break
                elif item[0] in MARKERS:
                    arrived[item[:2]].add(r)
                    if len(arrived[item[:2]]) < pp:
                        break
                pc[r] += 1
                progress = True
        active = {}  # message key of an operation at the head of its group's queue -> (rank, op id)
        for (r, _), queue in fifo.items():
            if queue:
                for op_id in queue[0][1]:
                    active[index[op_id]] = (r, op_id)
        for key, (r, op_id) in active.items():
            if key[0] == "send" and ("recv",) + key[1:] in active:
                peer, peer_op = active[("recv",) + key[1:]]
                for rank, oid in ((r, op_id), (peer, peer_op)):
                    for q in (q for (rr, _), q in fifo.items() if rr == rank and q):
                        q[0][1].discard(oid)
                progress = True
        for (r, _), queue in fifo.items():
            while queue and not queue[0][1]:
                finished[r].add(queue.popleft()[0])
                progress = True
    if all(pc[r] == len(items) for r, items in enumerate(programs)) and not any(fifo.values()):
        return None
    return "; ".join(f"rank {r} at {items[pc[r]] if pc[r] < len(items) else 'its end'}"
                     for r, items in enumerate(programs))


@pytest.mark.parametrize("schedule,pp,virtual,n", CASES, ids=IDS)
def test_sends_pair_and_cannot_deadlock_under_nccl_rules(schedule, pp, virtual, n):
    programs = _programs(schedule, pp, virtual, n)
    assert _pairing_problems(programs, pp, virtual, n) == []
    assert _replay(programs, pp) is None
    for items in programs:  # no batch is open when a cut's collectives run, nor at the end
        open_batches = False
        for item in items:
            if isinstance(item, Batch):
                open_batches |= not item.wait
            elif item == DRAIN:
                open_batches = False
            elif item[0] in MARKERS:
                assert not open_batches, items
        assert not open_batches


def _unbatched(programs_with_cuts, pp, virtual):
    """The former executor's traffic: before each action a blocking receive, after it an
    unbatched (isend) send, each message on its kind's group; cuts without waiting; all
    sends waited at the end."""
    last = pp * virtual - 1
    out = []
    for r, prog in enumerate(programs_with_cuts):
        items = []
        for kind, c, i in prog:
            if kind == "cut":
                items.append((kind, c, i))
                continue
            s = c * pp + r
            src, dst, ch = (s - 1, s + 1, "act") if kind == "f" else (s + 1, s - 1, "grad")
            has_in, has_out = (s > 0, s < last) if kind == "f" else (s < last, s > 0)
            if has_in:
                items.append(Batch(ch, (P2P(False, ch, src % pp, src, s, i, SHAPE, DTYPE),), True))
            items.append((kind, c, i))
            if has_out:
                items.append(Batch(ch, (P2P(True, ch, dst % pp, s, dst, i, SHAPE, DTYPE),), False))
        out.append(items + [DRAIN])
    return out


def test_replay_catches_unbatched_sends():
    """The replay is not blind: the former executor deadlocks under nccl's rules with
    interleaved stages (two ranks each put a send ahead of the receive the other waits for),
    while its pairing was right and gloo (which buffers sends) ran it."""
    for pp, v, n in ((2, 2, 4), (2, 2, 8), (4, 2, 8)):
        old = _unbatched(place_cuts(rank_programs("interleaved_1f1b", pp, v, n), pp, v, n), pp, v)
        assert _pairing_problems(old, pp, v, n) == []
        assert _replay(old, pp) is not None
    # and it passes where one group carries one direction between any two ranks
    old = _unbatched(place_cuts(rank_programs("1f1b", 2, 1, 4), 2, 1, 4), 2, 1)
    assert _replay(old, 2) is None


def test_pairing_check_catches_swapped_messages():
    programs = _programs("1f1b", 2, 1, 4)
    rank1 = programs[1]
    first, second = [j for j, it in enumerate(rank1) if isinstance(it, Batch) and any(not o.send for o in it.ops)
                     and it.channel == "act"][:2]
    rank1[first], rank1[second] = rank1[second], rank1[first]
    assert _pairing_problems(programs, 2, 1, 4)


# -- the real executor on gloo: what it posts is its program, and it computes what one process does --

def _stage_modules(num_stages, length, hidden):
    torch.manual_seed(0)
    seed = torch.randn(length, hidden)
    weights = [torch.randn(hidden, hidden) / hidden ** 0.5 for _ in range(num_stages)]
    mods = []
    for s in range(num_stages):
        m = torch.nn.Linear(hidden, hidden, bias=False)
        with torch.no_grad():
            m.weight.copy_(weights[s])
        mods.append(m)
    return seed, mods


class _Stage(torch.nn.Module):
    """Stage s of a toy pipeline: the first makes micro-batch i's input (``lengths[i]`` rows
    long: each micro-batch keeps its own length), the last returns a loss."""

    def __init__(self, sid, num_stages, seed, lin, lengths):
        super().__init__()
        self.sid, self.last, self.seed, self.lin, self.lengths = sid, sid == num_stages - 1, seed, lin, lengths

    def forward(self, x, micro, log):
        if self.sid == 0:
            x = _input(self.seed, self.lengths, micro).unsqueeze(0)
        y = torch.tanh(self.lin(x))
        return (y ** 2).sum() if self.last else y


def _input(seed, lengths, i):
    return seed[:lengths[i]] * (1 + i)


EXECUTOR_CASES = [("gpipe", 1, 3), ("1f1b", 1, 4), ("interleaved_1f1b", 2, 4)]  # (schedule, chunks, micro-batches)
TORCH_CASES = [(2, 2), (2, 4), (2, 8), (3, 4)]  # zero-bubble (chunks, micro-batches) at pp = 2, the both-ways case
LENGTH, HIDDEN = 3, 4
MICRO_LENGTHS = (3, 1, 2, 3)  # rows of different lengths in one step, as parallel.rows gives them


def _gloo_worker(rank, world, out_dir):
    """One 2-rank spawn for both gloo checks: (1) the executor's posted batches (recorded at
    ``batch_isend_irecv``) and the batches of its program, and its gradients' distance from
    one process running every stage; (2) the order of the zero-bubble schedule that
    ``PipelineRunner`` builds (what its ``run`` steps)."""
    import pickle

    import torch.distributed as dist

    from parallel.pipeline import PipelineRunner
    from parallel.pipeline_schedule import stage_ids
    from parallel.pipeline_executor import PipelineExecutor

    issued = []
    real = dist.batch_isend_irecv

    def record(ops):
        issued.append([(op.op is dist.isend, op.group, op.group_peer, tuple(op.tensor.shape), op.tensor.dtype)
                       for op in ops])
        return real(ops)

    dist.batch_isend_irecv = record
    groups = (dist.new_group(list(range(world))), dist.new_group(list(range(world))))
    out = {"executor": {}, "torch": {}}
    for schedule, virtual, n in EXECUTOR_CASES:
        num_stages = world * virtual
        seed, mods = _stage_modules(num_stages, LENGTH, HIDDEN)
        ids = [rank + c * world for c in range(virtual)]
        lengths = [MICRO_LENGTHS[i % len(MICRO_LENGTHS)] for i in range(n)]
        chunks = [_Stage(s, num_stages, seed, mods[s], lengths) for s in ids]
        ex = PipelineExecutor(chunks, ids, num_stages, groups, torch.device("cpu"), HIDDEN, torch.float32)
        programs = place_cuts(rank_programs(schedule, world, virtual, n), world, virtual, n)
        issued.clear()
        ex.run(programs, lengths, list(range(n)))
        name = {id(g): ch for ch, g in ex.groups.items()}
        got = [[(send, name[id(g)], peer, shape, dtype) for send, g, peer, shape, dtype in batch] for batch in issued]
        want = [[(op.send, b.channel, op.peer, op.shape, op.dtype) for op in b.ops]
                for b in ex.p2p_programs(programs, lengths)[rank] if isinstance(b, Batch)]
        assert {op[3][1] for b in want for op in b} == set(lengths)  # every micro-batch's own shape
        ref_seed, ref = _stage_modules(num_stages, LENGTH, HIDDEN)
        for i in range(n):
            x = _input(ref_seed, lengths, i).unsqueeze(0)
            for m in ref:
                x = torch.tanh(m(x))
            (x ** 2).sum().backward()
        err = max(float((ch.lin.weight.grad - ref[s].weight.grad).abs().max() / ref[s].weight.grad.abs().max())
                  for s, ch in zip(ids, chunks))  # relative
        out["executor"][schedule] = (got, want, err)
    for v, n in TORCH_CASES:
        runner = PipelineRunner([torch.nn.Identity() for _ in range(v)], stage_ids(rank, world, v), world * v,
                                "zero_bubble", dist.group.WORLD, torch.device("cpu"), 8, DTYPE)
        schedule = runner._schedule(5, n)
        assert schedule.stage_index_to_group_rank == {st: st % world for st in range(world * v)}
        out["torch"][(v, n)] = {r: [(a.computation_type.name, a.stage_index, a.microbatch_index) for a in acts]
                                for r, acts in schedule.pipeline_order_with_comms.items()}
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    import pickle

    out_dir = tmp_path_factory.mktemp("gloo")
    run_ranks(_gloo_worker, 2, str(out_dir), timeout_s=120)
    runs = []
    for rank in range(2):
        with open(out_dir / f"rank{rank}.pkl", "rb") as f:
            runs.append(pickle.load(f))
    return runs


def test_executor_posts_its_program_on_gloo(gloo_run):
    for rank, run in enumerate(gloo_run):
        assert sorted(run["executor"]) == sorted(s for s, _, _ in EXECUTOR_CASES)
        for schedule, (got, want, err) in run["executor"].items():
            assert want and got == want, (schedule, rank)
            assert err <= 1e-5, (schedule, rank, err)


def _torch_items(order, pp):
    """torch's runtime: SEND_* and RECV_* are unbatched isend / irecv on the stage group (one
    communicator), a receive waited just before the computation that needs it, every send at
    the end."""
    out = []
    for r in range(pp):
        items, recv_at = [], {}
        for kind, st, i in order[r]:
            if kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                send = kind.startswith("SEND")
                fwd = kind.endswith("F")
                src = st if send else (st - 1 if fwd else st + 1)
                dst = (st + 1 if fwd else st - 1) if send else st
                peer = (dst if send else src) % pp
                items.append(Batch("pp", (P2P(send, "pp", peer, src, dst, i, SHAPE, DTYPE),), False))
                if not send:
                    recv_at[(st, i, fwd)] = len(items) - 1
            elif kind in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT"):
                pos = recv_at.pop((st, i, kind == "FORWARD"), None)
                if pos is not None:
                    items.append(("wait", pos, -1))
                items.append(("f" if kind == "FORWARD" else "b", st, i))
        out.append(items + [DRAIN])
    return out


def test_torch_zero_bubble_order_pairs_and_cannot_deadlock(gloo_run):
    """Not Omni's code, so not batched by it: torch posts each receive where its planner put
    the matching send (one global order), which is safe under nccl's rules too."""
    found = gloo_run[0]["torch"]
    assert sorted(found) == sorted(TORCH_CASES)
    for (v, n), order in found.items():
        items = _torch_items(order, 2)
        assert _pairing_problems(items, 2, v, n) == [], (v, n)
        assert _replay(items, 2) is None, (v, n)
