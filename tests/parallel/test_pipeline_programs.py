"""The pipeline executor's programs, checked without running a model: every stage runs every
micro-batch's forward and backward once; the programs cannot deadlock; every cut is
consistent (the actions before cut k on all ranks are closed under "happens before", so a
collective at the cut cannot wait on itself); on every channel and ordered pair of ranks the
messages are received in the order they are sent (what matching by order needs on nccl);
and the encoder backwards are placed where stage 0 has the embedding gradient."""
from __future__ import annotations

import pytest

from parallel.pipeline_schedule import bubble_windows, encoder_backward_cuts, place_cuts, rank_programs

CASES = [("gpipe", 2, 1, 4), ("gpipe", 4, 1, 6), ("1f1b", 2, 1, 4), ("1f1b", 4, 1, 8), ("1f1b", 3, 1, 2),
         ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 2, 2, 8), ("interleaved_1f1b", 4, 2, 8),
         ("interleaved_1f1b", 2, 3, 6), ("interleaved_1f1b", 4, 2, 12)]
IDS = [f"{s}-pp{p}-v{v}-m{m}" for s, p, v, m in CASES]


def _edges(programs, pp, virtual):
    """Happens-before edges between (rank, position) nodes: program order and data."""
    last = pp * virtual - 1
    where = {(k, c * pp + r, i): (r, pos) for r, prog in enumerate(programs) for pos, (k, c, i) in enumerate(prog)}
    edges = []
    for r, prog in enumerate(programs):
        for pos, (kind, c, i) in enumerate(prog):
            if pos:
                edges.append(((r, pos - 1), (r, pos)))
            stage = c * pp + r
            dep = (("f", stage - 1, i) if stage > 0 else None) if kind == "f" else \
                (("b", stage + 1, i) if stage < last else ("f", stage, i))
            if dep is not None:
                edges.append((where[dep], (r, pos)))
    return edges


@pytest.mark.parametrize("schedule,pp,virtual,n", CASES, ids=IDS)
def test_every_action_once_and_cuts_consistent(schedule, pp, virtual, n):
    programs = rank_programs(schedule, pp, virtual, n)
    for r, prog in enumerate(programs):
        want = {(k, c, i) for k in "fb" for c in range(virtual) for i in range(n)}
        assert sorted(prog) == sorted(want) and len(prog) == len(want), r
        for c in range(virtual):  # a chunk's forwards (and backwards) in micro-batch order
            for kind in "fb":
                mbs = [i for k, cc, i in prog if k == kind and cc == c]
                assert mbs == sorted(mbs)
    cut = place_cuts(programs, pp, virtual, n)
    # positions of the cuts in the cut-free program numbering
    bounds = []
    for r, prog in enumerate(cut):
        seen, at = {}, 0
        for kind, c, _ in prog:
            if kind == "cut":
                seen[c] = at
            else:
                at += 1
        assert sorted(seen) == list(range(n)), "every cut once"
        assert [seen[k] for k in range(n)] == sorted(seen[k] for k in range(n)), "cuts in order"
        bounds.append(seen)
    # stage 0's rank: cut k right before F(0, k)
    for k in range(n):
        assert programs[0][bounds[0][k]] == ("f", 0, k)
    # consistency: no action before a cut depends on an action after another rank's cut
    for (a, b) in _edges(programs, pp, virtual):
        for k in range(n):
            if b[1] < bounds[b[0]][k]:
                assert a[1] < bounds[a[0]][k], (k, a, b)


@pytest.mark.parametrize("schedule,pp,virtual,n", CASES, ids=IDS)
def test_each_channel_delivers_in_send_order(schedule, pp, virtual, n):
    programs = rank_programs(schedule, pp, virtual, n)
    last = pp * virtual - 1
    sent, received = {}, {}
    for r, prog in enumerate(programs):
        for kind, c, i in prog:
            stage = c * pp + r
            if kind == "f":
                if stage < last:
                    sent.setdefault(("act", r, (stage + 1) % pp), []).append((stage, i))
                if stage > 0:
                    received.setdefault(("act", (stage - 1) % pp, r), []).append((stage - 1, i))
            else:
                if stage > 0:
                    sent.setdefault(("grad", r, (stage - 1) % pp), []).append((stage, i))
                if stage < last:
                    received.setdefault(("grad", (stage + 1) % pp, r), []).append((stage + 1, i))
    assert sent == received


def test_encoder_backwards_follow_stage_zero():
    # 1F1B: stage 0 finishes micro-batch j's backward just before its forward of j + pp
    for pp, n in ((2, 4), (4, 8)):
        programs = place_cuts(rank_programs("1f1b", pp, 1, n), pp, 1, n)
        assert encoder_backward_cuts(programs[0], n) == [j + pp if j + pp < n else None for j in range(n)]
    # GPipe: every backward after every forward
    programs = place_cuts(rank_programs("gpipe", 2, 1, 4), 2, 1, 4)
    assert encoder_backward_cuts(programs[0], 4) == [None] * 4
    # interleaved, pp=2 x 2 chunks, 8 micro-batches: rounds of 2
    programs = place_cuts(rank_programs("interleaved_1f1b", 2, 2, 8), 2, 2, 8)
    assert encoder_backward_cuts(programs[0], 8) == [4, 4, 6, 6, None, None, None, None]


def test_schedule_mistakes_are_named():
    with pytest.raises(ValueError, match="rounds of pp=4"):
        rank_programs("interleaved_1f1b", 4, 2, 6)
    with pytest.raises(ValueError, match="interleaved_1f1b needs several"):
        rank_programs("interleaved_1f1b", 2, 1, 4)
    with pytest.raises(ValueError, match="not one of"):
        rank_programs("zero_bubble", 2, 2, 4)


def test_one_f_one_b_cut_is_stage_zeros_moment():
    """pp=2: stage 1 meets cut k after its backward of micro-batch k - 1 (its forward of k
    needs stage 0's, which follows the cut)."""
    cut = place_cuts(rank_programs("1f1b", 2, 1, 4), 2, 1, 4)
    text = " ".join(f"|{c}" if k == "cut" else f"{k}{i}" for k, c, i in cut[1])
    assert text == "|0 |1 f0 b0 f1 b1 |2 f2 b2 |3 f3 b3"


@pytest.mark.parametrize("schedule,pp,virtual,n", CASES, ids=IDS)
def test_tail_cuts_are_consistent_and_bubble_windows_are_idle(schedule, pp, virtual, n):
    """Tail cuts (``place_cuts(tails=...)``) are consistent as cuts are, come on rank 0 right
    after its backward of their micro-batch, and each bubble window is where its rank really
    idles: its delivery cut precedes its first action, and its tail cut follows its last."""
    windows = bubble_windows(schedule, pp, virtual, n)
    assert windows[0] is None and all(w is not None and w.rank == r for r, w in enumerate(windows) if r)
    tails = sorted({w.tail for w in windows if w is not None})
    programs = rank_programs(schedule, pp, virtual, n)
    cut = place_cuts(programs, pp, virtual, n, tails)
    bounds = []  # per rank: marker -> position in the cut-free program
    for r, prog in enumerate(cut):
        seen, at = {}, 0
        for a in prog:
            if a[0] in ("cut", "tail"):
                seen[a[:2]] = at
            else:
                at += 1
        assert sorted(seen) == sorted([("cut", k) for k in range(n)] + [("tail", j) for j in tails])
        bounds.append(seen)
    orders = [[a[:2] for a in prog if a[0] in ("cut", "tail")] for prog in cut]
    assert all(order == orders[0] for order in orders), "the same order of cuts on every rank"
    for j in tails:  # rank 0: right after its backward of j through model chunk 0
        assert programs[0][bounds[0][("tail", j)] - 1] == ("b", 0, j)
    for (a, b) in _edges(programs, pp, virtual):
        for mark in bounds[0]:
            if b[1] < bounds[b[0]][mark]:
                assert a[1] < bounds[a[0]][mark], (mark, a, b)
    for w in windows[1:]:
        assert bounds[w.rank][("cut", w.deliver_cut)] == 0, "the delivery cut comes before the rank's first action"
        assert w.deliver_cut + 1 == n or bounds[w.rank][("cut", w.deliver_cut + 1)] > 0, "... and is the last such"
        assert bounds[w.rank][("tail", w.tail)] == len(programs[w.rank]), "the tail cut comes after its last action"
        assert w.before >= 1.0 and w.after >= 0.0
