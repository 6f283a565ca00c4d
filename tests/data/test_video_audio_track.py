"""A video's own audio track in training mixtures (a source's ``video: {audio: true}``, Qwen2.5-
Omni's use_audio_in_video): the index reads the track's sample count from the header, the planner
counts its tokens and framing, the constructor decodes it and lays the clip out as `omni generate
--video-audio` does (whose layout equals transformers': tests/test_omni_family_cmds.py), a cut
never goes through the interleaved span, and a tiny thinker fine-tunes on such a source. Every
mistake is one line before training."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dataloading.construct.constructor import SampleConstructor
from dataloading.errors import DataError
from dataloading.formats.media import configure_processors
from dataloading.formats.video import audio_track, video_meta
from dataloading.index.shards import write_shards
from dataloading.index.source_index import build_index, load_index
from dataloading.plan.mixture import SourceOptions, load_mixture
from dataloading.plan.sample_length import estimate_tokens, media_entries
from hf_omni_helpers import save_tiny_qwen2_5_omni, save_tiny_qwen3_omni
from media_helpers import clip_bytes, clip_with_audio_bytes

av = pytest.importorskip("av")
TRACK = {"video": {"audio": True}}


@pytest.mark.parametrize("rate", [16000, 44100])
def test_the_header_gives_the_tracks_samples_as_decoded(rate):
    data = clip_with_audio_bytes(seconds=2.3, sample_rate=rate)
    wave, got_rate = audio_track(data)
    assert video_meta(data)["track"] == {"num_samples": len(wave), "sample_rate": got_rate} and got_rate == rate
    assert video_meta(clip_bytes(frames=20, rate=10, height=56, width=84))["track"] is None


# family -> (its tiny thinker, its encoders preset)
FAMILIES = {"qwen2_5_omni": (save_tiny_qwen2_5_omni, "omni"), "qwen3_omni": (save_tiny_qwen3_omni, "qwen3_omni")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def omni(tmp_path_factory, request):
    """A tiny thinker of each Omni family (its tokenizer and both processors) and a source of
    two clips with sound (3 s and 1.2 s) and one without: Qwen2.5-Omni interleaves a track in
    2-second chunks, Qwen3-Omni token by token."""
    from omni.models.build import media_processors
    from recipes.model_source import load_model

    root = tmp_path_factory.mktemp("track")
    FAMILIES[request.param][0](root / "hf")
    (root / "encoders").write_text(FAMILIES[request.param][1])
    loaded = load_model(str(root / "hf"))
    clips = [clip_with_audio_bytes(seconds=3.0), clip_with_audio_bytes(seconds=1.2, hz=660.0),
             clip_bytes(frames=20, rate=10, height=56, width=84)]
    write_shards([{"__key__": f"v{i}", "txt": "<video>\nWhat do you hear?", "mp4": c, "response.txt": "a tone"}
                  for i, c in enumerate(clips)], root / "clips", "clips", samples_per_shard=4)
    build_index(root / "clips", workers=1, progress=False)
    return root, loaded, media_processors(loaded.model)


def _constructor(root, loaded, procs, options, budget=None):
    index = load_index(root / "clips")
    return SampleConstructor({"clips": index.reader("clips")}, loaded.tokenizer, procs, budget,
                             options={"clips": SourceOptions(media=options)})


def test_a_source_asking_for_tracks_lays_clips_out_as_generate_does_and_the_plan_counts_them(omni):
    root, loaded, procs = omni
    index = load_index(root / "clips")
    asked = _constructor(root, loaded, procs, TRACK)
    plain = _constructor(root, loaded, procs, {})
    for i, meta in enumerate(index.samples):
        sample = asked.fetch(f"clips/v{i}")
        row = asked.tokenize(sample)
        # the same sample with the track attached by hand (`omni generate --video-audio`'s path)
        (kind, clip), = sample.media
        track = audio_track(clip.data)
        by_hand = plain.tokenize(dataclasses.replace(sample, media=[(kind, dataclasses.replace(clip, audio=track))]
                                                     if track is not None else sample.media))
        np.testing.assert_array_equal(row.ids, by_hand.ids)
        assert [(m, it.size) for m, it, _ in row.media] == [(m, it.size) for m, it, _ in by_hand.media]
        assert len(row.spans) == (track is not None)
        # the planner: the track's audio item after the clip's, its tokens and its two framing
        # tokens; exactly the row's growth over the frames alone
        with_track = configure_processors(procs, TRACK, "source clips")
        entries = media_entries(meta, with_track)
        assert [m for m, _ in entries] == ["image", "audio"][:1 + (track is not None)]
        assert [k for _, k in entries] == [it.num_tokens for _, it, _ in row.media]
        grown = estimate_tokens(meta, loaded.tokenizer, with_track) - estimate_tokens(meta, loaded.tokenizer, procs)
        assert grown == len(row) - len(plain.tokenize(plain.fetch(f"clips/v{i}")))
    mb = asked.build_planned([["clips/v0", "clips/v2"]])[0][0]
    assert mb.media["audio"].num_tokens.numel() == 1 and mb.media["image"].num_tokens.numel() == 2


def test_no_cut_goes_through_the_interleaved_span(omni):
    root, loaded, procs = omni
    whole = _constructor(root, loaded, procs, TRACK).tokenize(_constructor(root, loaded, procs, TRACK).fetch("clips/v0"))
    (start, rel, _), = whole.spans
    budget = start + rel.shape[1] // 2  # mid-span
    trunc = _constructor(root, loaded, procs, TRACK, budget)
    trunc.options["clips"] = SourceOptions(media=TRACK, over_budget="truncate")
    cut = trunc.fit_budget(whole, None)
    assert len(cut) == start and cut.media == [] and cut.spans == []  # cut before the span's opening token
    split = _constructor(root, loaded, procs, TRACK, budget)
    split.options["clips"] = SourceOptions(media=TRACK, over_budget="split")
    with pytest.raises(DataError, match="would cut a media item in two") as e:
        split.fit_budget(whole, 0)
    assert e.value.kind == "split_cuts_media"


def test_track_mistakes_are_one_line_before_training(omni, tmp_path):
    from dataloading.formats.tokenizer import ByteTokenizer
    from omni.models.encoders.qwen_vl import QwenVisionConfig, QwenVisionEncoder

    root, loaded, procs = omni
    # a model that does not interleave (Qwen2.5-VL) refuses the option in the mixture
    vl = {"image": QwenVisionEncoder.processor(QwenVisionConfig(variant="qwen2_5_vl", patch_size=14))}
    with pytest.raises(DataError, match=r"only in a model that interleaves them \(the Qwen2.5-Omni and Qwen3-Omni"):
        configure_processors(vl, TRACK, "source clips")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"sources:\n  - {{name: clips, path: {root / 'clips'}, weight: 1, video: {{audio: maybe}}}}\n")
    with pytest.raises(DataError, match=r"video.audio must be one of \[True, False\], got 'maybe'"):
        load_mixture(bad)
    meta = load_index(root / "clips").samples[0]
    with_track = configure_processors(procs, TRACK, "source clips")
    # the byte tokenizer has no audio framing tokens
    with pytest.raises(DataError, match=r"lacks; train with the model's own tokenizer") as e:
        estimate_tokens(meta, ByteTokenizer(["image", "audio"]), with_track)
    assert e.value.kind == "config"
    # an index built before tracks were read
    old = dataclasses.replace(meta, media=[(k, {x: v for x, v in m.items() if x != "track"}) for k, m in meta.media])
    with pytest.raises(DataError, match=r"its index predates videos' audio tracks.*omni data index FOLDER"):
        media_entries(old, with_track)


def test_a_thinker_fine_tunes_on_a_source_of_clips_with_their_tracks(omni, tmp_path):
    from recipe_helpers import read_metrics, train

    root, _, _ = omni
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: clips, path: {root / 'clips'}, weight: 1, video: {{audio: true}}}}\n")
    hf = root / "hf"
    run = tmp_path / "run"
    train([f"data.mixture={mix}", f"model.pretrained={hf}", f"data.tokenizer={hf}", f"encoders.vision.pretrained={hf}",
           f"encoders.audio.pretrained={hf}", f"encoders={(root / 'encoders').read_text()}", "data.global_batch_size=3", "data.num_workers=0",
           "data.micro_batch_tokens=1024", f"trainer.run_dir={run}", "trainer.progress=false",
           "trainer.eval_at_end=false", "trainer.max_steps=2", "optim.warmup_steps=1", "checkpoint.every=0"])
    steps = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in steps)
    # "a tone" (6 byte-level tokens) and EOS for each of the 3 samples
    assert all(r["target_tokens"] == 3 * 7 and r["encoder_peak_activation_mib"] > 0 for r in steps), steps
