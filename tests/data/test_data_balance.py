"""The balancer only rearranges: every item exactly once, the budget holds, every rank gets the
same number of micro-batches; and the cost-aware methods beat the plain order."""
import numpy as np
import pytest

from dataloading.errors import DataError
from dataloading.plan.balance import METHODS, _kk, _lpt, arrange
from dataloading.plan.cost import CostModel


def skewed(n, seed=0, cap=4096):
    rng = np.random.default_rng(seed)
    tokens = np.minimum((rng.pareto(1.3, n) * 200 + 32).astype(np.int64), cap)
    costs = CostModel(alpha=1.0, beta=300.0).llm_cost(tokens)
    return costs, tokens


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("ranks, group", [(1, 0), (4, 0), (8, 0), (8, 2), (16, 4)])
def test_every_item_once_budget_and_equal_micro_batch_counts(method, ranks, group):
    costs, tokens = skewed(97, seed=ranks)
    arr = arrange(costs, tokens, ranks, budget=4096, method=method, group_size=group)
    flat = sorted(i for rank in arr.ranks for mb in rank for i in mb)
    assert flat == list(range(97))
    assert len({len(rank) for rank in arr.ranks}) == 1 and len(arr.ranks) == ranks
    for rank in arr.ranks:
        for mb in rank:
            assert tokens[mb].sum() <= 4096
    assert np.allclose(arr.rank_cost, [costs[[i for mb in r for i in mb]].sum() for r in arr.ranks])
    stats = arr.stats(costs)
    assert stats["max_over_mean"] >= stats["lower_bound"] - 1e-12 >= 1 - 1e-12


def test_cost_aware_methods_beat_the_plain_order():
    costs, tokens = skewed(512, seed=3)
    ratio = {m: arrange(costs, tokens, 16, 4096, m).stats(costs)["max_over_mean"] for m in METHODS}
    bound = arrange(costs, tokens, 16, 4096, "none").stats(costs)["lower_bound"]
    assert ratio["balanced"] <= min(ratio.values()) * 1.001  # refinement stops within 0.1% of the bound
    assert ratio["balanced"] <= max(1.02, bound * 1.001)
    assert ratio["none"] > 1.2 * ratio["balanced"]
    # Token balancing is not cost balancing when attention (L^2) matters.
    assert ratio["lpt"] < ratio["sorted_greedy"]


def test_kk_beats_lpt_on_its_textbook_case():
    # LPT puts 3,3 | 2,2,2 (6 vs 6... with 5 items: 3,3,2,2,2 into 2 bins -> LPT 7/5, optimum 6/6.
    w = np.array([3.0, 3.0, 2.0, 2.0, 2.0])
    lpt = sorted(w[b].sum() for b in _lpt(w, 2))
    kk = sorted(w[b].sum() for b in _kk(w, 2))
    assert lpt == [5.0, 7.0]
    assert max(kk) <= 7.0
    best = arrange(w, np.ones(5, dtype=np.int64), 2, None, "balanced")
    assert sorted(best.rank_cost) == [6.0, 6.0]  # refinement finds the perfect split


@pytest.mark.parametrize("k", [2, 3, 7, 64])
def test_kk_assigns_every_item_once(k):
    costs, _ = skewed(300, seed=k)
    bins = _kk(costs, k)
    assert len(bins) == k and sorted(i for b in bins for i in b) == list(range(300))


def test_plain_order_is_contiguous_and_next_fit():
    tokens = np.array([5, 5, 5, 5, 5, 5, 5, 5])
    arr = arrange(tokens.astype(float), tokens, 2, budget=10, method="none")
    assert arr.ranks == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert arr.stats(tokens.astype(float))["utilisation"] == 1.0


def test_ranks_without_work_get_empty_micro_batches():
    arr = arrange([10.0, 1.0], [10, 1], 4, budget=16, method="balanced")
    assert sum(1 for r in arr.ranks if not any(r)) == 2
    assert all(len(r) == 1 for r in arr.ranks)


def test_errors():
    with pytest.raises(DataError, match="data.balance='fast' is not a method"):
        arrange([1.0], [1], 1, None, "fast")
    with pytest.raises(DataError, match="balance_group=3 must divide the data-parallel size 8"):
        arrange([1.0] * 8, [1] * 8, 8, None, "balanced", group_size=3)
    with pytest.raises(DataError, match="over the micro-batch budget"):
        arrange([1.0], [20], 1, 10, "balanced")


def test_micro_batches_come_in_multiples_of_the_pipeline_stages():
    """With pipeline parallelism a step runs a multiple of pp micro-batches per rank, each as
    long as the rank's longest (parallel.rows.microbatch_count); the planner packs that many
    (``multiple``), so no rank gets an empty, full-length one and the longest row is no longer
    than with the fewest micro-batches. The items, their ranks and the budget are unchanged."""
    from dataloading.plan.balance import arrange
    from parallel.rows import microbatch_count, microbatch_multiple

    rng = np.random.default_rng(3)
    tokens = rng.integers(300, 3000, size=90)
    costs = tokens.astype(np.float64) ** 1.3
    for method in ("balanced", "sorted_greedy", "none"):
        for pp in (2, 3, 4):
            plain = arrange(costs, tokens, 4, 8192, method)
            piped = arrange(costs, tokens, 4, 8192, method, multiple=microbatch_multiple(pp))
            m = len(piped.ranks[0])
            assert m % pp == 0 and all(len(r) == m for r in piped.ranks)
            assert m == microbatch_count(len(plain.ranks[0]), pp)  # what the pipeline runs either way
            assert sorted(i for r in piped.ranks for mb in r for i in mb) == list(range(90))
            assert all(sum(tokens[i] for i in mb) <= 8192 for r in piped.ranks for mb in r)
            longest = max(sum(tokens[i] for i in mb) for r in piped.ranks for mb in r)
            assert longest <= max(sum(tokens[i] for i in mb) for r in plain.ranks for mb in r)
            if method != "none":  # balanced packing fills every micro-batch
                assert all(mb for r in piped.ranks for mb in r)
    assert microbatch_multiple(1) == 1
