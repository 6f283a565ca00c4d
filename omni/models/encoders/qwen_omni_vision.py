"""The vision tower of Qwen2.5-Omni's thinker (plugin ``qwen_omni_vision``).

Its computation is Qwen2.5-VL's tower (``qwen_vl``: window attention, RMSNorm, the gated MLP,
and the RMSNorm patch merger as its projector); what differs is where a checkpoint keeps it:
- the settings nest in the thinker's config (``thinker_config.vision_config`` in a whole
  Qwen2.5-Omni directory, ``vision_config`` in a thinker-only one);
- the weights sit under ``thinker.visual.`` (the released checkpoints, and what transformers'
  ``save_pretrained`` writes; transformers holds them as ``model.visual.`` in memory), with each
  block's q, k and v stored apart where Omni's block fuses them into one ``qkv``;
- videos take the thinker's time-aligned rotary positions (TMRoPE): a temporal patch steps by
  ``position_id_per_seconds`` per second of video, what Qwen2.5-VL calls ``tokens_per_second``.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Dict, Optional, Tuple

from omni.models.encoders.qwen_vl import QwenVisionConfig, QwenVisionEncoder, merger_names
from omni.models.encoders.qwen_vl_processor import QwenVisionProcessor
from omni.models.projector import PretrainedProjector

OMNI_MODEL_TYPES = ("qwen2_5_omni", "qwen2_5_omni_thinker")
_QKV = re.compile(r"(blocks\.\d+\.attn\.)qkv\.(weight|bias)")


def thinker_config(hf_config: Dict[str, Any]) -> Dict[str, Any]:
    """The thinker's config of an Omni config.json (Qwen2.5-Omni's, Qwen3-Omni's): nested as
    ``thinker_config`` in a whole model's, the file itself in a thinker-only directory."""
    return dict(hf_config.get("thinker_config") or hf_config)


class QwenOmniVisionEncoder(QwenVisionEncoder):
    """Qwen2.5-VL's vision tower, loaded from (and written to) Qwen2.5-Omni checkpoints."""

    hf_model_types: ClassVar[Tuple[str, ...]] = OMNI_MODEL_TYPES
    hf_weight_prefixes: ClassVar[Tuple[str, ...]] = ("thinker.visual.", "model.visual.", "visual.")

    @classmethod
    def params_from_hf_config(cls, hf_config: Dict[str, Any]) -> Dict[str, Any]:
        thinker = thinker_config(hf_config)
        params = super().params_from_hf_config({"model_type": "qwen2_5_vl",
                                                "vision_config": thinker.get("vision_config") or {}})
        if "position_id_per_seconds" in thinker:  # TMRoPE's step per second of video
            params["tokens_per_second"] = int(thinker["position_id_per_seconds"])
        return params

    @classmethod
    def processor(cls, config: QwenVisionConfig) -> QwenVisionProcessor:
        """Qwen2.5-VL's processor, text resuming after a video past its largest (time) position."""
        return QwenVisionProcessor(cls.build_config(config), resume_after_largest=True)

    @classmethod
    def hf_parts(cls, name: str) -> Tuple[str, ...]:
        m = _QKV.fullmatch(name)
        return tuple(f"{m[1]}{part}.{m[2]}" for part in "qkv") if m else ()

    @classmethod
    def pretrained_projector(cls, path: str) -> Optional[PretrainedProjector]:
        """The thinker's patch merger (RMSNorm, then a two-layer GELU MLP over each merge group)."""
        from omni.models.hf_checkpoint import CheckpointReader, read_hf_config

        hf = read_hf_config(path)
        params = cls.params_from_hf_config(hf)
        vision = thinker_config(hf).get("vision_config") or {}
        reader = CheckpointReader(path)
        prefix = next((p for p in cls.hf_weight_prefixes if p + "merger.mlp.0.weight" in reader), None)
        if prefix is None:
            return None
        width = int(params["hidden_size"]) * int(params.get("spatial_merge", 2)) ** 2
        return PretrainedProjector(out_dim=int(vision["out_hidden_size"]), hidden=width, activation="gelu",
                                   norm="rms", names=merger_names("qwen2_5_vl", prefix))

    # --- export (omni.models.families.qwen_omni) -------------------------------------------------
    def hf_tensors(self, prefix: str) -> Dict[str, Any]:
        """The tower's tensors under the thinker's names below ``prefix`` (each fused qkv written
        as its q, k and v, in that order along the first axis)."""
        out: Dict[str, Any] = {}
        for name, t in self.state_dict().items():
            parts = self.hf_parts(name)
            t = self.to_hf_tensor(name, t)
            if parts:
                out.update({prefix + p: piece for p, piece in zip(parts, t.chunk(3))})
            else:
                out[prefix + self.hf_name(name)] = t
        return out
