"""`omni simulate` on every vision (and audio) tower Omni ships, at full size under workload A:
each tower states what the simulator asks of it from its own config (heads, the layers that
run, its features, its cost) and sizes the workload's media in its own terms (a fixed square,
anyres tiles, a patch budget); the workload's ViT settings apply where the tower has them and are
skipped with one line where it has not; the header says what the workload assumed."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from omni.models.encoders.base import EncoderAnchor
from omni.models.encoders.siglip import SiglipEncoder
from omni.sim.spec import model_spec
from recipes.cli import main
from recipes.simulate_cmd import load_sim_config, simulate_main

ONE = ["data.steps=1", "sim.placements=[colocated]"]  # one step, one placement: the towers, not the placements
FAMILIES = {  # the family presets: the LLM of the family and its tower, as shipped (no param set)
    "qwen2_5_vl": ["model=qwen2_5_vl_7b", "encoders=vision_only", "encoders/vision=qwen_vl"],
    "qwen3_vl": ["model=qwen3_vl_8b", "encoders=vision_only", "encoders/vision=qwen3_vl"],
    "qwen3_vl_moe": ["model=qwen3_vl_30b_a3b", "encoders=vision_only", "encoders/vision=qwen3_vl", "parallel.ep=8"],
    "llava_clip": ["model=llama3_8b", "encoders=vision_only", "encoders/vision=clip"],
    "llava_next": ["model=llama3_8b", "encoders=vision_only", "encoders/vision=llava_next"],
    "llava_ov": ["model=qwen2_7b", "encoders=vision_only", "encoders/vision=llava_ov"],
    "siglip2": ["model=qwen2_7b", "encoders=vision_only", "encoders/vision=siglip2"],
    "vit_siglip": ["model=llama_12b", "encoders=vision_only", "encoders/vision=vit_1b"],
    "whisper": ["encoders=demo", "encoders/vision=vit_1b", "encoders/audio=whisper", "data.media_mix.audio=0.3"],
    # Qwen2.5-Omni's thinker: its two towers (audio in chunks, pooled pairs) into a Qwen2-7B with M-RoPE
    "qwen2_5_omni": ["model=qwen2_5_omni_7b", "encoders=omni", "data.media_mix.audio=0.3"],
    # Qwen3-Omni's: Qwen3-VL's tower with DeepStack and its own audio tower into a Qwen3-MoE (ep=8)
    "qwen3_omni": ["model=qwen3_omni_30b_a3b", "encoders=qwen3_omni", "parallel.ep=8", "data.media_mix.audio=0.3"],
    # Qwen3 backbones (QK-norm; the MoE's 128 experts over ep=8) under a SigLIP2 tower
    "qwen3_8b": ["model=qwen3_8b", "encoders=vision_only", "encoders/vision=siglip2"],
    "qwen3_30b_a3b": ["model=qwen3_30b_a3b", "encoders=vision_only", "encoders/vision=siglip2", "parallel.ep=8"],
}


def _json(over: list[str]) -> dict:
    out = io.StringIO()
    assert simulate_main(over, as_json=True, out=out) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_shipped_family_simulates_with_encoder_work(family):
    result = _json([*FAMILIES[family], *ONE])
    p = result["placements"]["colocated"]
    assert p["step_time_s"] > 0 and p["tokens_per_s"] > 0
    assert p["decomposition_s"]["encoder_compute"] > 0 and sum(r["encoder_s"] for r in p["per_rank"]) > 0
    media = result["workload"]["media"]
    assert media and all(v["items_per_step"] > 0 and v["tokens"][0] > 0 and v["rows"][0] > 0 for v in media.values())


def test_the_issue_command_runs_as_written(capsys):
    """`omni simulate model=qwen2_5_vl_7b encoders=vision_only encoders/vision=qwen_vl`, every placement."""
    assert main(["simulate", *FAMILIES["qwen2_5_vl"]]) == 0
    text = capsys.readouterr().out
    assert "colocated" in text and "megatron_naive" in text
    assert "note: workload_A's encoders.vision.params.max_patches=4096 skipped: QwenVisionEncoder has no max_patches" \
        in text


def _spec(family: str, *extra: str):
    cfg = load_sim_config([*FAMILIES[family], *extra])
    return cfg, model_spec(cfg.model, cfg.encoders, cfg.parallel.encoder_activation_checkpoint).encoders["image"]


def test_each_tower_answers_from_its_config():
    """Heads, the layers that run (CLIP and LLaVA stop at vision_feature_layer), the feature row
    (Qwen's patch spans its temporal patch), FSDP units (the whole tower unless it runs SP)."""
    _, qwen = _spec("qwen2_5_vl")
    assert (qwen.heads, qwen.num_layers, qwen.fsdp_units, qwen.tokens_per_row) == (16, 32, 1, 4)
    assert qwen.feature_bytes_per_token == 2 * 3 * 2 * 14 * 14
    _, clip = _spec("llava_clip")
    assert (clip.heads, clip.num_layers, clip.fsdp_units) == (16, 23, 1)  # layer -2 of 24
    assert clip.feature_bytes_per_token == 2 * 3 * 14 * 14
    _, nxt = _spec("llava_next")
    assert (nxt.heads, nxt.num_layers) == (16, 23)
    _, ov = _spec("llava_ov", "+encoders.vision.params.image_size=378")
    assert (ov.heads, ov.num_layers, ov.fsdp_units) == (16, 26, 1)
    _, vit = _spec("vit_siglip")
    assert (vit.heads, vit.num_layers, vit.fsdp_units) == (16, 40, 40)  # runs SP: gathered layer by layer


def test_costs_follow_each_towers_architecture():
    """Qwen2.5-VL: only its full-attention layers are quadratic (a window layer's attention is
    in the linear term); CLIP's class token runs with every image ((n + 1)^2 = n^2 + 2n + 1);
    the tiled towers are linear in their tiles, each tile attending within itself (NeXT's with
    its class token)."""
    _, windowed = _spec("qwen2_5_vl")
    _, full = _spec("qwen2_5_vl", "+encoders.vision.params.window_size=0")
    assert windowed.alpha == pytest.approx(full.alpha * 4 / 32)  # 4 full-attention layers of 32
    assert windowed.beta > full.beta  # the window layers' attention, per token
    _, clip = _spec("llava_clip")
    _, kept = _spec("llava_clip", "+encoders.vision.params.vision_feature_select_strategy=full")
    attention = 4 * 23 * 1024  # QK^T and AV per token pair, the 23 layers that run (feature layer -2)
    assert clip.alpha == kept.alpha == attention
    assert clip.beta - kept.beta == pytest.approx(2 * attention)  # the dropped class token still ran
    _, nxt = _spec("llava_next")
    assert nxt.alpha == 0 and nxt.beta * 576 > attention * 577 ** 2  # per tile: 576 patches + its class token
    _, ov = _spec("llava_ov", "+encoders.vision.params.image_size=378")
    assert ov.alpha == 0 and ov.beta * 729 > 4 * 26 * 1152 * 729 ** 2


def test_each_tower_sizes_the_workloads_media_in_its_own_terms():
    """An image of n patches (the workload's size): Qwen keeps n in merge groups within its
    pixel budget; CLIP makes every image its one square; LLaVA-NeXT / OneVision cut it into a
    base image and tiles (rows: the layout's, with newlines); SigLIP2 fills its patch budget.
    A video: Qwen one item per temporal patch, OneVision one item of squashed frames."""
    _, qwen = _spec("qwen2_5_vl")
    assert qwen.item(1024) == (1024, 256) and qwen.item(1) == (16, 4)  # min_pixels: 56 x 56
    assert qwen.item(10 ** 6) == (5120, 1280)  # max_pixels 28 x 28 x 1280
    assert qwen.clip(24, 1024) == (12, 1024, 256) and qwen.clip(25, 1024)[0] == 13  # frames in pairs
    _, clip = _spec("llava_clip")
    assert clip.item(100) == clip.item(4096) == (576, 576)
    _, nxt = _spec("llava_next")
    side = 24 * 24
    assert nxt.item(32 * 32) == (5 * side, side + 48 * 49)  # 448 px: 2 x 2 tiles of 336, a newline per row
    _, ov = _spec("llava_ov", "+encoders.vision.params.image_size=378")
    assert ov.clip(40, 1024) == (1, 32 * 729, 32 * 14 * 14 + 1)  # max_frames 32, pooled 2 x 2, one newline
    _, sig2 = _spec("siglip2")
    assert sig2.item(64) == sig2.item(4096) == (256, 256)  # max_num_patches 256 (num_patches)


def test_the_processor_agrees_with_the_simulated_tiles():
    """The anyres towers' simulated image is what their processor makes of a square image."""
    from omni.models.build import build_model
    import torch

    cfg = load_sim_config(FAMILIES["llava_next"])
    with torch.device("meta"):
        enc = build_model(cfg.model, cfg.encoders, vocab_needed=0).encoders["image"]
    proc = enc.processor(enc.config)
    for patches in (400, 1024, 2500):
        px = round(patches ** 0.5 * 14)
        item = proc(np.zeros((px, px, 3), dtype=np.uint8))
        assert enc.simulated_item(patches) == (sum(enc.input_units(torch.tensor([item.size]))), item.num_tokens)


def test_workload_settings_apply_where_the_tower_has_them():
    """Workload A's ViT settings (spatial_merge 2, max_patches 4096) go to a tower that has the
    params (the workload's value over the preset's, the command line's over both), are skipped
    with one line each where it has not."""
    notes: list[str] = []
    cfg = load_sim_config(FAMILIES["vit_siglip"], notes)
    assert cfg.encoders["vision"].params["max_patches"] == 4096 and cfg.encoders["vision"].params["spatial_merge"] == 2
    assert notes == []
    cfg = load_sim_config([*FAMILIES["vit_siglip"], "encoders.vision.params.max_patches=2048"], notes)
    assert cfg.encoders["vision"].params["max_patches"] == 2048
    cfg = load_sim_config(FAMILIES["qwen2_5_vl"], notes)
    assert cfg.encoders["vision"].params == {"spatial_merge": 2}
    assert len(notes) == 1 and "max_patches=4096 skipped: QwenVisionEncoder has no max_patches" in notes[0]


class Headless(SiglipEncoder):
    """A plugin that does not say its attention heads (the base class's answer)."""

    def attention_heads(self) -> int:
        return EncoderAnchor.attention_heads(self)


def test_a_plugin_that_does_not_answer_is_one_line(capsys):
    assert main(["simulate", "workload=none", "encoders=vision_only", "encoders/vision=siglip_demo",
                 f"encoders.vision._target_={__name__}:Headless", *ONE]) == 2
    assert capsys.readouterr().err.strip() == (
        "omni: error: encoders: Headless (image) does not implement attention_heads(), which the simulator needs "
        "(docs/simulate.md, \"What the simulator asks of an encoder\")")


def test_deepstack_rows_are_exchanged_at_their_width():
    """Qwen3-VL's media rows carry the DeepStack residuals beside the embedding (the runtime's
    OmniModel.input_width): the simulator moves them at that width, so a tower with DeepStack
    spends more on the row exchange than the same tower without it."""
    cfg = load_sim_config(FAMILIES["qwen3_vl"])
    spec = model_spec(cfg.model, cfg.encoders, cfg.parallel.encoder_activation_checkpoint)
    assert spec.row_width == spec.hidden * (1 + 3)  # Qwen3-VL-8B's tower: DeepStack from 3 layers
    flat = ["+encoders.vision.params.deepstack_visual_indexes=[]"]
    assert model_spec(*_model_of(FAMILIES["qwen3_vl"] + flat)).row_width == spec.hidden
    wide = _json([*FAMILIES["qwen3_vl"], *ONE])["placements"]["colocated"]["decomposition_s"]
    narrow = _json([*FAMILIES["qwen3_vl"], *flat, *ONE])["placements"]["colocated"]["decomposition_s"]
    assert wide["row_exchange"] > narrow["row_exchange"] > 0


def _model_of(over: list[str]):
    cfg = load_sim_config(over)
    return cfg.model, cfg.encoders, cfg.parallel.encoder_activation_checkpoint
