"""``multiplex.exchange=p2p`` without processes: from the global plan, every rank works out the
same pairs, so each send has its receive (same peer pair, same number of rows), pairs that
trade nothing post nothing, and no rank sends to itself. NCCL matches a pair's messages by
order and checks no sizes; with one message per pair and direction, matching counts are all
it needs."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dataloading.plan.cost import CostModel
from omni.step.encoder_cut import plan_cut
from omni.step.encoder_plan import ItemMeta, SplitRules
from parallel.reshard import p2p_transfers

COST = CostModel(encoders={"image": (1.0, 10.0), "audio": (2.0, 1.0)})


def _messages(send_counts: list[list[int]], recv_counts: list[list[int]]):
    """Every rank's posted sends and receives as (src, dst, rows)."""
    sends, recvs = Counter(), Counter()
    for me in range(len(send_counts)):
        for t in p2p_transfers(send_counts[me], recv_counts[me], me):
            assert t.peer != me and t.hi > t.lo
            if t.send:
                sends[(me, t.peer, t.hi - t.lo)] += 1
            else:
                recvs[(t.peer, me, t.hi - t.lo)] += 1
    return sends, recvs


def _check(send_counts, recv_counts):
    sends, recvs = _messages(send_counts, recv_counts)
    assert sends == recvs  # every send meets a receive of the same size, and no receive is left over
    assert all(n == 1 for n in sends.values())  # at most one message per pair and direction
    trading = {(p, q) for p in range(len(send_counts)) for q, c in enumerate(send_counts[p]) if c and p != q}
    assert {(p, q) for p, q, _ in sends} == trading
    return trading


def _cut(world: int, sp: int, seed: int):
    rng = np.random.default_rng(seed)
    group_of = [r // 2 for r in range(world)]  # data groups of two ranks (TP or CP peers)
    items_by_chunk, needs_by_chunk = [], []
    for _ in range(2):
        items = []
        for g in range(world // 2):
            for m in ("image", "audio"):
                for i in range(int(rng.integers(0, 3))):
                    tok = int(rng.integers(1, 40))
                    items.append(ItemMeta(g, m, i, tok, 2 * tok))
        needs = {}
        for q in range(world):
            g = group_of[q]
            for m in ("image", "audio"):
                total = sum(it.tokens for it in items if it.group == g and it.modality == m)
                if total:
                    needs.setdefault(q, {})[m] = np.arange(q % 2, total, 2)  # the group's two ranks share rows
        items_by_chunk.append(items)
        needs_by_chunk.append(needs)
    return plan_cut(items_by_chunk, needs_by_chunk, group_of, world, COST,
                    split=SplitRules(sp=sp, sp_modalities=("image",)))


@pytest.mark.parametrize("world,sp", [(2, 1), (4, 2), (8, 2), (8, 4)])
def test_outputs_and_gradients_pair_up(world, sp):
    plan = _cut(world, sp, seed=world * 10 + sp).plan
    out_send = [[len(s) for s in rp.out_send] for rp in plan.ranks]
    out_recv = [list(rp.out_recv_counts) for rp in plan.ranks]
    assert out_send == [list(col) for col in zip(*out_recv)]  # the plan itself: p's send to q = q's receive from p
    forward = _check(out_send, out_recv)
    backward = _check(out_recv, out_send)  # the gradients go back the same pairs, reversed
    assert backward == {(q, p) for p, q in forward}


@pytest.mark.parametrize("world,sp", [(4, 2), (8, 2)])
def test_features_pair_up(world, sp):
    cut = _cut(world, sp, seed=world + sp)
    units = {it.key: it.units for it in cut.items}
    for m in cut.plan.ranks[0].feat_send:
        send = [[sum(units[(m, g, i)] for g, i in dst) for dst in rp.feat_send[m]] for rp in cut.plan.ranks]
        recv = [[sum(units[(m, g, i)] for g, i in src) for src in rp.feat_recv[m]] for rp in cut.plan.ranks]
        _check(send, recv)


def test_only_the_trading_pairs_post_anything():
    # rank 0 sends 3 rows to rank 2 and keeps 1; rank 1 and rank 3 trade nothing at all
    send = [[1, 0, 3, 0], [0, 0, 0, 0], [0, 0, 2, 0], [0, 0, 0, 0]]
    recv = [[1, 0, 0, 0], [0, 0, 0, 0], [3, 0, 2, 0], [0, 0, 0, 0]]
    assert _check(send, recv) == {(0, 2)}
    assert p2p_transfers(send[1], recv[1], 1) == [] and p2p_transfers(send[3], recv[3], 3) == []
    (t,) = p2p_transfers(send[0], recv[0], 0)
    assert (t.send, t.peer, t.lo, t.hi) == (True, 2, 1, 4)  # rows 1..3 of rank 0's send buffer
    (t,) = p2p_transfers(send[2], recv[2], 2)
    assert (t.send, t.peer, t.lo, t.hi) == (False, 0, 0, 3)  # into rows 0..2: source-rank order
