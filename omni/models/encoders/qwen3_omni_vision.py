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

from typing import Any, ClassVar, Dict, Optional, Tuple

from omni.models.encoders.qwen3_vl import Qwen3VisionEncoder
from omni.models.projector import PretrainedProjector

OMNI3_MODEL_TYPES = ("qwen3_omni_moe", "qwen3_omni_moe_thinker")


def thinker_config(hf_config: Dict[str, Any]) -> Dict[str, Any]:
    """The thinker's config of a Qwen3-Omni config.json: nested in a whole model's, the file
    itself in a thinker-only directory."""
    if hf_config.get("model_type") == "qwen3_omni_moe":
        return dict(hf_config.get("thinker_config") or {})
    return hf_config


def merger_names(layers: int, prefix: str) -> Dict[str, str]:
    """``DeepStackProjector``'s tensor names -> the thinker's (below ``prefix``)."""
    parts = {"norm": "ln_q", "fc1": "mlp.0", "fc2": "mlp.2"}
    names = {}
    for kind in ("weight", "bias"):
        for ours, theirs in parts.items():
            names[f"merger.{ours}.{kind}"] = f"merger.{theirs}.{kind}"
            for i in range(layers):
                names[f"deepstack.{i}.{ours}.{kind}"] = f"merger_list.{i}.{theirs}.{kind}"
    return {k: prefix + v for k, v in names.items()}


class Qwen3OmniVisionEncoder(Qwen3VisionEncoder):
    """Qwen3-VL's vision tower, loaded from Qwen3-Omni checkpoints."""

    hf_model_types: ClassVar[Tuple[str, ...]] = OMNI3_MODEL_TYPES
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("thinker.visual.", "model.visual.", "visual.")

    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        thinker = thinker_config(hf_config)
        params = super().params_from_hf_config({"vision_config": thinker.get("vision_config") or {}})
        if "position_id_per_seconds" in thinker:  # the thinker's time step per second of video (kept for export)
            params["tokens_per_second"] = int(thinker["position_id_per_seconds"])
        return params

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """The thinker's merger and DeepStack mergers (``DeepStackProjector``)."""
        from omni.models.hf_checkpoint import CheckpointReader, read_hf_config

        hf = read_hf_config(path)
        params = cls.build_config(cls.params_from_hf_config(hf))
        reader = CheckpointReader(path)
        prefix = next((p for p in cls.hf_weight_prefixes if p + "merger.mlp.0.weight" in reader), None)
        if prefix is None:
            return None
        vision = thinker_config(hf).get("vision_config") or {}
        width = params.hidden_size * params.spatial_merge ** 2
        return PretrainedProjector(out_dim=int(vision["out_hidden_size"]), hidden=width,
                                   names=merger_names(len(params.deepstack_visual_indexes), prefix))
