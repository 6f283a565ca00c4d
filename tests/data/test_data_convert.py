"""`omni data convert`: LLaVA, ShareGPT, JSONL, parquet and `datasets` inputs -> Omni shards
(messages.json + numbered media + json) read back by the training reader, the index, the report
of the records that could not be converted (exactly the planted ones), the dry run, the one-line
errors, and a short training run on the converted folder."""
from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dataloading.formats.sample import parse_fields
from dataloading.index.shards import Shard
from recipes.cli import main

SHARD_SIZE = 8


def _image(path: Path, w: int, h: int, seed: int) -> bytes:
    """A small image of its own pixels (so every item's bytes differ), saved in the path's format."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path.read_bytes()


def _wav(path: Path, n: int) -> bytes:
    import soundfile

    soundfile.write(path, np.linspace(-0.5, 0.5, n), 16000, format="WAV", subtype="PCM_16")
    return path.read_bytes()


def _human(v: str) -> dict:
    return {"from": "human", "value": v}


def _gpt(v: str) -> dict:
    return {"from": "gpt", "value": v}


# ---- the LLaVA dataset with 5 planted bad records --------------------------------------------------
BAD = {"bad-missing": "missing_media", "bad-corrupt": "unreadable_media", "bad-mismatch": "placeholder_mismatch",
       "bad-noanswer": "no_assistant_turn", "bad-malformed": "bad_record"}
BAD_AT = (3, 8, 12, 17, 24)  # their positions among the 25 records


def _llava_dataset(root: Path) -> tuple[Path, Path, dict]:
    """(the JSON file, the media root, id -> (expected messages, expected media (ext, bytes)))."""
    media = root / "media"
    good, expected = [], {}
    for i in range(20):
        rid, kind = f"good-{i:02d}", i % 5
        a = f"coco/{i:03d}.jpg" if i % 2 else f"vg/{i:03d}.png"
        _image(media / a, 32 + 8 * (i % 3), 24 + 8 * (i % 4), seed=i)
        if kind == 0:  # one question about one image
            conv, items = [_human("<image>\nDescribe the image."), _gpt(f"picture {i}")], [a]
            msgs = [{"role": "user", "content": "<image>\nDescribe the image."},
                    {"role": "assistant", "content": f"picture {i}"}]
        elif kind == 1:  # multi-turn, the image in the middle of the first question
            conv = [_human("Look: <image> what colour?"), _gpt("mixed"), _human("And the size?"), _gpt("small"),
                    _human("Thanks"), _gpt(f"welcome {i}")]
            msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in conv]
            items = [a]
        elif kind == 2:  # two images, one per turn
            b = f"coco/{i:03d}-b.png"
            _image(media / b, 40, 16, seed=100 + i)
            conv = [_human("First <image>"), _gpt("one"), _human("then <image>"), _gpt(f"two {i}")]
            msgs = [{"role": "user", "content": "First <image>"}, {"role": "assistant", "content": "one"},
                    {"role": "user", "content": "then <image>"}, {"role": "assistant", "content": f"two {i}"}]
            items = [a, b]
        elif kind == 3:  # an image but no <image>: LLaVA puts it before the first question
            conv = [{"from": "system", "value": "Be brief."}, _human("What is it?"), _gpt(f"noise {i}")]
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>\nWhat is it?"},
                    {"role": "assistant", "content": f"noise {i}"}]
            items = [a]
        else:  # text only, multi-turn
            conv = [_human("Count to three."), _gpt("1 2 3"), _human("Now to two."), _gpt(f"1 2 ({i})")]
            msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in conv]
            items = []
        rec = {"id": rid, "conversations": conv, "source": "test"}
        if items:
            rec["image"] = items[0] if len(items) == 1 else items
        good.append(rec)
        expected[rid] = (msgs, [(Path(p).suffix[1:], (media / p).read_bytes()) for p in items])
    (media / "coco/corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 8)
    _image(media / "coco/one.png", 16, 16, seed=999)
    bad = [
        {"id": "bad-missing", "image": "coco/nowhere.jpg", "conversations": [_human("<image>\nWhat?"), _gpt("?")]},
        {"id": "bad-corrupt", "image": "coco/corrupt.png", "conversations": [_human("<image>\nWhat?"), _gpt("?")]},
        {"id": "bad-mismatch", "image": "coco/one.png", "conversations": [_human("<image> vs <image>"), _gpt("?")]},
        {"id": "bad-noanswer", "image": "coco/one.png", "conversations": [_human("<image>\nWhat?")]},
        {"id": "bad-malformed", "conversations": [{"from": "robot", "value": "beep"}, _gpt("?")]},
    ]
    records = list(good)
    for pos, rec in zip(BAD_AT, bad):
        records.insert(pos, rec)
    path = root / "llava.json"
    path.write_text(json.dumps(records, indent=1))
    return path, media, expected


def _omni(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _read_back(out: Path) -> dict:
    """id -> (messages, [(ext, bytes)], key, meta) through the training reader (parse_fields)."""
    got = {}
    for path in sorted(out.glob("shard-*.tar")):
        shard = Shard(path)
        try:
            for key, fields in shard:
                assert "txt" not in fields
                raw = parse_fields(key, fields)
                got[raw.meta["id"]] = (raw.messages, [(n.split(".")[1], d) for _, n, d in raw.media], key, raw.meta)
        finally:
            shard.close()
    return got


def _report(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "convert_report.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """The LLaVA dataset, converted once by the CLI with 2 workers: (json, media root, expected, out, stdout)."""
    root = tmp_path_factory.mktemp("llava")
    path, media, expected = _llava_dataset(root)
    out = root / "out"
    code, stdout, stderr = _omni(["data", "convert", "--from", "llava", str(path), "--media-root", str(media),
                                  "--out", str(out), "--workers", "2", "--shard-size", str(SHARD_SIZE)])
    assert code == 0, stderr
    return path, media, expected, out, stdout


def test_llava_converts_the_good_records_and_lists_exactly_the_planted_bad_ones(llava, tmp_path):
    path, media, expected, out, stdout = llava
    assert "converted 20 of 25 records" in stdout
    assert ("skipped 5: bad_record=1, missing_media=1, no_assistant_turn=1, placeholder_mismatch=1, "
            f"unreadable_media=1; listed in {out / 'convert_report.jsonl'}") in stdout
    report = _report(out)
    assert [r["id"] for r in report] == list(BAD)  # in input order, each once
    for r in report:
        assert r["reason"].startswith(BAD[r["id"]] + ": ") and "\n" not in r["reason"], r
    assert "coco/nowhere.jpg" in report[0]["reason"]

    got = _read_back(out)
    assert sorted(got) == sorted(expected)
    for rid, (messages, items) in expected.items():
        assert got[rid][0] == messages, rid
        assert got[rid][1] == items, rid  # the original files' bytes and types, in placeholder order
        assert got[rid][3] == {"id": rid, "source": "test"}
    # Batch j of SHARD_SIZE input records is shard j; keys are the input positions.
    positions = sorted(int(key) for _, _, key, _ in got.values())
    assert positions == [p for p in range(25) if p not in BAD_AT]
    names = sorted(p.name for p in out.glob("shard-*.tar"))
    # Batch 3 holds position 24 alone, a bad record: no shard, and no gap in what is listed.
    assert math.ceil(25 / SHARD_SIZE) == 4 and names == [f"shard-{j:06d}.tar" for j in range(3)]
    header = json.loads((out / "omni_index.jsonl").read_text().splitlines()[0])
    assert header["num_samples"] == 20 and header["problems"] == {}
    assert "20 samples in 3 shards indexed" in stdout

    # One process writes the same bytes as two.
    again = tmp_path / "again"
    code, _, err = _omni(["data", "convert", "--from", "llava", str(path), "--media-root", str(media), "--out",
                          str(again), "--workers", "1", "--shard-size", str(SHARD_SIZE)])
    assert code == 0, err
    for name in names + ["convert_report.jsonl"]:
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_dry_run_writes_nothing_and_reports_the_same_counts(llava, tmp_path):
    path, media, _, _, stdout = llava
    out = tmp_path / "never"
    code, dry, err = _omni(["data", "convert", "--from", "llava", str(path), "--media-root", str(media), "--out",
                            str(out), "--dry-run", "--workers", "2", "--shard-size", str(SHARD_SIZE)])
    assert code == 0, err
    assert not out.exists()
    assert "would convert 20 of 25 records" in dry and "3 shard(s) would be written" in dry
    assert ("skipped 5: bad_record=1, missing_media=1, no_assistant_turn=1, placeholder_mismatch=1, "
            "unreadable_media=1; would be listed in") in dry
    assert "dry run: nothing was written" in dry


# ---- the other formats -------------------------------------------------------------------------------
def _sharegpt(tmp: Path) -> tuple[list[str], dict]:
    a, b = _image(tmp / "m/a.png", 16, 24, 1), _image(tmp / "m/sub/b.jpg", 24, 16, 2)
    records = [
        {"id": 7, "system": "Be brief.", "images": ["a.png", "sub/b.jpg"],
         "conversations": [_human("<image>What?"), _gpt("A."), _human("And <image>?"), _gpt("B.")]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    (tmp / "chat.json").write_text(json.dumps(records))
    expected = {
        7: ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>What?"},
             {"role": "assistant", "content": "A."}, {"role": "user", "content": "And <image>?"},
             {"role": "assistant", "content": "B."}], [("png", a), ("jpg", b)]),
        "chat-1": ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], []),
    }
    return ["--from", "sharegpt", str(tmp / "chat.json"), "--media-root", str(tmp / "m")], expected


def _jsonl(tmp: Path) -> tuple[list[str], dict]:
    from media_helpers import clip_bytes

    a, w = _image(tmp / "m/a.webp", 16, 16, 3), _wav(tmp / "m/t.wav", 800)
    (tmp / "m/c.mp4").write_bytes(clip_bytes(frames=4, height=16, width=16))
    clip = (tmp / "m/c.mp4").read_bytes()
    lines = [
        {"id": "parts", "images": ["a.webp"], "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "an image"}]}]},
        {"id": "av", "videos": ["c.mp4"], "audios": ["t.wav"], "messages": [
            {"role": "user", "content": "Hear <audio> and watch <video>."}, {"role": "assistant", "content": "ok"}]},
    ]
    (tmp / "data.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    expected = {
        "parts": ([{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "an image"}],
                  [("webp", a)]),
        "av": ([{"role": "user", "content": "Hear <audio> and watch <video>."},
                {"role": "assistant", "content": "ok"}], [("wav", w), ("mp4", clip)]),
    }
    return ["--from", "jsonl", str(tmp / "data.jsonl"), "--media-root", str(tmp / "m")], expected


def _messages(q: str, a: str) -> list[dict]:
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def _parquet(tmp: Path) -> tuple[list[str], dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = _image(tmp / "m/a.png", 16, 16, 4)
    b = _image(tmp / "held.jpg", 8, 16, 5)  # its bytes live in the parquet file
    (tmp / "pq").mkdir()
    # Media as HF stores an Image: {bytes, path}; bytes win, a bare path is read under --media-root.
    pq.write_table(pa.table({"messages": [_messages("<image> one", "1"), _messages("<image> two", "2")],
                             "images": [[{"bytes": None, "path": "a.png"}], [{"bytes": b, "path": "orig/b.jpg"}]]}),
                   tmp / "pq/part-0.parquet")
    pq.write_table(pa.table({"id": ["x"], "messages": [_messages("plain", "3")], "images": [[]]}),
                   tmp / "pq/part-1.parquet")
    expected = {"part-0-0": (_messages("<image> one", "1"), [("png", a)]),
                "part-0-1": (_messages("<image> two", "2"), [("jpg", b)]),
                "x": (_messages("plain", "3"), [])}
    return ["--from", "parquet", str(tmp / "pq"), "--media-root", str(tmp / "m")], expected


def _hf_dataset(tmp: Path) -> tuple[list[str], dict]:
    import datasets

    png = _image(tmp / "x.png", 16, 8, 6)
    features = datasets.Features({"messages": datasets.List({"role": datasets.Value("string"),
                                                             "content": datasets.Value("string")}),
                                  "images": datasets.List(datasets.Image())})
    train = datasets.Dataset.from_dict({"messages": [_messages("<image> what", "an x"), _messages("no image", "ok")],
                                        "images": [[{"bytes": png, "path": None}], []]}, features=features)
    held = datasets.Dataset.from_dict({"messages": [_messages("held out", "no")], "images": [[]]}, features=features)
    datasets.DatasetDict({"train": train, "validation": held}).save_to_disk(str(tmp / "ds"))
    expected = {"ds-0": (_messages("<image> what", "an x"), [("png", png)]), "ds-1": (_messages("no image", "ok"), [])}
    return ["--from", "hf-dataset", str(tmp / "ds")], expected


@pytest.mark.parametrize("make", [_sharegpt, _jsonl, _parquet, _hf_dataset],
                         ids=["sharegpt", "jsonl", "parquet", "hf-dataset"])
def test_every_format_converts(make, tmp_path):
    args, expected = make(tmp_path)
    out = tmp_path / "out"
    code, stdout, err = _omni(["data", "convert", *args, "--out", str(out), "--workers", "1"])
    assert code == 0, err
    assert f"converted {len(expected)} of {len(expected)} records" in stdout and "skipped" not in stdout
    assert _report(out) == []
    got = _read_back(out)
    assert {k: v[:2] for k, v in got.items()} == expected


def test_hf_dataset_split(tmp_path):
    args, _ = _hf_dataset(tmp_path)
    out = tmp_path / "val"
    code, stdout, err = _omni(["data", "convert", *args, "--split", "validation", "--out", str(out), "--workers", "1"])
    assert code == 0, err
    assert {k: v[0] for k, v in _read_back(out).items()} == {"ds-0": _messages("held out", "no")}
    assert "has no split 'test' (it has train, validation)" in _one_line_error(
        ["data", "convert", *args, "--split", "test", "--out", str(tmp_path / "none")])


# ---- problems ------------------------------------------------------------------------------------
def _one_line_error(argv: list[str], after_work: bool = False) -> str:
    """The error line; before any work it is all that is printed, after it the progress bar came first."""
    code, _, err = _omni(argv)
    lines = [line for line in err.splitlines() if line.strip() and not (after_work and line.startswith("convert "))]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("omni: error: "), err
    return lines[0]


def test_input_and_argument_problems_are_one_line_before_any_work(tmp_path, monkeypatch):
    out = tmp_path / "out"
    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps({"messages": _messages("hi", "ho")}) + "\n")
    assert "nope.json is not a file" in _one_line_error(["data", "convert", "--from", "llava",
                                                          str(tmp_path / "nope.json"), "--out", str(out)])
    assert "'tsv' is not a format" in _one_line_error(["data", "convert", "--from", "tsv", str(records),
                                                        "--out", str(out)])
    assert "--split applies to --from hf-dataset only" in _one_line_error(
        ["data", "convert", "--from", "jsonl", str(records), "--out", str(out), "--split", "test"])
    assert "--media-root" in _one_line_error(["data", "convert", "--from", "jsonl", str(records), "--out", str(out),
                                              "--media-root", str(tmp_path / "no-media")])
    assert not out.exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert "is not an empty folder" in _one_line_error(["data", "convert", "--from", "jsonl", str(records),
                                                        "--out", str(busy)])
    assert sorted(p.name for p in busy.iterdir()) == ["keep.txt"]
    (tmp_path / "p.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if the extra were not installed
    assert "pip install 'omni-mm[convert]'" in _one_line_error(
        ["data", "convert", "--from", "parquet", str(tmp_path / "p.parquet"), "--out", str(out)])
    assert not out.exists()


def test_a_media_path_may_not_leave_the_media_root_and_nothing_converted_is_an_error(tmp_path):
    _image(tmp_path / "secret.png", 8, 8, 0)
    (tmp_path / "media").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "media/anim.gif")
    rec = {"id": "climb", "images": ["../secret.png"], "messages": _messages("<image> leak", "no")}
    gif = {"id": "gif", "images": ["anim.gif"], "messages": _messages("<image> moving", "no")}
    (tmp_path / "r.jsonl").write_text(json.dumps(rec) + "\n" + "{not json\n" + json.dumps(gif) + "\n")
    out = tmp_path / "out"
    line = _one_line_error(["data", "convert", "--from", "jsonl", str(tmp_path / "r.jsonl"), "--media-root",
                            str(tmp_path / "media"), "--out", str(out)], after_work=True)
    assert "no record of" in line and "bad_record=2, unsupported_media=1" in line and "convert_report.jsonl" in line
    report = _report(out)
    assert [r["id"] for r in report] == ["climb", "r-1", "gif"]
    assert "leads out of --media-root" in report[0]["reason"] and report[1]["reason"].startswith("bad_record: ")
    assert report[2]["reason"].startswith("unsupported_media: ") and "0.gif" in report[2]["reason"]
    assert not list(out.glob("*.tar"))


# ---- training on the converted folder ------------------------------------------------------------
@pytest.mark.slow
def test_converted_llava_and_sharegpt_folders_train(llava, demo_root, tmp_path):
    """The acceptance path: a multi-turn LLaVA JSON (converted by the fixture) and a ShareGPT file
    convert, index, and train together as two sources of a mixture."""
    from recipe_helpers import step_losses, tiny_overrides, train

    _, _, _, llava_out, _ = llava
    args, _ = _sharegpt(tmp_path)
    sharegpt_out = tmp_path / "sharegpt"
    code, _, err = _omni(["data", "convert", *args, "--out", str(sharegpt_out), "--workers", "1"])
    assert code == 0, err
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: llava, path: {llava_out}, weight: 0.7}}\n"
                   f"  - {{name: sharegpt, path: {sharegpt_out}, weight: 0.3}}\n")
    run = tmp_path / "run"
    train(tiny_overrides(demo_root, run, **{"trainer.max_steps": 2, "data.mixture": mix,
                                            "data.chat_template": "plain"}) + ["encoders=vision_only"])
    losses = step_losses(run)
    assert len(losses) == 2 and all(np.isfinite(losses))
