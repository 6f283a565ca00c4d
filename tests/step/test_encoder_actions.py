"""The encoder action list every encoder rank runs (and the simulator replays): each chunk's
forward and backward exactly once, forwards in time for their micro-batch, backwards only once
stage 0 has finished the micro-batch, grouped by multiplex.chunks_per_cut."""
import pytest

from omni.step.multiplex_rules import encoder_actions, encoder_segments
from parallel.pipeline_schedule import encoder_backward_cuts, place_cuts, rank_programs


def _segments(acts, n, group, lookahead=0, placement="colocated", ready=None):
    """Which insertion point runs each action (cut k, or n: after the pipeline), from the
    runtime's own segments; checked to flatten to ``acts``."""
    segs = encoder_segments(placement, n, ready, group, lookahead)
    assert [a for k in sorted(segs) for a in segs[k]] == acts
    return {a: k for k, seg in segs.items() for a in seg}


@pytest.mark.parametrize("schedule,pp,v,n", [("1f1b", 2, 1, 6), ("1f1b", 4, 1, 8), ("gpipe", 2, 1, 4),
                                             ("interleaved_1f1b", 2, 2, 8), (None, 1, 1, 5)])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_every_chunk_once_forward_in_time_backward_when_ready(schedule, pp, v, n, group):
    if schedule is None:  # no pipeline: micro-batch j's backward is done before cut j + 1
        ready = [j + 1 for j in range(n)]
    else:
        ready = encoder_backward_cuts(place_cuts(rank_programs(schedule, pp, v, n), pp, v, n)[0], n)
    acts = encoder_actions("colocated", n, ready, group)
    assert sorted(acts) == sorted([("F", j) for j in range(n)] + [("B", j) for j in range(n)])
    at = _segments(acts, n, group, ready=ready)
    for j in range(n):
        assert at[("F", j)] <= j  # chunk j's outputs exist before stage 0's forward of j
        assert at[("F", j)] == (j // group) * group
        earliest = n if ready[j] is None else ready[j]
        assert at[("B", j)] >= earliest  # never before stage 0 has j's embedding gradient
        assert acts.index(("F", j)) < acts.index(("B", j))
    insertion_points = {at[a] for a in acts if at[a] < n}
    assert len(insertion_points) == -(-n // group)


def test_encoder_first_keeps_everything_outside_the_pipeline():
    acts = encoder_actions("encoder_first", 4, [1, 2, 3, 4], 2)
    assert acts == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)]


@pytest.mark.parametrize("schedule,pp,v,n", [("1f1b", 2, 1, 6), ("1f1b", 4, 1, 8), ("interleaved_1f1b", 2, 2, 8),
                                             (None, 1, 1, 5)])
@pytest.mark.parametrize("group", [2, 3])
def test_a_cut_groups_backward_is_one_call_after_its_last_chunk(schedule, pp, v, n, group):
    """A cut group is encoded in one call, whose graph has one backward: its B actions sit
    together, at the first group cut at or after the latest of its chunks' backward cuts."""
    if schedule is None:
        ready = [j + 1 for j in range(n)]
    else:
        ready = encoder_backward_cuts(place_cuts(rank_programs(schedule, pp, v, n), pp, v, n)[0], n)
    acts = encoder_actions("colocated", n, ready, group)
    at = _segments(acts, n, group, ready=ready)
    for k in range(0, n, group):
        js = list(range(k, min(k + group, n)))
        where = [acts.index(("B", j)) for j in js]
        assert where == list(range(where[0], where[0] + len(js)))  # adjacent, in chunk order
        latest = n if any(ready[j] is None for j in js) else max(ready[j] for j in js)
        assert len({at[("B", j)] for j in js}) == 1 and at[("B", js[0])] >= latest


@pytest.mark.parametrize("schedule,pp,v,n", [("1f1b", 2, 1, 6), ("interleaved_1f1b", 2, 2, 8), (None, 1, 1, 5)])
@pytest.mark.parametrize("group,lookahead", [(1, 1), (2, 1), (1, 2), (3, 5)])
def test_lookahead_encodes_groups_early_and_keeps_backwards_where_they_were(schedule, pp, v, n, group, lookahead):
    if schedule is None:
        ready = [j + 1 for j in range(n)]
    else:
        ready = encoder_backward_cuts(place_cuts(rank_programs(schedule, pp, v, n), pp, v, n)[0], n)
    acts = encoder_actions("colocated", n, ready, group, lookahead)
    assert sorted(acts) == sorted([("F", j) for j in range(n)] + [("B", j) for j in range(n)])
    at = _segments(acts, n, group, lookahead, ready=ready)
    plain = _segments(encoder_actions("colocated", n, ready, group), n, group, ready=ready)
    for j in range(n):
        assert at[("F", j)] == max(0, (j // group - lookahead) * group)  # `lookahead` insertion points early
        assert at[("B", j)] == plain[("B", j)]  # backwards where they were without it
        assert acts.index(("F", j)) < acts.index(("B", j))
    first = encoder_segments("colocated", n, ready, group, lookahead)[0]
    assert [a for a in first if a[0] == "F"] == [("F", j) for j in range(min((lookahead + 1) * group, n))]
