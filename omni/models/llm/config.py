"""Configuration of the native decoder backbone, and its translation to / from HF ``config.json``.

One dataclass describes every supported family (Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE,
Qwen3-MoE); the family
only matters when talking to transformers (which config class, which weight names). The
dataclass is a Hydra structured config, so it uses ``Optional`` / ``Dict`` / ``List`` typing only.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Families whose attention normalises each query and key head (an RMSNorm over head_dim, before
# the rotary embedding): Qwen3's QK-norm.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# Vision-language checkpoints whose language model is a supported family: model_type -> that of
# their text model (a Qwen2 or Qwen3 with M-RoPE). Their weights sit under model.language_model.
# (older checkpoints: model.) beside the vision tower's, which the encoder slot loads (``qwen_vl``,
# ``qwen3_vl``).
# Qwen2.5-Omni's thinker (``qwen2_5_omni_thinker``, or nested as ``thinker_config`` in a whole
# ``qwen2_5_omni`` directory) is a Qwen2 with M-RoPE.
VLM_TEXT_MODELS = {"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text",
                   "qwen3_vl_moe": "qwen3_vl_moe_text", "qwen2_5_omni_thinker": "qwen2_5_omni_text",
                   "qwen2_5_omni": "qwen2_5_omni_text", "qwen3_omni_moe_thinker": "qwen3_omni_moe_text",
                   "qwen3_omni_moe": "qwen3_omni_moe_text"}
# The family of each of those text models.
_VLM_TEXT_FAMILIES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
                      "qwen3_vl_moe_text": "qwen3_moe", "qwen2_5_omni_text": "qwen2", "qwen3_omni_moe_text": "qwen3_moe"}
# Text models whose M-RoPE always interleaves its sections, whatever the config says (Qwen3-Omni's
# rotary embedding has no switch; its config writes ``interleaved``, Qwen3-VL's ``mrope_interleaved``).
_ALWAYS_INTERLEAVED = ("qwen3_omni_moe_text",)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# transformers falls back to the config class's ``default_theta`` when a config.json has none.
_DEFAULT_THETA = {"llama": 10000.0, "qwen2": 10000.0, "qwen3": 10000.0, "mixtral": 1000000.0, "qwen2_moe": 10000.0,
                  "qwen3_moe": 10000.0}


@dataclass
class DecoderConfig:
    family: str = "llama"  # one of FAMILIES (selects the HF export format, and Qwen3's QK-norm)
    vocab_size: int = 272
    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None  # default hidden_size // num_heads
    rope_theta: float = 10000.0
    # HF-style scaling dict without ``rope_theta``, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    rope_scaling: Optional[Dict[str, Any]] = None
    # Multimodal RoPE (Qwen2-VL's M-RoPE): the rotary frequencies in three sections taking the
    # temporal, height and width position of each token (``rope.mrope_components``); None: 1-D RoPE.
    mrope_section: Optional[List[int]] = None
    # Qwen3-VL's interleaved M-RoPE: the height and width frequencies every third one from the
    # second and third, the temporal ones the rest (``rope.mrope_components``).
    mrope_interleaved: bool = False
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2); Llama's flag also puts one on o_proj
    num_experts: int = 0  # 0 = dense MLP everywhere
    num_experts_per_tok: int = 2
    moe_intermediate_size: Optional[int] = None  # default intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert (with its sigmoid gate)
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    initializer_range: float = 0.02

    # ------------------------------------------------------------------ derived values
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim else self.hidden_size // self.num_heads

    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size if self.moe_intermediate_size else self.intermediate_size

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen2-MoE's rule (Mixtral is the special case step=1, no mlp-only layers)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def o_proj_bias(self) -> bool:
        # Llama's and Qwen3's ``attention_bias`` covers all four projections; Qwen2's bias is q/k/v only.
        return self.family in ("llama", "qwen3", "qwen3_moe") and self.attention_bias

    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalised before the rotary embedding (Qwen3)."""
        return self.family in QK_NORM_FAMILIES

    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def validate(self) -> None:
        """The shape rules of the backbone; messages name the ``model.*`` keys."""
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r} is not supported; use one of {FAMILIES}.")
        if self.mrope_section is not None:
            half = self.resolved_head_dim() // 2
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != half or min(self.mrope_section) < 0:
                raise ValueError(f"model.mrope_section={list(self.mrope_section)} must be three sections (temporal, "
                                 f"height, width) that add up to head_dim / 2 = {half}")
        if self.mrope_interleaved and self.mrope_section is None:
            raise ValueError("model.mrope_interleaved=true needs model.mrope_section (the three sections it interleaves)")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "max_position_embeddings"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1.")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            divisors = [h for h in range(1, self.hidden_size + 1) if self.hidden_size % h == 0]
            near = min(divisors, key=lambda h: (abs(h - self.num_heads), -h))
            raise ValueError(
                f"model.num_heads={self.num_heads} does not divide model.hidden_size={self.hidden_size} (each head "
                f"gets hidden_size / num_heads channels); use e.g. model.num_heads={near}, or set model.head_dim."
            )
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"model.head_dim={self.head_dim} must be >= 1 (or null: hidden_size / num_heads).")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model.num_kv_heads={self.num_kv_heads} does not divide model.num_heads={self.num_heads} (each KV "
                f"head serves a whole group of query heads); choose num_kv_heads from the divisors of {self.num_heads}."
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"model.rms_norm_eps={self.rms_norm_eps} must be > 0.")
        if self.rope_type() not in ROPE_TYPES:
            raise ValueError(
                f"model.rope_scaling rope_type={self.rope_type()!r} is not supported; use one of {ROPE_TYPES}."
            )
        if self.num_experts < 0:
            raise ValueError(f"model.num_experts={self.num_experts} must be >= 0 (0: a dense MLP).")
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} must be in 1..model.num_experts={self.num_experts}."
            )

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf(cls, hf: Dict[str, Any]) -> "DecoderConfig":
        """Build from the contents of an HF ``config.json`` (transformers 4.x or 5.x layout)."""
        hf = dict(hf)
        # The text model of Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE (their config.json's
        # text_config) is a Qwen2 / Qwen3 / Qwen3-MoE with M-RoPE.
        family = _VLM_TEXT_FAMILIES.get(hf.get("model_type"), hf.get("model_type"))
        if family not in FAMILIES:
            raise ValueError(
                f"config.json model_type={family!r} is not supported; supported: {FAMILIES}, and the language "
                f"model of {' / '.join(VLM_TEXT_MODELS)} checkpoints."
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act={act!r} is not supported; only 'silu' (SwiGLU) is.")
        if hf.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported; the MLP has no biases here.")
        if hf.get("use_sliding_window") or (family == "mixtral" and hf.get("sliding_window") is not None):
            raise ValueError(
                f"config.json sliding-window attention (sliding_window={hf.get('sliding_window')}) is not "
                "supported; set use_sliding_window=false / sliding_window=null if the model does not need it."
            )
        windowed = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
        if windowed:
            raise ValueError(f"config.json layer_types has {len(windowed)} {windowed[0]!r} layers; only full attention "
                             "is supported (use_sliding_window=false)")
        theta, scaling, mrope = _rope_from_hf(hf, family)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        interleaved = bool(rope.get("mrope_interleaved")) or hf.get("model_type") in _ALWAYS_INTERLEAVED
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        # Qwen3's config class defaults head_dim to 128 (not hidden / heads) where the file has none.
        head_dim = hf.get("head_dim", 128 if family == "qwen3" else None)
        c = cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim if head_dim and head_dim != hidden // heads else None,
            rope_theta=float(theta),
            rope_scaling=scaling,
            mrope_section=mrope,
            mrope_interleaved=interleaved and mrope is not None,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=hf.get("initializer_range", 0.02),
        )
        if family == "llama":
            c.attention_bias = bool(hf.get("attention_bias", False))
        elif family == "qwen2":
            c.attention_bias = True  # Qwen2 always has q/k/v biases
        elif family == "qwen3":
            c.attention_bias = bool(hf.get("attention_bias", False))
        elif family == "mixtral":
            c.num_experts = hf.get("num_local_experts", 8)
            c.num_experts_per_tok = hf.get("num_experts_per_tok", 2)
            c.moe_intermediate_size = hf["intermediate_size"]
            c.norm_topk_prob = True  # Mixtral always renormalises the top-k weights
            c.router_aux_loss_coef = hf.get("router_aux_loss_coef", 0.001)
        else:  # qwen2_moe, qwen3_moe (no shared expert; o_proj's bias too)
            qwen3 = family == "qwen3_moe"
            c.attention_bias = bool(hf.get("attention_bias", False) if qwen3 else hf.get("qkv_bias", True))
            # transformers 5 writes Qwen3-MoE's count as num_local_experts; the released files num_experts
            c.num_experts = hf.get("num_experts") or hf.get("num_local_experts") or (128 if qwen3 else 60)
            c.num_experts_per_tok = hf.get("num_experts_per_tok", 8 if qwen3 else 4)
            c.moe_intermediate_size = hf.get("moe_intermediate_size", 768 if qwen3 else 1408)
            c.shared_expert_intermediate_size = 0 if qwen3 else hf.get("shared_expert_intermediate_size", 5632)
            # Qwen3-VL-MoE's router always renormalises its top-k weights (its config has no flag)
            c.norm_topk_prob = hf.get("model_type") == "qwen3_vl_moe_text" or bool(hf.get("norm_topk_prob", False))
            c.router_aux_loss_coef = hf.get("router_aux_loss_coef", 0.001)
            c.decoder_sparse_step = hf.get("decoder_sparse_step", 1)
            c.mlp_only_layers = list(hf.get("mlp_only_layers") or [])
        c.validate()
        return c

    def to_hf(self, text_of_vlm: bool = False) -> Dict[str, Any]:
        """``config.json`` contents for ``self.family`` (transformers 5.x layout, readable by 4.x too).
        ``text_of_vlm``: the ``text_config`` of a vision-language checkpoint (Qwen2-VL), M-RoPE
        sections included; a backbone with M-RoPE exports only so (a plain Qwen2 would drop them)."""
        self.validate()
        f = self.family
        if self.mrope_section is not None and not text_of_vlm:
            raise ValueError("a backbone with M-RoPE (model.mrope_section) is a Qwen2-VL text model: it exports "
                             "with its vision tower as a Qwen2-VL checkpoint (omni.models.families.qwen_vl.export_qwen_vl)")
        if f not in MOE_FAMILIES and self.num_experts > 0:
            raise ValueError(f"family={f!r} has no MoE layers; set family='mixtral', 'qwen2_moe' or 'qwen3_moe' for "
                             "num_experts>0.")
        if f in MOE_FAMILIES and self.num_experts == 0:
            raise ValueError(f"family={f!r} needs num_experts>0; use family='llama', 'qwen2' or 'qwen3' for a dense "
                             "model.")
        if f == "qwen3_moe" and self.shared_expert_intermediate_size:
            raise ValueError("family='qwen3_moe' has no shared expert; use family='qwen2_moe' for one.")
        if f == "mixtral" and (
            self.attention_bias or self.shared_expert_intermediate_size or not self.norm_topk_prob
            or self.decoder_sparse_step != 1 or self.mlp_only_layers
        ):
            raise ValueError(
                "family='mixtral' cannot express attention_bias, a shared expert, norm_topk_prob=False or dense "
                "layers; use family='qwen2_moe'."
            )
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope.update({k: v for k, v in self.rope_scaling.items() if k != "type"})
            rope["rope_type"] = self.rope_type()
            if rope["rope_type"] in ("llama3", "yarn", "longrope"):
                rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        hf: Dict[str, Any] = {
            "architectures": [_ARCHITECTURES[f]],
            "model_type": f,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.expert_intermediate_size() if f == "mixtral" else self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.resolved_head_dim(),
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "rope_parameters": rope,
            # 4.x readers look for these two at the top level.
            "rope_theta": self.rope_theta,
            "rope_scaling": None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
            "attention_dropout": 0.0,
            "use_cache": True,
        }
        if f == "llama":
            hf.update(attention_bias=self.attention_bias, mlp_bias=False)
        elif f == "qwen2":
            hf.update(use_sliding_window=False, sliding_window=None)
        elif f == "qwen3":
            hf.update(attention_bias=self.attention_bias, use_sliding_window=False, sliding_window=None)
        elif f == "mixtral":
            hf.update(
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                router_aux_loss_coef=self.router_aux_loss_coef,
                router_jitter_noise=0.0,
                sliding_window=None,
            )
        else:  # qwen2_moe, qwen3_moe: the same routing keys; Qwen2-MoE's q/k/v bias and shared expert
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.expert_intermediate_size(),
                norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.router_aux_loss_coef,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                use_sliding_window=False,
            )
            if f == "qwen2_moe":
                hf.update(qkv_bias=self.attention_bias,
                          shared_expert_intermediate_size=self.shared_expert_intermediate_size)
            else:
                hf.update(attention_bias=self.attention_bias, sliding_window=None)
        if text_of_vlm:
            hf.pop("architectures")
            if self.mrope_section is not None:
                hf["rope_parameters"]["mrope_section"] = list(self.mrope_section)
                if self.mrope_interleaved:
                    hf["rope_parameters"]["mrope_interleaved"] = True
        return hf


def _rope_from_hf(hf: Dict[str, Any], family: str):
    """(rope_theta, rope_scaling) from either the 5.x ``rope_parameters`` or the 4.x
    ``rope_theta`` + ``rope_scaling`` layout."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    params = copy.deepcopy(dict(params))
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("config.json rope_parameters nested per layer type is not supported; use one global dict.")
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or _DEFAULT_THETA[family]
    mrope = params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    params.pop("interleaved", None)  # Qwen3-Omni's name for it
    mrope = [int(x) for x in mrope] if mrope else None
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    prf = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor")
    if prf not in (None, 1, 1.0):
        raise ValueError(f"config.json partial_rotary_factor={prf} is not supported; only full rotary (1.0) is.")
    if rope_type not in ROPE_TYPES + ("mrope",):
        raise ValueError(f"config.json rope_type={rope_type!r} is not supported; use one of {ROPE_TYPES}.")
    if rope_type in ("default", "mrope"):  # transformers 4.x wrote Qwen2-VL's as type "mrope"
        return theta, None, mrope
    if "original_max_position_embeddings" in hf and rope_type in ("llama3", "yarn", "longrope"):
        # A top-level value (Phi3 style) takes priority, as in transformers.
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    return theta, {"rope_type": rope_type, **params}, mrope
