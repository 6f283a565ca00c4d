"""The simulator's data (omni/sim/data.py): per-sample heterogeneity (text-only, one-image,
multi-image, video and audio samples, the batch's media share set by data.image_ratio), dynamic
workloads (data.image_ratio_schedule; data.run_steps for a mixture's curriculum), the balancer on
such steps, and the validation of the new keys. Fast: no model is run, the spec is built on the
meta device."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from omni.errors import ConfigError
from omni.sim.data import check_data, draw_steps, ratio_at
from omni.sim.sample_model import SampleModel
from omni.sim.work import media_llm_tokens, sample_media_share, step_media_share
from omni.sim.spec import model_spec
from recipes.cli import main
from recipes.simulate_cmd import load_sim_config

# The defaults' mix (image, multi_image, video, audio) on the tiny model with the demo's
# vision + audio encoders; images of 16-128 tokens in micro-batches of 4096.
BASE = ["workload=none", "cluster.num_gpus=8", "data.micro_batch_tokens=4096", "data.sample_tokens=1024",
        "data.image_tokens_min=16", "data.image_tokens_max=128", "data.global_batch_size=2048", "data.steps=1"]
# Sampling noise of a step's media share: its standard deviation over steps of 2048 samples of
# this mix is at most 0.016 (30 seeds at each of the ratios 0.1-0.9; mean off by < 0.003);
# three of them. Steps of n samples: times sqrt(2048 / n).
SHARE_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def setup():
    cfg = load_sim_config(BASE)
    return cfg.data, model_spec(cfg.model, cfg.encoders)


def _with(data, **kw):
    return dataclasses.replace(data, **kw)


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
def test_the_batch_media_share_follows_image_ratio(setup, ratio):
    data, spec = setup
    model = SampleModel(data, spec)
    expected = model.expected_share(model.solve(ratio))
    if ratio < 1:
        assert expected == pytest.approx(ratio, abs=1e-6)
    else:  # one text token per media sample stays
        assert expected == pytest.approx(model.media_mean / (model.media_mean + 1), abs=1e-6)
    (step,) = draw_steps(_with(data, image_ratio=ratio), spec, dp=8)
    assert step.image_ratio == ratio
    realised = step_media_share(step)
    assert abs(realised - ratio) < SHARE_TOLERANCE, (ratio, realised)
    if ratio == 0:
        assert step.media() == []


def test_every_sample_keeps_a_text_token_and_fits_a_micro_batch(setup):
    data, spec = setup
    model = SampleModel(data, spec)
    for ratio in (0.5, 1.0):
        for s in model.draw(ratio, 1024, np.random.default_rng(0)):
            assert s.tokens - media_llm_tokens(s.media) >= 1
            assert s.tokens <= data.micro_batch_tokens


def test_samples_differ_text_only_and_media_heavy_ones_at_half(setup):
    """At image_ratio 0.5 the share is the batch's, not every sample's: text-only samples and
    samples that are mostly media both exist (the old uniform draw gave every sample 0.5)."""
    data, spec = setup
    samples = SampleModel(data, spec).draw(0.5, 2048, np.random.default_rng(0))
    shares = np.asarray([sample_media_share(s) for s in samples])
    assert (shares == 0).mean() > 0.2
    assert (shares > 0.8).mean() > 0.1
    assert shares.std() > 0.3
    counts = np.asarray([len(s.media) for s in samples])
    assert counts.max() >= 8  # video clips: many frames


def test_media_kinds_follow_their_ranges_and_the_encoders(setup):
    data, spec = setup
    only = {"image": 0.0, "multi_image": 0.0, "video": 0.0, "audio": 0.0}
    rng = np.random.default_rng(0)

    def draw(kind, **kw):
        cfg = _with(data, media_mix={**only, kind: 1.0}, **kw)
        return [s for s in SampleModel(cfg, spec).draw(1.0, 256, rng) if s.media]

    multi = draw("multi_image", images_per_sample=[3, 5])
    assert {len(s.media) for s in multi} == {3, 4, 5}
    assert all(m == "image" and 16 <= n <= 128 for s in multi for m, n, _ in s.media)
    video = draw("video", video_frames=[10, 12], frame_tokens=[100, 200])
    assert {len(s.media) for s in video} == {10, 11, 12}
    assert all(len({n for _, n, _ in s.media}) == 1 and 100 <= s.media[0][1] <= 200 for s in video)  # one size a clip
    audio = draw("audio", audio_tokens=[300, 400])
    assert all(len(s.media) == 1 and s.media[0][0] == "audio" and 300 <= s.media[0][1] <= 400 for s in audio)
    # Frames that would overflow the micro-batch are dropped, the sample still fits.
    long = draw("video", video_frames=[40, 40], frame_tokens=[200, 200])
    assert all(len(s.media) == 4095 // 200 and s.tokens <= 4096 for s in long)


def test_audio_only_with_an_audio_encoder():
    cfg = load_sim_config([*BASE, "encoders=vision_only", "encoders/vision=siglip_demo"])
    spec = model_spec(cfg.model, cfg.encoders)
    samples = SampleModel(cfg.data, spec).draw(0.9, 1024, np.random.default_rng(0))
    assert {m for s in samples for m, _, _ in s.media} == {"image"}


def test_schedule_is_interpolated_and_each_step_draws_at_its_ratio(setup):
    points = [[0, 0.2], [0.5, 0.8], [1, 0.4]]
    assert ratio_at(points, 0.25) == pytest.approx(0.5)
    assert ratio_at(points, 0.75) == pytest.approx(0.6)
    assert ratio_at([[0.2, 0.3], [0.8, 0.7]], 0.1) == pytest.approx(0.3)  # the end values outside
    assert ratio_at([[0.2, 0.3], [0.8, 0.7]], 0.9) == pytest.approx(0.7)
    data, spec = setup
    steps = draw_steps(_with(data, image_ratio_schedule=[[0, 0.1], [1, 0.9]], steps=4, global_batch_size=1024),
                       spec, dp=4)
    assert [s.run_fraction for s in steps] == [0.125, 0.375, 0.625, 0.875]
    assert [s.image_ratio for s in steps] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    realised = [step_media_share(s) for s in steps]
    tolerance = SHARE_TOLERANCE * math.sqrt(2048 / 1024)
    assert all(abs(r - s.image_ratio) < tolerance for r, s in zip(realised, steps)), realised
    assert realised == sorted(realised)


@pytest.mark.parametrize("change,message", [
    ({"image_ratio_schedule": [[0.5, 0.1], [0.2, 0.3]]}, "data.image_ratio_schedule: fractions"),
    ({"image_ratio_schedule": [[0, 0.1], [0, 0.3]]}, "data.image_ratio_schedule: fractions"),
    ({"image_ratio_schedule": [[-0.1, 0.1], [1, 0.3]]}, "data.image_ratio_schedule: fractions"),
    ({"image_ratio_schedule": [[0, 0.1], [1, 1.5]]}, "data.image_ratio_schedule: ratios"),
    ({"image_ratio_schedule": []}, "data.image_ratio_schedule is empty"),
    ({"image_ratio_schedule": [[0]]}, "data.image_ratio_schedule=[[0]] is not a list of [fraction, ratio] pairs"),
    ({"media_mix": {"hologram": 1.0}}, "data.media_mix.hologram: not a media kind"),
    ({"media_mix": {"image": -1.0}}, "data.media_mix.image=-1.0 must be a weight >= 0"),
    ({"images_per_sample": [3, 2]}, "data.images_per_sample=[3, 2] must be [lo, hi]"),
    ({"frame_tokens": [0, 10]}, "data.frame_tokens=[0, 10] must be [lo, hi]"),
    ({"media_text_tokens": 0}, "data.media_text_tokens=0 must be in"),
    ({"run_steps": 100}, "data.run_steps spreads a mixture's steps"),
    ({"run_steps": -1}, "data.run_steps=-1 must be >= 0"),
    ({"source": "mixture", "mixture": "m.yaml", "run_steps": 2, "steps": 3}, "data.run_steps=2 must be >= data.steps=3"),
    ({"source": "mixture", "mixture": "m.yaml", "image_ratio_schedule": [[0, 0.5]]},
     "data.image_ratio_schedule describes data.source=lengths"),
])
def test_bad_data_keys_are_config_errors_naming_the_key(setup, change, message):
    data, spec = setup
    with pytest.raises(ConfigError) as e:
        check_data(_with(data, **change), spec)
    assert message in str(e.value)


def test_bad_schedule_from_the_command_line_is_one_line(capsys):
    assert main(["simulate", *BASE, "data.image_ratio_schedule=[[0.5,0.1],[0.2,0.3]]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("omni: error:") and "data.image_ratio_schedule" in err and len(err.splitlines()) == 1


def test_a_media_schedule_needs_an_encoder(capsys):
    assert main(["simulate", *BASE, "encoders=none", "data.image_ratio=0",
                 "data.image_ratio_schedule=[[0,0],[1,0.5]]"]) == 2
    assert "needs an image encoder" in capsys.readouterr().err


def test_heterogeneous_steps_need_the_balancer(setup):
    """Plain order leaves the DP groups' costs apart; the balancer brings them together."""
    data, spec = setup
    cfg = _with(data, global_batch_size=256, steps=3, image_ratio=0.5)
    none = [s.balance for s in draw_steps(_with(cfg, balance="none"), spec, dp=8)]
    balanced = [s.balance for s in draw_steps(cfg, spec, dp=8)]
    assert min(none) > 1.1
    assert max(balanced) < 1.05
    assert all(b < n for b, n in zip(balanced, none))


def _curriculum_mixture(demo, folder):
    """Images first, text later (the demo's shapes and text sources, a weight schedule over 100 steps)."""
    path = folder / "curriculum.yaml"
    path.write_text("sources:\n"
                    f"  - {{name: shapes, path: {demo / 'shapes'}, weight: {{0: 1.0, 99: 0.01}}}}\n"
                    f"  - {{name: text, path: {demo / 'text'}, weight: {{0: 0.01, 99: 1.0}}}}\n")
    return path


def test_mixture_source_spreads_its_steps_over_the_run(demo_root, tmp_path):
    mixture = _curriculum_mixture(demo_root, tmp_path)
    over = ["workload=none", "cluster=cpu", "cluster.num_gpus=2", "data.source=mixture", f"data.mixture={mixture}",
            "data.global_batch_size=16", "data.micro_batch_tokens=1024", "data.sample_tokens=1024", "data.steps=3"]
    cfg = load_sim_config(over)
    spec = model_spec(cfg.model, cfg.encoders)
    plain = draw_steps(cfg.data, spec, dp=2)  # steps 0, 1, 2: all at the start of the curriculum
    assert all(s.run_fraction is None for s in plain)
    start = [s.image_ratio for s in plain]
    assert min(start) > 0.3  # a demo shapes sample is ~40% image tokens
    spread = draw_steps(_with(cfg.data, run_steps=100), spec, dp=2)  # steps 16, 50, 83
    assert [s.run_fraction for s in spread] == pytest.approx([1 / 6, 0.5, 5 / 6])
    shares = [s.image_ratio for s in spread]
    assert shares == [step_media_share(s) for s in spread]
    assert shares[0] > shares[1] > shares[2]
    assert shares[2] < 0.5 * min(start)  # mostly text by step 83
    assert sum(len(g) for s in spread for g in s.groups) > 0
