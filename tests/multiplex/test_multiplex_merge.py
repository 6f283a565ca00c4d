"""A vision tower whose projector merges 2 x 2 neighbouring patches into one LLM token
(``spatial_merge=2``, Qwen2-VL's patch merger) trains under multiplexing like the
single-process run with inline encoders (losses, gradient norms, every first-step gradient to
1e-5, fp32): items split over an SP block (pieces are whole merge groups), bubble calls under
pp=2, and tp=2. The plan counts an item by its output rows; the encoder runs four times as
many tokens. Also with the encoders' layers recomputed in the backward
(parallel.encoder_activation_checkpoint full, with SP-split items and sharded weights; selective
under pp=2). And the Qwen2.5-VL tower (``qwen_vl``), whose items are (t, h, w) grids, under
sharded weights and bubble calls; Qwen3-VL's (``qwen3_vl``), whose DeepStack rows the first LLM
layers add, under dp_shard=2, pp=2, tp=2 and cp=2, and on a Qwen3-MoE backbone (Qwen3-VL-MoE)
under ep=2; Qwen2.5-Omni's two towers (``qwen_omni_vision``, ``qwen_omni_audio``) under dp_shard=2, pp=2
and tp=2; Qwen3-Omni's (``qwen3_omni_vision``, ``qwen3_omni_audio``) into a Qwen3-MoE under pp=2
and tp=2; and LLaVA-OneVision's (``llava_ov``), whose
projector lays out whole items from their sizes."""
from __future__ import annotations

from layout_harness import check_named_layouts, run_named_layouts

BOTH = {"moe": False, "num_layers": 4, "media": ("image", "audio")}
IMAGE = {"moe": False, "num_layers": 4, "media": ("image",)}
QWEN3_MOE = {"moe": "qwen3_moe", "num_layers": 4, "media": ("image",)}
QWEN3_OMNI = {"moe": "qwen3_moe", "num_layers": 4, "media": ("image", "audio")}
MERGED = {"steps": 3, "merge": 2}
LAYOUTS = [
    ("dp_shard=2, long items split over sp=2", dict(dp_shard=2), BOTH, {**MERGED, "long_items": True},
     {"encoder_sp": 2, "long_threshold": "2"}),
    ("pp=2 1f1b, bubble calls, p2p", dict(dp_shard=1, pp=2, pp_schedule="1f1b"), BOTH, MERGED,
     {"fill_bubbles": "true", "exchange": "p2p", "encoder_weights": "replicated"}),
    ("tp=2 colocated", dict(tp=2), IMAGE, MERGED, {}),
    # the encoders recompute their layers in the backward (parallel.encoder_activation_checkpoint)
    ("dp_shard=2, encoder layers recomputed (full), sharded weights", dict(dp_shard=2, encoder_activation_checkpoint="full"),
     BOTH, {**MERGED, "long_items": True}, {"encoder_sp": 2, "long_threshold": "2", "encoder_weights": "sharded"}),
    ("pp=2, encoder layers recomputed (selective)", dict(dp_shard=1, pp=2, pp_schedule="1f1b",
                                                        encoder_activation_checkpoint="selective"), BOTH, MERGED, {}),
    # the Qwen2.5-VL tower (2-D rotary positions, windows, (t, h, w) sizes; no SP: it has forward only)
    # and its M-RoPE backbone (Qwen2.5-VL: 3-D positions from each image's grid) through CP slicing
    ("qwen_vl tower, dp_shard=2, sharded weights", dict(dp_shard=2), BOTH, {**MERGED, "vision": "qwen"},
     {"encoder_weights": "sharded"}),
    ("qwen_vl tower, pp=2 1f1b, bubble calls, p2p", dict(dp_shard=1, pp=2, pp_schedule="1f1b"), IMAGE,
     {**MERGED, "vision": "qwen"}, {"fill_bubbles": "true", "exchange": "p2p", "encoder_weights": "replicated"}),
    ("qwen_vl tower, M-RoPE under cp=2", dict(dp_shard=1, cp=2), IMAGE, {**MERGED, "vision": "qwen"}, {}),
    # the Qwen3-VL tower: learned positions interpolated to each grid, and DeepStack rows (the
    # media rows are 3 x the LLM's width) that the first two LLM layers add, on stage 0 under pp=2
    ("qwen3_vl tower, dp_shard=2, sharded weights", dict(dp_shard=2), IMAGE, {**MERGED, "vision": "qwen3"},
     {"encoder_weights": "sharded"}),
    ("qwen3_vl tower, pp=2 1f1b, bubble calls, p2p", dict(dp_shard=1, pp=2, pp_schedule="1f1b"), IMAGE,
     {**MERGED, "vision": "qwen3"}, {"fill_bubbles": "true", "exchange": "p2p", "encoder_weights": "replicated"}),
    ("qwen3_vl tower, tp=2", dict(tp=2), IMAGE, {**MERGED, "vision": "qwen3"}, {}),
    ("qwen3_vl tower, interleaved M-RoPE under cp=2", dict(dp_shard=1, cp=2), IMAGE, {**MERGED, "vision": "qwen3"}, {}),
    # an audio tower beside it (Qwen3-Omni's shape): its rows, without DeepStack, padded to the wide ones
    ("qwen3_vl tower beside an audio tower, dp_shard=2", dict(dp_shard=2), BOTH, {**MERGED, "vision": "qwen3"}, {}),
    # Qwen3-VL-MoE: the same tower and DeepStack rows into a Qwen3-MoE backbone, experts over ep=2
    ("qwen3_vl tower, Qwen3-MoE backbone, dp_shard=2 x ep=2", dict(dp_shard=2, ep=2), QWEN3_MOE,
     {**MERGED, "vision": "qwen3"}, {}),
    # Qwen2.5-Omni's thinker: its vision and audio towers, both multiplexed (the audio one over
    # chunks with pooled pairs and a linear projector), into a Qwen2 with M-RoPE
    ("qwen2.5-omni towers, dp_shard=2, sharded weights", dict(dp_shard=2), BOTH, {**MERGED, "vision": "omni"},
     {"encoder_weights": "sharded"}),
    ("qwen2.5-omni towers, pp=2 1f1b, bubble calls, p2p", dict(dp_shard=1, pp=2, pp_schedule="1f1b"), BOTH,
     {**MERGED, "vision": "omni"}, {"fill_bubbles": "true", "exchange": "p2p", "encoder_weights": "replicated"}),
    ("qwen2.5-omni towers, tp=2", dict(tp=2), BOTH, {**MERGED, "vision": "omni"}, {}),
    # Qwen3-Omni's thinker: the Qwen3-VL tower (DeepStack) and its own audio tower into a Qwen3-MoE
    ("qwen3-omni towers, Qwen3-MoE, pp=2 1f1b, bubble calls, p2p", dict(dp_shard=1, pp=2, pp_schedule="1f1b"),
     QWEN3_OMNI, {**MERGED, "vision": "qwen3_omni"},
     {"fill_bubbles": "true", "exchange": "p2p", "encoder_weights": "replicated"}),
    ("qwen3-omni towers, Qwen3-MoE, tp=2", dict(tp=2), QWEN3_OMNI, {**MERGED, "vision": "qwen3_omni"}, {}),
    # LLaVA-OneVision's tower: its projector lays out whole items (tiles, unpadding, newlines,
    # pooled video frames) from the sizes the runtime passes with the encoder's rows
    ("llava_ov tower, dp_shard=2, sharded weights", dict(dp_shard=2), BOTH, {"steps": 3, "vision": "llava_ov"},
     {"encoder_weights": "sharded"}),
    ("llava_ov tower, pp=2 1f1b, bubble calls, p2p", dict(dp_shard=1, pp=2, pp_schedule="1f1b"), IMAGE,
     {"steps": 3, "vision": "llava_ov"}, {"fill_bubbles": "true", "exchange": "p2p", "encoder_weights": "replicated"}),
]


def _long_items(pm, result):
    result["long_items"] = result.get("long_items", 0) + pm.multiplexer.stats.long_items


def _worker(rank, world, layouts, out_dir):
    run_named_layouts(rank, layouts, out_dir, probe=_long_items)


def test_merged_patches_equal_single_process(tmp_path):
    check_named_layouts(2, LAYOUTS, tmp_path, _worker)
