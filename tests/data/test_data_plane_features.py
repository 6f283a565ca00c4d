"""Curricula, mixture adherence, exact-once elastic resume, over-budget policies, per-source
options, worker death: the data plane end to end on small real shards."""
import json
import os
import textwrap

import numpy as np
import pytest
import torch

from dataloading.config import DataConfig
from dataloading.construct.batch import IGNORE_INDEX
from dataloading.errors import DataError
from dataloading.formats.tokenizer import ByteTokenizer
from dataloading.index.shards import write_shards
from dataloading.index.source_index import SampleMeta, SourceIndex, build_index
from dataloading.plan.mixture import WeightSchedule, load_mixture
from dataloading.plan.planner import Planner
from dataloading.serve.loader import build_loader

TOK = ByteTokenizer()


def write_source(folder, samples, per_shard=16):
    write_shards(samples, folder, folder.name, samples_per_shard=per_shard)
    build_index(folder, workers=1, progress=False)
    return folder


def write_mixture(folder, body):
    path = folder / "mix.yaml"
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def loader(mix, processors=None, dp=1, rank=0, batch=8, budget=64, workers=0, **kw):
    data = DataConfig(mixture=str(mix), global_batch_size=batch, micro_batch_tokens=budget, num_workers=workers, **kw)
    return build_loader(data, TOK, processors or {}, seed=3, dp_size=dp, dp_rank=rank, progress=False)


def units(batch):
    return [u for mb in batch.micro_batches for u in mb.sample_ids]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """96 short texts (10..40 tokens) and 4 long ones (100, 150, 200, 250 tokens)."""
    root = tmp_path_factory.mktemp("texts")
    rng = np.random.default_rng(0)
    short = [{"__key__": f"s{i:03d}", "txt": "ab" * int(rng.integers(4, 19))} for i in range(96)]
    write_source(root / "short", short)
    long = [{"__key__": f"l{i}", "txt": "".join(chr(97 + (j % 26)) for j in range(98 + 50 * i))} for i in range(4)]
    write_source(root / "long", long)
    return root


# ---- curricula and mixture adherence -------------------------------------------------
def test_weight_schedule_is_piecewise_linear(tmp_path, texts):
    mix = write_mixture(texts, """
        sources:
          - {name: short, path: short, weight: {0: 1.0, 10: 0.5}}
          - {name: long, path: long, weight: {0: 0.0, 10: 0.5, 20: 0.0}}
        """)
    m = load_mixture(mix)
    sched = m.sources[1].weight
    assert isinstance(sched, WeightSchedule) and m.has_schedule
    assert [sched.at(s) for s in (0, 5, 10, 15, 20, 99)] == [0.0, 0.25, 0.5, 0.25, 0.0, 0.0]
    ld = loader(mix, batch=8, budget=256)
    got = [sum(u.startswith("long/") for u in units(next(ld))) for _ in range(21)]
    assert got[0] == 0 and got[20] == 0  # weight 0: not even a remainder
    assert sum(got[8:13]) == pytest.approx(8 * sum(0.5 * min(s, 20 - s) / 10 for s in range(8, 13)), abs=1)


def test_mixture_shares_hold_over_any_ten_steps(demo_dir, processors):
    mix = load_mixture(demo_dir / "mixture.yaml")
    planner = Planner({s.name: __import__("dataloading").load_index(s.path) for s in mix.sources}, mix.weights,
                      0, 16, 2, processors=processors)
    per_step = []
    for _ in range(60):
        per_step.append(planner.plan().sources)
        planner.advance()
    for start in range(0, 50):
        window = per_step[start:start + 10]
        for name, w in mix.weights.items():
            share = sum(s.get(name, 0) for s in window) / 160
            assert abs(share - w) <= 0.03, (start, name, share)
    # and the deficit that makes this work is part of the (dp-independent) state
    assert set(planner.state_dict()["sources"]["text"]) == {"epoch", "cursor", "deficit", "num_samples"}


# ---- exact-once, elastic ---------------------------------------------------------------
def test_one_epoch_stopped_at_dp8_resumed_at_dp4_delivers_every_sample_once(texts):
    mix = write_mixture(texts, """
        sources:
          - {name: short, path: short, weight: 1}
        """)
    seen = []
    at8 = [loader(mix, dp=8, rank=r, batch=16) for r in range(8)]
    for _ in range(2):  # 32 of 96 samples
        for ld in at8:
            seen += units(next(ld))
    state = json.loads(json.dumps(at8[0].state_dict()))
    assert all(ld.state_dict() == at8[0].state_dict() for ld in at8)  # one logical state
    at4 = [loader(mix, dp=4, rank=r, batch=16) for r in range(4)]
    for ld in at4:
        ld.load_state_dict(state)
    for _ in range(4):  # the other 64
        for ld in at4:
            seen += units(next(ld))
    assert sorted(seen) == sorted(f"short/s{i:03d}" for i in range(96))
    nxt = loader(mix, dp=4, rank=0, batch=16)
    nxt.load_state_dict(at4[0].state_dict())
    assert nxt.planner.state_dict()["sources"]["short"]["epoch"] == 1  # the next epoch, reshuffled


# ---- over-budget policies ---------------------------------------------------------------
def _full(ld, uid):
    c = ld.constructor
    return c.tokenize(c.fetch(uid))


@pytest.mark.parametrize("policy", ["skip", "truncate", "split"])
def test_over_budget_policies(texts, policy):
    mix = write_mixture(texts, f"""
        sources:
          - {{name: long, path: long, weight: 1, over_budget: {policy}}}
        """)
    ld = loader(mix, batch=4, budget=64)
    batch = next(ld)  # all four long samples (101..251 tokens) in one step
    got = {u: None for u in units(batch)}
    rows = {sid: mb for mb in batch.micro_batches for sid in mb.sample_ids}
    if policy == "skip":
        assert got == {} and batch.problems == {"over_budget": 4}
        assert all(mb.num_tokens == 1 for mb in batch.micro_batches)  # placeholder rows only
        return
    for key in ("l0", "l1", "l2", "l3"):
        full = _full(ld, f"long/{key}")
        if policy == "truncate":
            mb = rows[f"long/{key}"]
            i = mb.sample_ids.index(f"long/{key}")
            a, b = mb.cu_seqlens[i].item(), mb.cu_seqlens[i + 1].item()
            assert b - a == 64 and torch.equal(mb.input_ids[a:b], torch.from_numpy(full.ids[:64]))
        else:
            pieces = sorted((u for u in got if u.startswith(f"long/{key}#")), key=lambda u: int(u.split("#")[1]))
            assert len(pieces) == -(-len(full) // 64)
            ids, labels = [], []
            for u in pieces:
                mb = rows[u]
                i = mb.sample_ids.index(u)
                a, b = mb.cu_seqlens[i].item(), mb.cu_seqlens[i + 1].item()
                assert mb.position_ids[a].item() == 0  # each piece is its own document
                ids.append(mb.input_ids[a:b])
                labels.append(mb.labels[a:b])
            assert torch.equal(torch.cat(ids), torch.from_numpy(full.ids))
            assert torch.equal(torch.cat(labels), torch.from_numpy(full.labels))
    assert all(mb.num_tokens <= 64 for mb in batch.micro_batches)


def test_over_budget_error_names_the_sample_and_the_policies(texts):
    mix = write_mixture(texts, """
        sources:
          - {name: long, path: long, weight: 1}
        """)
    with pytest.raises(DataError, match=r"sample long/l\d needs \d+ tokens .* data.over_budget \(truncate, split, skip\)"):
        next(loader(mix, batch=4, budget=64))


def test_split_never_cuts_a_media_item_and_max_media(tmp_path, processors, media_bytes):
    png, _ = media_bytes
    samples = [{"__key__": "cut", "txt": "x" * 20 + "<image>" + "y" * 40, "png": png(48, 48)},  # image at 21..56
               {"__key__": "two", "txt": "<image><image>", "0.png": png(8, 8), "1.png": png(8, 8)},
               {"__key__": "ok", "txt": "fine"}]
    write_source(tmp_path / "img", samples)
    mix = write_mixture(tmp_path, """
        sources:
          - {name: img, path: img, weight: 1, over_budget: split, max_media: 1}
        """)
    batch = next(loader(mix, processors, batch=3, budget=48))
    assert units(batch) == ["img/ok"]
    assert batch.problems == {"too_many_media": 1, "split_cuts_media": 3}  # every piece of "cut", counted


def test_chat_template_wraps_the_prompt_only(tmp_path):
    write_source(tmp_path / "qa", [{"__key__": "q", "txt": "2+2?", "response.txt": "4"}])
    mix = write_mixture(tmp_path, """
        sources:
          - {name: qa, path: qa, weight: 1, chat_template: "<user>{prompt}</user>"}
        """)
    (mb,) = next(loader(mix, batch=1)).micro_batches
    text = "<user>2+2?</user>4"
    assert mb.input_ids.tolist() == [TOK.bos_id] + list(text.encode()) + [TOK.eos_id]
    targets = [t for t in mb.labels.tolist() if t != IGNORE_INDEX]
    assert targets == [ord("4"), TOK.eos_id]


def test_media_options_need_a_processor_that_takes_them(tmp_path, processors, media_bytes):
    write_source(tmp_path / "img", [{"__key__": "a", "txt": "<image>", "png": media_bytes[0](8, 8)}])
    mix = write_mixture(tmp_path, """
        sources:
          - {name: img, path: img, weight: 1, image: {max_patches: 4}}
        """)
    with pytest.raises(DataError, match="source img: the image encoder's processor .* takes no options"):
        loader(mix, processors, batch=1)


# ---- workers -----------------------------------------------------------------------------
def _one_tall_image(tmp_path, media_bytes, n, tall):
    """A mixture of one source of ``n`` image samples, each 8 x 8 pixels but sample ``tall``'s,
    40 x 8 (the size the processors below fail on)."""
    png, _ = media_bytes
    write_source(tmp_path / "img", [{"__key__": f"k{i}", "txt": "<image>", "png": png(40 if i == tall else 8, 8)}
                                    for i in range(n)])
    return write_mixture(tmp_path, """
        sources:
          - {name: img, path: img, weight: 1}
        """)


class DiesOn:
    """An image processor whose worker process dies (as on a decoder segfault) on one image size."""

    modality = "image"

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, raw):
        if raw.shape[0] == 40:
            os._exit(3)
        return self.inner(raw)

    def num_tokens_from_meta(self, meta):
        return self.inner.num_tokens_from_meta(meta)


def test_a_dying_worker_is_reported_with_its_sample(tmp_path, processors, media_bytes):
    mix = _one_tall_image(tmp_path, media_bytes, 8, tall=5)
    ld = loader(mix, {"image": DiesOn(processors["image"])}, batch=8, workers=1)
    with pytest.raises(DataError) as info:
        next(ld)
    assert info.value.kind == "worker_died" and "died on sample img/k5 (step 0)" in str(info.value)


class Hangs(DiesOn):
    def __call__(self, raw):
        if raw.shape[0] == 40:
            import time

            time.sleep(60)
        return self.inner(raw)


def test_a_stuck_worker_stops_the_run_naming_its_sample(tmp_path, processors, media_bytes):
    mix = _one_tall_image(tmp_path, media_bytes, 4, tall=2)
    ld = loader(mix, {"image": Hangs(processors["image"])}, batch=4, workers=1, worker_timeout_s=2)
    with pytest.raises(DataError) as info:
        next(ld)
    assert info.value.kind == "worker_timeout" and "is on sample img/k2 (step 0)" in str(info.value)


def test_batches_carry_data_wait_and_balance(demo_dir, processors):
    data = DataConfig(mixture=str(demo_dir / "mixture.yaml"), global_batch_size=8, micro_batch_tokens=1024,
                      num_workers=1)
    ld = build_loader(data, TOK, processors, seed=0, dp_size=2, dp_rank=1, progress=False)
    batches = [next(ld) for _ in range(3)]
    ld.close()
    for b in batches:
        assert b.data_wait_s >= 0
        assert b.plan_stats["balance_max_over_mean"] >= b.plan_stats["balance_lower_bound"] >= 1.0
        assert 0 < b.plan_stats["utilisation"] <= 1


def test_planner_state_is_o_sources_and_plain_json():
    src = {f"s{i}": SourceIndex(f"s{i}", [SampleMeta(f"{j}", "x.tar", j, 10, None, []) for j in range(50)])
           for i in range(5)}
    sizes = []
    for dp in (1, 4, 16):
        p = Planner(src, {n: 1.0 for n in src}, 0, 16, dp)
        for _ in range(7):
            p.advance()
        sizes.append(json.dumps(p.state_dict()))
    assert sizes[0] == sizes[1] == sizes[2]
