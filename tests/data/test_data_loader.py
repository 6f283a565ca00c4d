import json

import pytest

from dataloading.config import DataConfig
from dataloading.errors import DataError
from dataloading.formats.tokenizer import ByteTokenizer
from dataloading.serve.loader import build_loader
from step_asserts import assert_same_step, take


def loader(demo_dir, processors, rank=0, dp=2, budget=1024, workers=1, **kw):
    data = DataConfig(mixture=str(demo_dir / "mixture.yaml"), global_batch_size=8, micro_batch_tokens=budget,
                      num_workers=workers, **kw)
    return build_loader(data, ByteTokenizer(), processors, seed=7, dp_size=dp, dp_rank=rank, progress=False)


def same(a, b):
    assert_same_step(a, b)


def test_state_round_trip_gives_identical_next_batches(demo_dir, processors):
    first = loader(demo_dir, processors)
    head = take(first, 3)
    assert [s.step for s in head] == [0, 1, 2]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["planner"]["step"] == 3  # committed state, not how far the workers ran ahead
    expected = take(first, 3)
    first.close()

    resumed = loader(demo_dir, processors)
    resumed.load_state_dict(state)
    got = take(resumed, 3)
    resumed.close()
    for a, b in zip(got, expected):
        same(a, b)
    assert got[0].step == 3 and all(s.num_target_tokens > 0 for s in got)


def test_sync_and_workers_agree_and_ranks_partition_the_step(demo_dir, processors):
    sync = take(loader(demo_dir, processors, workers=0), 2)
    ahead_loader = loader(demo_dir, processors, workers=2)
    ahead = take(ahead_loader, 2)
    ahead_loader.close()
    for a, b in zip(sync, ahead):
        same(a, b)
    other = take(loader(demo_dir, processors, rank=1, workers=0), 2)
    for mine, theirs in zip(sync, other):
        ids_mine = {s for mb in mine.micro_batches for s in mb.sample_ids}
        ids_theirs = {s for mb in theirs.micro_batches for s in mb.sample_ids}
        assert not ids_mine & ids_theirs and len(ids_mine | ids_theirs) == 8


def test_errors_from_a_worker_reach_the_caller_as_one_line(demo_dir, processors):
    # Over budget is found by the planner (metadata) before any worker runs ...
    with pytest.raises(DataError, match=r"needs \d+ tokens but data.micro_batch_tokens=16"):
        take(loader(demo_dir, processors, budget=16), 3)
    # ... a sample that fails in a worker comes back with its kind and one line.
    bad = loader(demo_dir, processors, on_error="stop")
    bad.constructor.processors["image"] = None  # every image now fails in the worker
    bad.constructor._source_processors.clear()
    with pytest.raises(DataError) as info:
        take(bad, 3)
    assert "\n" not in str(info.value) and "image" in str(info.value)
    assert bad._iter is None  # workers stopped, not left running


def test_set_weights_applies_from_the_next_step(demo_dir, processors):
    ld = loader(demo_dir, processors, dp=1, rank=0)
    take(ld, 2)
    ld.set_weights({"shapes": 0.0, "tones": 0.0, "text": 1.0})
    (batch,) = take(ld, 1)
    ld.close()
    assert batch.step == 2
    assert {s.split("/")[0] for mb in batch.micro_batches for s in mb.sample_ids} == {"text"}
