"""User mistakes end in one clear line (no traceback) that names the culprit and the fix."""
from __future__ import annotations

import shutil
from pathlib import Path

from dataloading.index.shards import write_shards
from recipe_helpers import read_metrics, tiny_overrides
from recipes.cli import main


def _fails(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err
    # Warnings logged before the error may precede it; the error itself is one line, and last.
    errors = [l for l in err.splitlines() if l.startswith("omni: error: ")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    return errors[0]


def test_misspelt_key_names_it_and_suggests(capsys):
    line = _fails(capsys, ["train", "trainer.max_stpes=3"])
    assert "trainer.max_stpes" in line and "trainer.max_steps" in line


def test_bad_value_type(capsys):
    line = _fails(capsys, ["train", "trainer.max_steps=many"])
    assert "trainer.max_steps" in line and "many" in line


def test_unknown_preset_lists_options(capsys):
    line = _fails(capsys, ["train", "experiment=nope"])
    assert "experiment/nope" in line and "demo_moe" in line


def test_missing_mixture_file(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "mix.yaml"
    line = _fails(capsys, ["train", f"data.mixture={missing}", f"trainer.run_dir={tmp_path / 'r'}"])
    assert str(missing) in line


def test_missing_data_folder(capsys, tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: caps, path: {tmp_path / 'no_such_dir'}, weight: 1}}\n")
    line = _fails(capsys, ["train", f"data.mixture={mix}", f"trainer.run_dir={tmp_path / 'r'}"])
    assert "no_such_dir" in line and "mix.yaml" in line


def test_unknown_encoder_lists_registered(capsys, demo_root, tmp_path):
    line = _fails(capsys, ["train", "encoders.vision.name=nope",
                           *tiny_overrides(demo_root, tmp_path / "r")])
    assert "'nope'" in line and "siglip" in line and "whisper" in line and "encoders.vision" in line


def test_unknown_encoder_param(capsys, demo_root, tmp_path):
    line = _fails(capsys, ["train", "+encoders.vision.params.hidden=8",
                           *tiny_overrides(demo_root, tmp_path / "r")])
    assert "'hidden'" in line and "hidden_size" in line


def test_index_command_missing_folder(capsys, tmp_path):
    line = _fails(capsys, ["data", "index", str(tmp_path / "absent")])
    assert "absent" in line


def _copy_source(demo_root: Path, name: str, dest: Path) -> Path:
    shutil.copytree(demo_root / name, dest / name)
    return dest / name


def test_truncated_shard_is_named(capsys, demo_root, tmp_path):
    src = _copy_source(demo_root, "shapes", tmp_path)
    shard = sorted(src.glob("*.tar"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2 + 100])
    # The old index no longer matches the shard: training says which command fixes it.
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: shapes, path: {src}, weight: 1}}\n")
    line = _fails(capsys, ["train", f"data.mixture={mix}", f"trainer.run_dir={tmp_path / 'r'}"])
    assert "omni data index" in line
    # Re-indexing reports the truncated shard by name and keeps the good samples.
    assert main(["data", "index", str(src)]) == 0
    out = capsys.readouterr()
    assert shard.name in out.out + out.err


def _mismatch_source(folder: Path, demo_root: Path) -> Path:
    """A source where one sample has two <image> placeholders but only one image."""
    png = next((demo_root / "shapes").glob("*.tar"))
    import tarfile

    with tarfile.open(png) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith(".png"))
        image = tf.extractfile(member).read()
    samples = [{"__key__": f"ok-{i:03d}", "txt": "<image>\nDescribe.", "response.txt": "fine", "png": image}
               for i in range(7)]
    samples.insert(3, {"__key__": "bad-000", "txt": "<image> and <image>", "response.txt": "x", "png": image})
    write_shards(samples, folder, "part", samples_per_shard=4)
    assert main(["data", "index", str(folder)]) == 0
    return folder


def test_placeholder_mismatch_stop_names_sample(capsys, demo_root, tmp_path):
    src = _mismatch_source(tmp_path / "mm", demo_root)
    capsys.readouterr()
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: mm, path: {src}, weight: 1}}\n")
    line = _fails(capsys, ["train", *tiny_overrides(demo_root, tmp_path / "r"), f"data.mixture={mix}",
                           "data.on_error=stop", "data.global_batch_size=8", "trainer.max_steps=1"])
    assert "source mm" in line and "bad-000" in line and "placeholder" in line.lower()


def test_placeholder_mismatch_skip_is_counted(capsys, demo_root, tmp_path):
    src = _mismatch_source(tmp_path / "mm", demo_root)
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: mm, path: {src}, weight: 1}}\n")
    run_dir = tmp_path / "r"
    rc = main(["train", *tiny_overrides(demo_root, run_dir), f"data.mixture={mix}", "data.on_error=skip",
               "data.max_skip_fraction=0.5", "data.global_batch_size=8", "trainer.max_steps=1"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rec = read_metrics(run_dir)[0]
    assert sum(rec["data_problems"].values()) == 1
    # the run ends saying so (not only in metrics.jsonl): how many, of which kinds, where
    assert out.out.splitlines()[-1] == (
        f"omni: 1 bad sample(s) skipped (data.on_error=skip): index_placeholder_mismatch=1; counts by step in "
        f"{run_dir / 'metrics.jsonl'} (data_problems), examples of the index_ kinds in each source's "
        "omni_index.jsonl header"), out.out


def test_a_sample_skipped_while_training_is_summed_up_at_the_end(capsys, caplog, demo_root, tmp_path):
    """A PNG whose header reads (so the index keeps it) but whose pixels do not: the loader skips
    it mid-run, and the run's last line says so."""
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, "PNG")
    good = buf.getvalue()
    samples = [{"__key__": f"ok-{i:03d}", "txt": "<image>\nDescribe.", "response.txt": "fine", "png": good}
               for i in range(7)]
    samples.insert(2, {"__key__": "torn-000", "txt": "<image>\nDescribe.", "response.txt": "x", "png": good[:100]})
    write_shards(samples, tmp_path / "torn", "part", samples_per_shard=4)
    assert main(["data", "index", str(tmp_path / "torn")]) == 0
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: torn, path: {tmp_path / 'torn'}, weight: 1}}\n")
    run_dir = tmp_path / "r"
    capsys.readouterr()
    rc = main(["train", *tiny_overrides(demo_root, run_dir), f"data.mixture={mix}", "data.on_error=skip",
               "data.max_skip_fraction=0.5", "data.global_batch_size=8", "trainer.max_steps=1"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    kinds = read_metrics(run_dir)[0]["data_problems"]
    assert list(kinds.values()) == [1], kinds
    kind = next(iter(kinds))
    assert out.out.splitlines()[-1] == (
        f"omni: 1 bad sample(s) skipped (data.on_error=skip): {kind}=1; counts by step in "
        f"{run_dir / 'metrics.jsonl'} (data_problems), the first few of each kind logged above"), out.out
    assert "torn-000" in caplog.text  # the first few of each kind, logged


def test_the_skipped_summary_sums_ranks_and_counts_the_index_once(tmp_path):
    from dataloading.serve.loader import skipped_summary

    assert skipped_summary([{}, {"corrupt_media": 0}], tmp_path / "m.jsonl") is None
    line = skipped_summary([{"corrupt_media": 2, "index_corrupt_shard": 3}, {"corrupt_media": 1,
                                                                                "index_corrupt_shard": 3}],
                           tmp_path / "m.jsonl")
    assert line.startswith("omni: 6 bad sample(s) skipped (data.on_error=skip): corrupt_media=3, "
                           "index_corrupt_shard=3; ")


def test_pretrained_checkpoint_of_unsupported_type(capsys, demo_root, tmp_path):
    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    line = _fails(capsys, ["train", "model=hf", f"model.pretrained={ckpt}", *tiny_overrides(demo_root, tmp_path / "r")])
    assert "model.pretrained" in line and "gpt2" in line


def test_pretrained_checkpoint_missing(capsys, demo_root, tmp_path):
    line = _fails(capsys, ["train", "model=hf", f"model.pretrained={tmp_path / 'nope'}",
                           *tiny_overrides(demo_root, tmp_path / "r")])
    assert "nope" in line


def test_multiplex_mistakes_name_the_key_and_fix(capsys, demo_root, tmp_path):
    base = ["train", *tiny_overrides(demo_root, tmp_path / "r")]
    line = _fails(capsys, base + ["multiplex.placement=everywhere"])
    assert "multiplex.placement='everywhere'" in line and "colocated" in line
    # One process is one encoder rank: no SP block of 3 fits.
    line = _fails(capsys, base + ["multiplex.encoder_sp=3"])
    assert "multiplex.encoder_sp=3" in line and "encoder ranks" in line
    line = _fails(capsys, base + ["multiplex.encoder_weights=fsdp"])
    assert "multiplex.encoder_weights='fsdp'" in line and "replicated, sharded" in line
    line = _fails(capsys, base + ["multiplex.encoder_memory_mib=lots"])
    assert "multiplex.encoder_memory_mib='lots'" in line and "MiB" in line


def test_zero_bubble_schedule_needs_encoder_first():
    import pytest
    import torch

    from omni.step.config import MultiplexConfig
    from omni.multiplex.runtime import Multiplexer
    from parallel.config import ParallelConfig
    from parallel.layout import Layout, LayoutError, Sizes

    layout = Layout(world_size=2, rank=0, device=torch.device("cpu"), sizes=Sizes(pp=2),
                    config=ParallelConfig(pp=2, dp_shard=1, pp_schedule="zero_bubble", pp_virtual_stages=2))
    with pytest.raises(LayoutError, match="multiplex.placement=encoder_first"):
        Multiplexer(None, layout, MultiplexConfig(), cost=None, hidden_size=32)


# ---- every value is checked at composition, before any data or model work -------------------
# (issue 17: `trainer.max_steps=-5` exited 0, `optim.lr=-1`, `optim.betas=[0.9,1.5]` and
# `model.num_heads=3` ended in rank tracebacks, `data.balance=balnced` was caught only after the
# index was read, without a suggestion.)

import pytest  # noqa: E402


@pytest.fixture
def no_work(monkeypatch):
    """Reaching data or model work fails the test with a traceback (not a user error)."""
    import dataloading.demo
    import omni.models.build
    import parallel.layout

    def reached(*_a, **_k):
        raise AssertionError("data or model work started before the config was checked")

    monkeypatch.setattr(dataloading.demo, "ensure_demo_dataset", reached)
    monkeypatch.setattr(omni.models.build, "build_model", reached)
    monkeypatch.setattr(parallel.layout, "init_layout", reached)


BAD_VALUES = [
    ("trainer.max_steps=-5", ["trainer.max_steps=-5", ">= 1"]),
    ("optim.lr=-1", ["optim.lr=-1", "positive", "optim.lr=3e-4"]),
    ("optim.betas=[0.9,1.5]", ["optim.betas=[0.9, 1.5]", "[0, 1)"]),
    ("optim.eps=0", ["optim.eps=0", "> 0"]),
    ("optim.warmup_steps=-1", ["optim.warmup_steps=-1", ">= 0"]),
    ("model.num_heads=3", ["model.num_heads=3", "model.hidden_size=128", "model.num_heads=4"]),
    ("model.num_kv_heads=3", ["model.num_kv_heads=3", "model.num_heads=4", "divisors"]),
    ("data.balance=balnced", ["data.balance='balnced'", "did you mean data.balance=balanced"]),
    ("data.over_budget=trunc", ["data.over_budget='trunc'", "did you mean data.over_budget=truncate"]),
    ("data.on_error=skipp", ["data.on_error='skipp'", "did you mean data.on_error=skip"]),
    ("checkpoint.verify=sized", ["checkpoint.verify='sized'", "did you mean checkpoint.verify=size"]),
    ("data.backend=rey", ["data.backend='rey'", "did you mean data.backend=ray"]),
    ("data.global_batch_size=0", ["data.global_batch_size=0"]),
    ("multiplex.placement=stage_0", ["multiplex.placement='stage_0'", "did you mean multiplex.placement=stage0"]),
    ("multiplex.encoder_weights=shard", ["multiplex.encoder_weights='shard'", "sharded"]),
    ("model.attn_backend=flsh", ["model.attn_backend='flsh'", "did you mean model.attn_backend=flash"]),
    ("model.family=lama", ["model.family='lama'", "did you mean model.family=llama"]),
    ("trainer.precision=bf61", ["trainer.precision='bf61'", "did you mean trainer.precision=bf16"]),
    ("trainer.device=gpu", ["trainer.device='gpu'", "cuda"]),
    ("parallel.cp_impl=ulyses", ["parallel.cp_impl='ulyses'", "did you mean parallel.cp_impl=ulysses"]),
    ("parallel.pp_schedule=1f1", ["parallel.pp_schedule='1f1'", "did you mean parallel.pp_schedule=1f1b"]),
    ("parallel.mixed_precision=bf15", ["parallel.mixed_precision='bf15'", "bf16"]),
    ("parallel.activation_checkpoint=ful", ["parallel.activation_checkpoint='ful'", "full"]),
    ("parallel.reshard_after_forward=maybe", ["parallel.reshard_after_forward='maybe'", "auto, true, false"]),
    ("checkpoint.resume=nevr", ["checkpoint.resume='nevr'", "did you mean checkpoint.resume=never"]),
    ("trainer.loss_spike_window=1", ["trainer.loss_spike_window=1", ">= 2"]),
    ("encoders.vision.projector.activation=gleu", ["encoders.vision.projector.activation='gleu'", "gelu"]),
]


@pytest.mark.parametrize("override,needles", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_value_is_one_line_at_composition(capsys, no_work, override, needles):
    line = _fails(capsys, ["train", override])
    for needle in needles:
        assert needle in line, line


def test_bad_values_are_refused_by_data_plan_and_the_python_api(capsys, no_work):
    from omegaconf import OmegaConf

    from omni.errors import ConfigError
    from recipes.compose import compose_config
    from recipes.train import run

    line = _fails(capsys, ["data", "plan", "data.balance=balnced"])
    assert "did you mean data.balance=balanced" in line
    line = _fails(capsys, ["data", "plan", "--balance", "kkk"])
    assert "--balance='kkk'" in line and "kk" in line
    with pytest.raises(ConfigError, match="optim.lr=-1"):
        compose_config(["optim.lr=-1"])
    # A config built in Python (no Hydra composition) is checked by run() before any work.
    cfg = OmegaConf.to_object(compose_config([]))
    cfg.trainer.max_steps = -5
    with pytest.raises(ConfigError, match="trainer.max_steps=-5"):
        run(cfg)


def test_model_hf_without_a_checkpoint_is_refused(capsys, no_work):
    # It used to train the tiny default model: `pretrained: ???` merged onto None stays None.
    line = _fails(capsys, ["train", "model=hf"])
    assert "model=hf" in line and "model.pretrained=" in line


def test_layout_rules_are_checked_before_start_up(capsys, no_work, monkeypatch):
    # 1 launched rank: tp=2 cannot fit; the heads rule needs the sizes of the launch.
    line = _fails(capsys, ["train", "parallel.tp=2", "parallel.dp_shard=1"])
    assert "parallel.tp" in line or "ranks were launched" in line
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    line = _fails(capsys, ["train", "parallel.tp=3"])
    assert "parallel.tp=3 must divide the attention heads (4)" in line


def test_a_new_key_of_a_free_mapping_asks_for_the_plus(capsys):
    """optim.groups holds the user's own entries: Hydra adds one only with a leading +."""
    line = _fails(capsys, ["train", "optim.groups.llm.lr=1e-4"])
    assert "write +optim.groups.llm.lr=" in line


def test_the_demo_conversations_need_a_chat_template_before_any_work(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE", str(tmp_path / "cache"))
    line = _fails(capsys, ["train", "data.demo_mixture=chat", f"trainer.run_dir={tmp_path / 'r'}"])
    assert "data.demo_mixture='chat'" in line and "data.chat_template=plain" in line
    assert not (tmp_path / "cache").exists()  # nothing generated


# ---- issue 36: a dataset passed as the mixture, media that is not what its option takes ------

def test_a_llava_json_as_the_mixture_points_to_convert(capsys, tmp_path):
    import json

    records = [{"id": "1", "image": "coco/1.jpg",
                "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]}]
    llava = tmp_path / "llava_v1_5_mix665k.json"
    llava.write_text(json.dumps(records, indent=2))
    line = _fails(capsys, ["train", f"data.mixture={llava}", f"trainer.run_dir={tmp_path / 'r'}"])
    assert f"{llava} holds a dataset's records" in line
    assert f"`omni data convert --from llava {llava} --media-root DIR --out OUT`" in line and "data.mixture" in line
    lines = tmp_path / "chat.jsonl"  # JSON lines: the jsonl reader
    lines.write_text("\n".join(json.dumps(r) for r in records * 2) + "\n")
    line = _fails(capsys, ["train", f"data.mixture={lines}", f"trainer.run_dir={tmp_path / 'r'}"])
    assert f"`omni data convert --from jsonl {lines} --media-root DIR --out OUT`" in line
    # a mixture spelt as JSON is still read as one
    src = tmp_path / "nowhere"
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"name": "a", "path": str(src), "weight": 1}]}))
    line = _fails(capsys, ["train", f"data.mixture={mix}", f"trainer.run_dir={tmp_path / 'r'}"])
    assert "nowhere" in line and "records" not in line
    # a YAML list of sources without its key
    bare = tmp_path / "bare.yaml"
    bare.write_text(f"- {{name: a, path: {src}, weight: 1}}\n")
    line = _fails(capsys, ["train", f"data.mixture={bare}", f"trainer.run_dir={tmp_path / 'r'}"])
    assert "expected a mapping with a 'sources' list (sources: [{name, path, weight}, ...])" in line


def _generate_fails(capsys, tmp_path, option: str, path) -> str:
    (tmp_path / "m").mkdir(exist_ok=True)  # never read: the media fail first
    return _fails(capsys, ["generate", "--model", str(tmp_path / "m"), option, str(path), "--prompt", "hi"])


def test_generate_media_of_the_wrong_kind_is_one_line(capsys, tmp_path):
    import numpy as np
    import soundfile
    from PIL import Image

    picture = tmp_path / "picture.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(picture)
    wav = tmp_path / "tone.wav"
    soundfile.write(wav, np.zeros(1600, np.float32), 16000)
    line = _generate_fails(capsys, tmp_path, "--audio", picture)
    assert line.startswith(f"omni: error: --audio {picture}: cannot be read as an audio file (WAV, FLAC) (")
    assert line.endswith("it looks like an image (PNG, JPEG, WebP): pass it with --image")
    assert "BytesIO" not in line  # libsndfile's name for its buffer: the file is named already
    line = _generate_fails(capsys, tmp_path, "--image", wav)
    assert line.startswith(f"omni: error: --image {wav}: cannot be read as an image (PNG, JPEG, WebP) (")
    assert line.endswith("it looks like an audio file (WAV, FLAC): pass it with --audio")
    line = _generate_fails(capsys, tmp_path, "--image", tmp_path / "absent.png")
    assert line == f"omni: error: --image {tmp_path / 'absent.png'}: no such file"


def test_generate_with_an_unreadable_video_is_one_line(capsys, tmp_path):
    import pytest

    pytest.importorskip("av")
    clip = tmp_path / "broken.mp4"
    clip.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    line = _generate_fails(capsys, tmp_path, "--video", clip)
    assert line.startswith(f"omni: error: --video {clip}: cannot be read as a video (MP4, WebM) (")
    assert line.endswith("check that it is a video (MP4, WebM) and not damaged")
