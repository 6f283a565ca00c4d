"""The vision tower of Qwen3-Omni's thinker (plugin ``qwen3_omni_vision``).

Its computation is Qwen3-VL's tower (``qwen3_vl``: learned positions interpolated to each grid
beside the 2-D rotary ones, the merger and the DeepStack mergers as its projector); what
differs is where a checkpoint keeps it:
- the settings nest in the thinker's config (``thinker_config.vision_config`` in a whole
  Qwen3-Omni directory, ``vision_config`` in a thinker-only one);
- the weights sit under ``thinker.visual.`` (the released checkpoints) or ``visual.`` (what
  transformers saves for the thinker alone), and the mergers keep the Qwen2-VL names:
  ``merger.ln_q`` / ``merger.mlp.0`` / ``merger.mlp.2``, the DeepStack ones as ``merger_list.i``.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, Tuple

from omni.models.encoders.qwen3_vl import Qwen3VisionConfig, Qwen3VisionEncoder, Qwen3VisionProcessor
from omni.models.encoders.qwen_omni_vision import thinker_config

OMNI3_MODEL_TYPES = ("qwen3_omni_moe", "qwen3_omni_moe_thinker")


class Qwen3OmniVisionProcessor(Qwen3VisionProcessor):
    """Qwen3-VL's image processor without its videos: Qwen3-Omni lays a video out by time
    (unfloored rotary steps, its audio track interleaved token by token), which Omni does not
    build yet. With no ``video`` method, a video source is refused in one line before loading."""

    video = None


class Qwen3OmniVisionEncoder(Qwen3VisionEncoder):
    """Qwen3-VL's vision tower, loaded from Qwen3-Omni checkpoints."""

    hf_model_types: ClassVar[Tuple[str, ...]] = OMNI3_MODEL_TYPES
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("thinker.visual.", "model.visual.", "visual.")

    @classmethod
    def processor(cls, config: Qwen3VisionConfig) -> Qwen3OmniVisionProcessor:
        return Qwen3OmniVisionProcessor(cls.build_config(config))

    @classmethod
    def vision_config_of(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        return dict(thinker_config(hf_config).get("vision_config") or {})

    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        params = super().params_from_hf_config(hf_config)
        thinker = thinker_config(hf_config)
        if "position_id_per_seconds" in thinker:  # the thinker's time step per second of video (kept for export)
            params["tokens_per_second"] = int(thinker["position_id_per_seconds"])
        return params

    @classmethod
    def merger_names(cls, layers: int, prefix: str) -> Dict[str, str]:
        """``DeepStackProjector``'s tensor names -> the thinker's (below ``prefix``): Qwen2-VL's
        merger names, the DeepStack ones as ``merger_list.i``."""
        parts = {"norm": "ln_q", "fc1": "mlp.0", "fc2": "mlp.2"}
        names = {}
        for kind in ("weight", "bias"):
            for ours, theirs in parts.items():
                names[f"merger.{ours}.{kind}"] = f"merger.{theirs}.{kind}"
                for i in range(layers):
                    names[f"deepstack.{i}.{ours}.{kind}"] = f"merger_list.{i}.{theirs}.{kind}"
        return {k: prefix + v for k, v in names.items()}
