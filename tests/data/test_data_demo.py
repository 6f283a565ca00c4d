import hashlib
import tarfile

import numpy as np
import pytest

from dataloading import demo
from dataloading.formats.media_codecs import decode_audio, decode_image
from dataloading.index.shards import list_shards
from dataloading.index.source_index import load_index
from dataloading.plan.mixture import load_mixture


def digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_demo_is_deterministic(tmp_path):
    a = demo.write_demo_dataset(tmp_path / "a", seed=3, scale=0.01, progress=False)
    b = demo.write_demo_dataset(tmp_path / "b", seed=3, scale=0.01, progress=False)
    c = demo.write_demo_dataset(tmp_path / "c", seed=4, scale=0.01, progress=False)
    da, db, dc = digest(a), digest(b), digest(c)
    assert da == db
    assert set(da) == set(dc) and da != dc
    assert sum(1 for k in da if k.endswith(".tar")) >= 3 * demo.SHARDS_PER_SOURCE + 2


def test_demo_mixture_and_index_match_the_shards(demo_dir):
    mix = load_mixture(demo_dir / "mixture.yaml")
    assert mix.weights == demo.WEIGHTS and mix.eval == (demo_dir / "eval").resolve()
    for spec in mix.sources:
        shards = list_shards(spec.path)
        assert len(shards) == demo.SHARDS_PER_SOURCE
        keys = set()
        for shard in shards:
            with tarfile.open(shard) as tar:
                keys |= {m.name.split(".", 1)[0] for m in tar.getmembers()}
        index = load_index(spec.path)
        assert len(index) == len(keys) == round(demo.SIZES[spec.name] * 0.04)
        assert {m.key for m in index.samples} == keys and index.problems == {}
    assert len(load_index(demo_dir / "eval")) == sum(demo.EVAL_SIZES.values())


def test_shapes_are_learnable(demo_dir):
    index = load_index(demo_dir / "shapes")
    reader = index.reader("shapes")
    sizes, two = set(), 0
    for meta in index.samples[:40]:
        fields = reader.get(meta.key)
        if "png" not in fields:
            two += 1
            assert "0.png" in fields and "1.png" in fields and ", then " in fields["response.txt"].decode()
            continue
        caption = fields["response.txt"].decode()
        assert fields["txt"].decode().count("<image>") == 1
        _, pattern, color, _, _, _, vert, horiz = caption.split()
        img = decode_image(fields["png"]).astype(float)
        h, w, _ = img.shape
        sizes.add((h, w))
        assert h % 8 == 0 and w % 8 == 0 and 32 <= min(h, w) and max(h, w) <= 64
        quad = img[(h // 2 if vert == "bottom" else 0):][:h // 2, (w // 2 if horiz == "right" else 0):][:, :w // 2]
        bright = quad[quad.sum(-1) > 200]  # the shape's pixels (background is dark)
        assert len(bright) > 0.1 * quad.shape[0] * quad.shape[1], caption
        target = np.array(demo.COLORS[color], float)
        assert np.abs(bright.mean(0) - target).max() < 40, (caption, bright.mean(0))
        # The fill pattern is what the caption says: plain fills the square's box; striped rows
        # are all on or all off; checked alternates along rows too.
        on = quad.sum(-1) > 200
        ys, xs = np.nonzero(on)
        box = on[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
        uniform_rows = np.mean([row.all() or not row.any() for row in box])
        if pattern == "plain":
            assert box.mean() > 0.95, caption
        else:
            assert 0.3 < box.mean() < 0.7, caption
            assert (uniform_rows > 0.9) if pattern == "striped" else (uniform_rows < 0.1), caption
    assert any(h != w for h, w in sizes) and len(sizes) > 3


def test_tones_are_learnable(demo_dir):
    index = load_index(demo_dir / "tones")
    reader = index.reader("tones")
    for meta in index.samples[:20]:
        fields = reader.get(meta.key)
        _, pitch, length, _ = fields["response.txt"].decode().split()
        wave, rate = decode_audio(fields["wav"])
        assert rate == demo.SAMPLE_RATE and meta.media[0][1]["num_samples"] == len(wave)
        assert abs(len(wave) / rate - demo.LENGTHS[length]) < 0.11 * demo.LENGTHS[length]
        peak = np.argmax(np.abs(np.fft.rfft(wave))) * rate / len(wave)
        assert abs(peak - demo.PITCHES[pitch]) < 0.05 * demo.PITCHES[pitch]


def test_text_is_long_tailed_and_fits(demo_dir):
    lengths = np.array([m.text_bytes for m in load_index(demo_dir / "text").samples])
    assert lengths.max() <= demo.MAX_TEXT_CHARS
    assert lengths.max() > 3 * np.median(lengths)


def test_eval_classes_are_seen_in_training(demo_dir):
    eval_index = load_index(demo_dir / "eval")
    reader = eval_index.reader("eval")
    words = lambda r: set(r.replace(",", "").split())  # noqa: E731
    eval_words = set().union(*(words(reader.get(m.key)["response.txt"].decode()) for m in eval_index.samples))
    train_words = set()
    for src in ("shapes", "tones"):
        ix = load_index(demo_dir / src)
        rd = ix.reader(src)
        train_words |= set().union(*(words(rd.get(m.key)["response.txt"].decode()) for m in ix.samples))
    assert eval_words <= train_words and {"striped", "checked", "high", "short"} <= eval_words


def test_ensure_demo_dataset_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE", str(tmp_path / "cache"))
    root = demo.ensure_demo_dataset(scale=0.01, progress=False)
    assert root.parent == tmp_path / "cache" and (root / "mixture.yaml").exists() and (root / ".complete").exists()
    assert [p.name for p in root.parent.iterdir()] == [root.name]  # no temp folder left behind

    def boom(*a, **k):
        raise AssertionError("regenerated")

    monkeypatch.setattr(demo, "write_demo_dataset", boom)
    assert demo.ensure_demo_dataset(scale=0.01, progress=False) == root
    with pytest.raises(AssertionError, match="regenerated"):
        demo.ensure_demo_dataset(tmp_path / "other" / "demo", scale=0.01, progress=False)
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())
