import json
import logging
import tarfile

import pytest

from dataloading.errors import DataError
from dataloading.index.shards import Shard, list_shards, write_shards
from dataloading.index.source_index import INDEX_NAME, build_index, load_index


@pytest.fixture
def folder(tmp_path, media_bytes):
    png, wav = media_bytes
    samples = []
    for i in range(10):
        s = {"__key__": f"k{i:03d}", "txt": f"text {i}"}
        if i % 3 == 1:
            s.update({"txt": "<image>\nwhat?", "png": png(16 + 8 * (i % 2), 24), "response.txt": "an image"})
        elif i % 3 == 2:
            s.update({"txt": "<audio> then <image>", "0.wav": wav(480 + i), "1.png": png(8, 16)})
        samples.append(s)
    write_shards(samples, tmp_path / "src", "part", samples_per_shard=4)
    return tmp_path / "src"


def test_write_and_index(folder):
    assert [p.name for p in list_shards(folder)] == ["part-000000.tar", "part-000001.tar", "part-000002.tar"]
    index = build_index(folder, workers=1, progress=False)
    assert len(index) == 10 and index.problems == {}
    by_key = {m.key: m for m in index.samples}
    assert by_key["k001"].media == [("image", {"height": 24, "width": 24})]
    assert by_key["k001"].text_bytes == len("<image>\nwhat?") and by_key["k001"].response_bytes == 8
    assert by_key["k000"].response_bytes is None and by_key["k000"].media == []
    assert by_key["k002"].media == [("audio", {"num_samples": 482, "sample_rate": 16000}),
                                    ("image", {"height": 8, "width": 16})]
    assert by_key["k005"].shard == "part-000001.tar" and by_key["k005"].pos == 1
    # written beside the shards and loaded back identically
    assert (folder / INDEX_NAME).exists()
    assert [vars_(m) for m in load_index(folder).samples] == [vars_(m) for m in index.samples]


def vars_(m):
    return (m.key, m.shard, m.pos, m.text_bytes, m.response_bytes, m.media)


def test_pool_index_equals_serial(folder):
    serial = [vars_(m) for m in build_index(folder, workers=1, progress=False).samples]
    pooled = [vars_(m) for m in build_index(folder, workers=2, progress=False).samples]
    assert pooled == serial


def test_random_access_by_key(folder):
    reader = build_index(folder, workers=1, progress=False).reader("src")
    fields = reader.get("k005")
    assert fields["txt"] == b"<audio> then <image>" and set(fields) == {"txt", "0.wav", "1.png"}
    assert reader.get("k009")["txt"] == b"text 9"
    with pytest.raises(DataError, match=r"sample src/nope: not in the index.*omni data index"):
        reader.get("nope")
    # a wrong position hint (stale index) falls back to the key
    shard = Shard(folder / "part-000001.tar")
    assert shard.get("k006", position=0)["txt"] == b"text 6"
    shard.close()


@pytest.mark.parametrize("cut", ["mid_block", "in_file", "between_files"])
def test_truncated_shard_is_reported_by_name(folder, caplog, cut):
    bad = folder / "part-000001.tar"
    with tarfile.open(bad) as tar:
        third = tar.getmembers()[2].offset
    at = {"mid_block": 1500, "in_file": third - 512, "between_files": third}[cut]
    bad.write_bytes(bad.read_bytes()[:at])
    with caplog.at_level(logging.WARNING, logger="omni.data"):
        index = build_index(folder, workers=1, progress=False)
    assert index.problems == {"corrupt_shard": 1}
    assert list(index.bad_shards) == ["part-000001.tar"]
    assert "part-000001.tar: truncated" in index.bad_shards["part-000001.tar"]
    assert len(index) == 6 and all(m.shard != "part-000001.tar" for m in index.samples)
    assert "part-000001.tar: truncated" in caplog.text
    with pytest.raises(DataError, match=r"shard .*part-000001\.tar: truncated.*omni data index") as info:
        build_index(folder, workers=1, progress=False, on_error="stop")
    assert "\n" not in str(info.value)


def test_garbage_shard_is_reported(folder):
    (folder / "junk.tar").write_bytes(b"this is not a tar file at all" * 3)
    with pytest.raises(DataError, match=r"shard .*junk\.tar"):
        build_index(folder, workers=1, progress=False, on_error="stop")


def test_bad_samples_and_duplicate_keys_are_counted(folder, tmp_path):
    write_shards([{"__key__": "k000", "txt": "dup"}, {"__key__": "x1", "txt": "<image> but no image"}],
                 folder, "zz", samples_per_shard=10)
    index = build_index(folder, workers=1, progress=False)
    assert index.problems == {"duplicate_key": 1, "placeholder_mismatch": 1}
    assert len(index) == 10
    assert "x1 (shard zz-000000.tar)" in index.header["examples"]["placeholder_mismatch"]


def test_missing_and_stale_index(folder):
    with pytest.raises(DataError, match=rf"no index .*`omni data index {folder}`"):
        load_index(folder)
    assert len(load_index(folder, build_if_missing=True, progress=False)) == 10
    write_shards([{"__key__": "new", "txt": "hi"}], folder, "more", samples_per_shard=10)
    with pytest.raises(DataError, match=r"stale \(shard more-000000.tar is new\).*omni data index"):
        load_index(folder)
    header = json.loads((folder / INDEX_NAME).read_text().splitlines()[0])
    assert header["num_samples"] == 10


def test_summary_names_bad_shards(folder):
    (folder / "junk.tar").write_bytes(b"x" * 1024)
    summary = build_index(folder, workers=1, progress=False).summary()
    assert summary.startswith(f"10 samples in 4 shards indexed in {folder / INDEX_NAME}")
    assert "left out {'corrupt_shard': 1}, bad shards: junk.tar" in summary


def test_key_locator_is_a_compact_mapping():
    import pickle

    from dataloading.index.source_index import KeyLocator

    keys = ["b", "a", "ä/x", "c10", "c2"]
    loc = KeyLocator(keys, ["s1.tar", "s0.tar", "s1.tar", "s2.tar", "s2.tar"], [0, 5, 1, 2, 3])
    assert loc["a"] == ("s0.tar", 5) and loc["ä/x"] == ("s1.tar", 1) and loc["c2"] == ("s2.tar", 3)
    assert "c10" in loc and "c1" not in loc and len(loc) == 5 and sorted(loc) == sorted(keys)
    with pytest.raises(KeyError):
        loc["zz"]
    assert pickle.loads(pickle.dumps(loc))["b"] == ("s1.tar", 0)


def test_one_shard_cap_across_sources_and_reads_stay_correct(tmp_path):
    from dataloading.index.shards import ShardPool, SourceReader

    readers, expected = [], {}
    for s in range(3):
        folder = tmp_path / f"src{s}"
        samples = [{"__key__": f"k{i:03d}", "txt": f"source {s} sample {i}"} for i in range(40)]
        write_shards(samples, folder, "p", samples_per_shard=5)  # 8 shards per source
        locate = {f"k{i:03d}": (f"p-{i // 5:06d}.tar", i % 5) for i in range(40)}
        readers.append(SourceReader(f"src{s}", folder, locate))
        expected.update({(s, f"k{i:03d}"): f"source {s} sample {i}".encode() for i in range(40)})
    pool = ShardPool(max_open=4)
    for r in readers:
        r.pool = pool
    for (s, key), text in sorted(expected.items(), key=lambda kv: (kv[0][1], kv[0][0])):  # hop across shards
        assert readers[s].get(key)["txt"] == text
        assert len(pool) <= 4
    assert all(len(r._own) == 0 for r in readers)  # the shared pool, not the readers, held the shards
    pool.close()
    with pytest.raises(DataError, match="max_open_shards=0 must be >= 1"):
        ShardPool(0)
