"""Sources beyond a folder: globs, brace lists and URLs (fsspec) index and read back every sample."""
import pickle
import sys
import uuid

import pytest

from conftest import png_bytes
from dataloading.errors import DataError
from dataloading.index.shards import write_shards
from dataloading.index.source_index import INDEX_NAME, build_index, load_index
from dataloading.index.sources import ShardSet, resolve_source


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _samples(prefix: str, n: int) -> list[dict]:
    out = []
    for i in range(n):
        s = {"__key__": f"{prefix}{i:03d}", "txt": f"{prefix} text {i}"}
        if i % 2:
            s.update({"txt": "<image>\nwhat?", "png": png_bytes(8, 16, value=i), "response.txt": f"answer {i}"})
        out.append(s)
    return out


def _write(folder, prefix: str, n: int = 5, per_shard: int = 2) -> dict[str, dict]:
    """Shards ``folder/prefix-%06d.tar``; returns {key: fields as bytes}, what reading must give back."""
    samples = _samples(prefix, n)
    write_shards(samples, folder, prefix, samples_per_shard=per_shard)
    return {s["__key__"]: {k: v.encode() if isinstance(v, str) else v for k, v in s.items() if k != "__key__"}
            for s in samples}


def _reads_back(index, expected: dict[str, dict]) -> None:
    assert sorted(m.key for m in index.samples) == sorted(expected)
    reader = pickle.loads(pickle.dumps(index.reader("src")))  # as sent to a worker process
    for key, fields in expected.items():
        assert reader.get(key) == fields
    reader.close()


def test_folder_source_keeps_its_index_location(tmp_path):
    expected = _write(tmp_path / "src", "a") | _write(tmp_path / "src" / "sub", "b")
    source = resolve_source("src", relative_to=tmp_path)
    assert isinstance(source, ShardSet) and source.index_path == tmp_path / "src" / INDEX_NAME
    assert source.shards == ("a-000000.tar", "a-000001.tar", "a-000002.tar", "sub/b-000000.tar",
                             "sub/b-000001.tar", "sub/b-000002.tar")
    build_index(tmp_path / "src", workers=1, progress=False)  # the old call still works
    assert (tmp_path / "src" / INDEX_NAME).exists()
    _reads_back(load_index(source), expected)
    _reads_back(load_index(tmp_path / "src"), expected)


def test_glob_source(tmp_path):
    expected = _write(tmp_path / "data" / "x", "train")
    _write(tmp_path / "data" / "x", "val")  # not matched
    source = resolve_source("data/x/train-*.tar", relative_to=tmp_path)
    assert source.base == str(tmp_path / "data" / "x") and source.pattern == "train-*.tar"
    assert source.shards == ("train-000000.tar", "train-000001.tar", "train-000002.tar")
    assert source.index_path.parent == tmp_path / "data" / "x"
    assert source.index_path.name.startswith("omni_index.") and source.index_path.name != INDEX_NAME
    build_index(source, workers=2, progress=False)  # the process pool gets the source too
    _reads_back(load_index(str(tmp_path / "data/x/train-*.tar")), expected)


def test_recursive_glob_source(tmp_path):
    expected = _write(tmp_path / "data", "train") | _write(tmp_path / "data" / "p" / "q", "train-deep")
    _write(tmp_path / "data" / "p", "val")
    source = resolve_source(str(tmp_path / "data/**/train-*.tar"))
    assert source.base == str(tmp_path / "data")
    assert "p/q/train-deep-000000.tar" in source.shards and "train-000000.tar" in source.shards
    assert not any("val" in s for s in source.shards) and len(source.shards) == 6
    build_index(source, workers=1, progress=False)
    _reads_back(load_index(source), expected)


@pytest.mark.parametrize("spec", ["x/s-{000000..000002}.tar", "x/s-{000000,000001,000002}.tar"])
def test_brace_list_source(tmp_path, spec):
    expected = _write(tmp_path / "x", "s", n=6)
    _write(tmp_path / "x", "other")
    source = resolve_source(spec, relative_to=tmp_path)
    assert source.shards == ("s-000000.tar", "s-000001.tar", "s-000002.tar")
    assert source.index_path.parent == tmp_path / "x"
    build_index(source, workers=1, progress=False)
    _reads_back(load_index(source), expected)


def test_brace_list_names_the_first_missing_shard(tmp_path):
    _write(tmp_path / "x", "s")  # s-000000 .. s-000002
    with pytest.raises(DataError, match=r"x/s-\{000000\.\.000004\}\.tar: shard .*/x/s-000003\.tar does not exist "
                                        r"\(2 of 5 listed shards are missing\)") as info:
        resolve_source("x/s-{000000..000004}.tar", relative_to=tmp_path)
    assert info.value.kind == "config"


def test_glob_matching_nothing_is_a_config_error(tmp_path):
    _write(tmp_path / "x", "s")
    with pytest.raises(DataError, match=r"x/nope-\*\.tar: matched no \.tar shards under .*x; check the pattern") as info:
        resolve_source("x/nope-*.tar", relative_to=tmp_path)
    assert info.value.kind == "config" and "\n" not in str(info.value)
    with pytest.raises(DataError, match=r"data folder .*absent: no such directory"):
        resolve_source(tmp_path / "absent")


def test_stale_glob_index(tmp_path):
    _write(tmp_path / "x", "s")
    spec = str(tmp_path / "x" / "s-*.tar")
    build_index(spec, workers=1, progress=False)
    _write(tmp_path / "x", "t")  # not matched: the index stays fresh
    assert len(load_index(spec)) == 5
    write_shards(_samples("new", 1), tmp_path / "x", "s-new", samples_per_shard=1)
    with pytest.raises(DataError, match=r"stale \(shard s-new-000000\.tar is new\).*omni data index '.*/x/s-\*\.tar'"):
        load_index(spec)
    assert len(load_index(spec, build_if_missing=True, progress=False)) == 6


def test_file_url_source_is_cached(tmp_path, cache):
    expected = _write(tmp_path / "x", "s")
    spec = f"file://{tmp_path}/x/s-*.tar"
    source = resolve_source(spec)
    assert source.remote and source.shards == ("s-000000.tar", "s-000001.tar", "s-000002.tar")
    assert source.index_path.is_relative_to(cache / "index") and source.index_path.name == INDEX_NAME
    build_index(spec, workers=1, progress=False)
    assert len(list((cache / "shards").glob("*.tar"))) == 3  # downloaded once, while indexing
    _reads_back(load_index(spec), expected)


def test_memory_url_source(tmp_path, cache):
    fsspec = pytest.importorskip("fsspec")
    expected = _write(tmp_path / "x", "s")
    fs, root = fsspec.filesystem("memory"), f"/omni-test-{uuid.uuid4().hex[:8]}"
    try:
        for p in sorted((tmp_path / "x").glob("*.tar")):
            fs.pipe(f"{root}/x/{p.name}", p.read_bytes())
        spec = f"memory://{root}/x/s-{{000000..000002}}.tar"
        build_index(spec, workers=1, progress=False)
        index = load_index(spec)
        assert index.source.sizes == tuple(fs.size(f"{root}/x/{s}") for s in index.source.shards)
        # A cached copy of the wrong size (an older version of the shard) is fetched again.
        cached = index.source.open_path("s-000001.tar")
        cached.write_bytes(b"old")
        _reads_back(index, expected)
        assert cached.stat().st_size == fs.size(f"{root}/x/s-000001.tar")
        fs.pipe(f"{root}/x/s-000002.tar", (tmp_path / "x" / "s-000000.tar").read_bytes() + bytes(512))
        with pytest.raises(DataError, match=r"stale \(shard s-000002\.tar changed size\)"):
            load_index(spec)
        with pytest.raises(DataError, match=r"shard memory://.*/x/s-000003\.tar does not exist"):
            resolve_source(f"memory://{root}/x/s-{{000000..000003}}.tar")
    finally:
        fs.rm(root, recursive=True)


def test_url_without_fsspec_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now fails
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(DataError, match=r"s3://b/x/\*\.tar: s3:// URLs need fsspec; pip install fsspec s3fs"):
        resolve_source("s3://b/x/*.tar")


def test_cli_indexes_a_glob(tmp_path, capsys):
    from recipes.cli import main

    _write(tmp_path / "x", "s")
    assert main(["data", "index", str(tmp_path / "x" / "s-{000000..000001}.tar"), "--workers", "1"]) == 0
    assert "4 samples in 2 shards indexed in" in capsys.readouterr().out
