"""Load and export HF checkpoints (local directories) for the native decoder.

A checkpoint is ``config.json`` + ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Supported: LlamaForCausalLM, Qwen2ForCausalLM,
MixtralForCausalLM, Qwen2MoeForCausalLM, and the language model of Qwen2-VL / Qwen2.5-VL
checkpoints (Qwen2 with M-RoPE; their vision tower is the ``qwen_vl`` encoder's to load) and of
LLaVA checkpoints (a Llama or Qwen2; the CLIP tower and projector are the ``clip`` encoder's).

Native names are HF names without the ``model.`` prefix, except for the MoE parts:

    HF (per expert, what save_pretrained writes)         native
    mlp.gate.weight           (mixtral: block_sparse_moe.*)   mlp.router.weight
    mlp.experts.{e}.gate_proj / up_proj   (mixtral: w1 / w3)  mlp.experts.w_gate_up[e] = cat(gate, up)
    mlp.experts.{e}.down_proj             (mixtral: w2)       mlp.experts.w_down[e]
    HF (fused, transformers 5.x in-memory layout)
    mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I] mlp.experts.w_gate_up / w_down
    HF (fused, hidden first: Qwen3-VL-MoE's released files, ``EXPERTS_HIDDEN_FIRST``)
    mlp.experts.gate_up_proj [E, H, 2I] / down_proj [E, I, H] the same, each expert transposed

Every layout loads; export writes the per-expert layout (which transformers 4.x and 5.x read),
or for a model type whose released files fuse the experts, theirs.
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from typing import Dict, Optional

import torch

from .hf_checkpoint import CheckpointReader, read_hf_config, transformers_config
from .materialize import SeededInit, Sources, WeightSource, full_index, materialize
from .llm.config import VLM_TEXT_MODELS, DecoderConfig
from .llm.decoder import Decoder

Tensors = Dict[str, torch.Tensor]

# Tensors of a vision-language checkpoint that are not its language model's: Qwen2-VL's tower
# and merger (``model.visual.``; ``visual.`` before transformers 4.52), LLaVA's tower and
# projector (under ``model.`` as transformers 5 holds them, without it as LLaVA-1.5 files and
# transformers' own save_pretrained write them).
_VLM_NOT_LLM = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                "multi_modal_projector.", "model.image_newline", "image_newline",  # LLaVA-NeXT's and OneVision's
                # Qwen2.5-Omni: the thinker's towers (``thinker.`` in the released files, none in a
                # thinker-only save), the talker and the vocoder (speech output: not loaded)
                "thinker.visual.", "thinker.audio_tower.", "audio_tower.", "model.audio_tower.", "talker.",
                "token2wav.", "code2wav.")  # the last: Qwen3-Omni's vocoder
# Vision-language checkpoints in LLaVA's layout: the language model is ``text_config``, a model
# of a supported family, its weights under ``language_model.model.`` and
# ``language_model.lm_head.`` (or ``model.language_model.`` and ``lm_head.``).
LLAVA_MODEL_TYPES = ("llava", "llava_onevision", "llava_next")

# Checkpoint model types whose fused expert tensors may be stored hidden first: the released
# Qwen3-VL-MoE checkpoints are ([E, H, 2I], [E, I, H]); transformers 5.x's save_pretrained writes
# its in-memory layout ([E, 2I, H], [E, H, I]). transformers' loader tells them apart by shape
# (``Transpose(check_dims=True)`` in its conversion mapping: transposed unless the stored shape
# is the in-memory one), and so does ``CheckpointSource``.
EXPERTS_HIDDEN_FIRST = ("qwen3_vl_moe",)
EXPERT_LAYOUTS = ("per_expert", "fused", "hidden_first")
# Per-expert projection names in HF checkpoints: (gate, up, down).
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}
_PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")


def hf_name_to_native(name: str, config: DecoderConfig):
    """One HF tensor name -> ``(native name, None)``, ``(None, (layer, expert, projection))``
    for a per-expert weight (stacked into ``w_gate_up`` / ``w_down``), or None for a tensor
    that is not loaded (a tied model's head copy, the derived RoPE buffer)."""
    if name in ("lm_head.weight", "language_model.lm_head.weight", "thinker.lm_head.weight"):  # LLaVA's, Omni's
        # Tied: the head is the embedding (some checkpoints still store a copy).
        return None if config.tie_word_embeddings else ("lm_head.weight", None)
    if name.endswith("rotary_emb.inv_freq"):
        return None  # older checkpoints store the derived RoPE buffer; we recompute it
    if name.startswith(_VLM_NOT_LLM):
        return None  # a vision-language checkpoint's tower or projector: the encoder slot loads it
    for prefix in ("model.language_model.", "language_model.model.", "thinker.model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's legacy module name
    m = _PER_EXPERT.match(name)
    if m:
        return None, (int(m.group(1)), int(m.group(2)), m.group(3))
    name = re.sub(r"\.mlp\.gate\.weight$", ".mlp.router.weight", name)
    name = re.sub(r"\.mlp\.experts\.gate_up_proj$", ".mlp.experts.w_gate_up", name)
    name = re.sub(r"\.mlp\.experts\.down_proj$", ".mlp.experts.w_down", name)
    return name, None


def _expert_names(config: DecoderConfig) -> tuple[str, str, str]:
    return _EXPERT_NAMES.get(config.family, _EXPERT_NAMES["qwen2_moe"])


def _missing_expert(layer: int, key, config: DecoderConfig) -> ValueError:
    gate_n, up_n, down_n = _expert_names(config)
    return ValueError(
        f"checkpoint layer {layer} lacks expert weight {key} (expected {config.num_experts} experts with "
        f"{gate_n}/{up_n}/{down_n}); the checkpoint does not match config.json."
    )


class CheckpointSource(WeightSource):
    """The decoder's tensors read from a HF checkpoint directory region by region
    (``materialize`` asks each rank for its own shard only). Names are ``Decoder`` names.
    An embedding (or untied head) with more rows than the checkpoint (the tokenizer appended
    the media placeholders, ``build.grow_vocab``) gets the mean of the checkpoint's rows there."""

    def __init__(self, path: str, config: DecoderConfig, experts_hidden_first: bool = False):
        self.path, self.config = os.fspath(path), config
        self.reader = CheckpointReader(path)
        # Fused expert tensors that may be stored hidden first (``EXPERTS_HIDDEN_FIRST``).
        self.experts_hidden_first = experts_hidden_first
        self.plain: Dict[str, str] = {}  # native name -> HF key
        self.experts: Dict[int, Dict[int, Dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
        for key in self.reader.keys():
            mapped = hf_name_to_native(key, config)
            if mapped is None:
                continue
            name, expert = mapped
            if expert is None:
                self.plain[name] = key
            else:
                self.experts[expert[0]][expert[1]][expert[2]] = key
        self._means: Dict[str, torch.Tensor] = {}

    def names(self) -> set:
        out = set(self.plain)
        for layer in self.experts:
            out |= {f"layers.{layer}.mlp.experts.w_gate_up", f"layers.{layer}.mlp.experts.w_down"}
        return out

    def has(self, name: str) -> bool:
        return name in self.plain or self._expert_layer(name) is not None

    def _expert_layer(self, name: str) -> Optional[int]:
        m = re.match(r"^layers\.(\d+)\.mlp\.experts\.(w_gate_up|w_down)$", name)
        return int(m.group(1)) if m and name not in self.plain and int(m.group(1)) in self.experts else None

    def _transposed(self, name: str) -> bool:
        """Whether the fused expert tensor ``name`` is stored hidden first: its hidden dimension
        where the in-memory layout has the other (where both fit, the in-memory layout, as
        transformers' loader takes it)."""
        if not (self.experts_hidden_first and name.endswith((".mlp.experts.w_gate_up", ".mlp.experts.w_down"))):
            return False
        shape, hidden = self.reader.shape(self.plain[name]), self.config.hidden_size
        hidden_at = 2 if name.endswith("w_gate_up") else 1  # w_gate_up [E, 2I, H], w_down [E, H, I]
        return len(shape) == 3 and shape[hidden_at] != hidden and shape[3 - hidden_at] == hidden

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.plain:
            shape = self.reader.shape(self.plain[name])
            return (shape[0], shape[2], shape[1]) if self._transposed(name) and len(shape) == 3 else shape
        layer = self._expert_layer(name)
        gate_n, up_n, down_n = _expert_names(self.config)
        per = self.experts[layer]
        try:
            if name.endswith("w_gate_up"):
                g, u = self.reader.shape(per[0][gate_n]), self.reader.shape(per[0][up_n])
                return (self.config.num_experts, g[0] + u[0], g[1])
            return (self.config.num_experts, *self.reader.shape(per[0][down_n]))
        except KeyError as e:
            raise _missing_expert(layer, e, self.config) from None

    def check(self, expected: Dict[str, torch.Size]) -> None:
        """The checkpoint holds exactly the tensors ``expected`` (name -> shape), before any
        weight is read."""
        have = self.names()
        missing = sorted(set(expected) - have)
        unexpected = sorted(have - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {self.path!r} does not match its config.json: missing {missing[:3]}, unexpected "
                f"{unexpected[:3]} ({len(missing)} / {len(unexpected)} in all)."
            )
        for layer, per in self.experts.items():
            gate_n, up_n, down_n = _expert_names(self.config)
            for e in range(self.config.num_experts):
                for proj in (gate_n, up_n, down_n):
                    if proj not in per.get(e, {}):
                        raise _missing_expert(layer, f"'{proj}' of expert {e}", self.config)
        for name, shape in expected.items():
            if tuple(shape) != self.shape(name):
                raise ValueError(f"checkpoint {self.path!r}: {name} has shape {self.shape(name)}, "
                                 f"config.json implies {tuple(shape)}.")

    def read(self, name, model, shape, index):
        if name in self.plain:
            return self._plain(name, index)
        return self._stacked(name, index)

    def _plain(self, name: str, index: tuple) -> torch.Tensor:
        key = self.plain[name]
        if self._transposed(name):  # only the experts, rows and columns asked for, from the stored [E, in, out]
            return self.reader.region(key, (index[0], index[2], index[1])).transpose(1, 2).contiguous()
        rows = self.reader.shape(key)[0]
        lo, hi = index[0].start, index[0].stop
        if hi <= rows:
            return self.reader.region(key, index)
        # Rows past the checkpoint's vocabulary: the mean of its rows (one tensor read whole, once).
        if name not in self._means:
            self._means[name] = self.reader.region(key, full_index(self.reader.shape(key))).float().mean(0)
        parts = [self.reader.region(key, (slice(lo, rows), *index[1:])).float()] if lo < rows else []
        mean = self._means[name][index[1:]]
        parts.append(mean.expand(hi - max(lo, rows), *mean.shape))
        return torch.cat(parts)

    def _stacked(self, name: str, index: tuple) -> torch.Tensor:
        """Experts stacked from per-expert tensors: only the experts and rows of ``index``."""
        layer = self._expert_layer(name)
        gate_n, up_n, down_n = _expert_names(self.config)
        per = self.experts[layer]
        rows_index, cols = index[1], index[2]
        out = []
        for e in range(index[0].start, index[0].stop):
            if name.endswith("w_down"):
                out.append(self.reader.region(per[e][down_n], (rows_index, cols)))
                continue
            inter = self.reader.shape(per[e][gate_n])[0]
            pieces = []
            for key, base in ((per[e][gate_n], 0), (per[e][up_n], inter)):
                lo, hi = max(rows_index.start, base) - base, min(rows_index.stop, base + inter) - base
                if lo < hi:
                    pieces.append(self.reader.region(key, (slice(lo, hi), cols)))
            out.append(torch.cat(pieces))
        return torch.stack(out)


def native_state_dict_to_hf(sd: Tensors, config: DecoderConfig, experts: str = "per_expert") -> Tensors:
    """``Decoder.state_dict()`` names -> HF names. ``experts`` (``EXPERT_LAYOUTS``): one tensor per
    expert and projection (what ``save_pretrained`` writes for the text MoE families), ``fused``
    (transformers 5.x's in-memory layout) or ``hidden_first`` (``EXPERTS_HIDDEN_FIRST``'s files)."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts={experts!r}; one of {EXPERT_LAYOUTS}")
    fused_experts = experts != "per_expert"
    family = config.family
    moe_prefix = ".block_sparse_moe." if family == "mixtral" else ".mlp."
    gate_n, up_n, down_n = _EXPERT_NAMES.get(family, _EXPERT_NAMES["qwen2_moe"])
    out: Tensors = {}
    for name, t in sd.items():
        if name == "lm_head.weight":
            out[name] = t
            continue
        hf = "model." + name
        if ".mlp.router." in hf:
            hf = hf.replace(".mlp.router.", ".mlp.gate.")
        elif ".mlp.experts.w_" in hf:
            layer = hf.split(".mlp.")[0]
            if fused_experts:
                # hidden first unless both dimensions are the hidden size's (then a loader, Omni's
                # or transformers', takes the in-memory layout: see EXPERTS_HIDDEN_FIRST)
                square = t.shape[1] == t.shape[2]
                out[hf.replace(".w_gate_up", ".gate_up_proj").replace(".w_down", ".down_proj")] = \
                    t.transpose(1, 2) if experts == "hidden_first" and not square else t
            elif hf.endswith("w_gate_up"):
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{layer}{moe_prefix}experts.{e}.{gate_n}.weight"] = t[e, :inter]
                    out[f"{layer}{moe_prefix}experts.{e}.{up_n}.weight"] = t[e, inter:]
            else:
                for e in range(t.shape[0]):
                    out[f"{layer}{moe_prefix}experts.{e}.{down_n}.weight"] = t[e]
            continue
        if family == "mixtral" and not fused_experts:
            hf = hf.replace(".mlp.", moe_prefix)
        out[hf] = t
    if family == "qwen2" and not config.attention_bias:
        # Qwen2 always has q/k/v biases; zeros compute the same thing.
        for name in list(out):
            m = re.match(r"^(model\.layers\.\d+\.self_attn\.[qkv]_proj)\.weight$", name)
            if m:
                out[m.group(1) + ".bias"] = torch.zeros(out[name].shape[0], dtype=out[name].dtype)
    return out


# ---------------------------------------------------------------------------- files


def read_decoder_config(path: str) -> DecoderConfig:
    """The backbone config of a checkpoint directory, from its config.json alone (a
    vision-language checkpoint's language model, ``VLM_TEXT_MODELS``)."""
    hf = read_hf_config(path)
    kind = hf.get("model_type")
    if kind in LLAVA_MODEL_TYPES:
        return DecoderConfig.from_hf(llava_text_config(hf))
    if kind in ("qwen2_5_omni", "qwen3_omni_moe"):  # a whole Omni model: the thinker's config holds the LLM's
        hf = dict(hf.get("thinker_config") or {}, model_type=kind)
    if kind in VLM_TEXT_MODELS:
        # transformers 5 nests the text model's config; 4.x wrote it at the top level
        text = dict(hf.get("text_config") or hf)
        if "vocab_size" not in text and "vocab_size" in hf:  # some versions keep it at the top
            text["vocab_size"] = hf["vocab_size"]
        if "tie_word_embeddings" in hf:
            # transformers ties the head by the top-level flag (PreTrainedModel.tie_weights reads
            # self.config's); Qwen3-VL-MoE's text_config defaults its own to true beside a false one
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        text["model_type"] = VLM_TEXT_MODELS[kind]
        hf = text
    return DecoderConfig.from_hf(hf)


def llava_text_config(hf: dict) -> dict:
    """The language model's config of a LLaVA config.json, every key filled in as transformers
    fills it (``transformers_config``); the head is tied as the whole model's config says."""
    config = transformers_config(hf)
    text = config.text_config.to_dict()
    text["tie_word_embeddings"] = bool(config.tie_word_embeddings)
    return text


def load_pretrained_llm(path: str, dtype: torch.dtype = torch.float32) -> Decoder:
    """Build a ``Decoder`` from a local HF checkpoint directory, weights cast to ``dtype``
    (whole, on the host; the training start-up reads per shard, see ``omni.models.build``)."""
    model, source = pretrained_on_meta(path)
    for p in model.parameters():  # parameters only: the rotary buffer stays fp32
        p.data = torch.empty_like(p, dtype=dtype)
    materialize([model], Sources([("", source)], SeededInit(0)), torch.device("cpu"))
    return model


def pretrained_on_meta(path: str) -> tuple[Decoder, CheckpointSource]:
    """The checkpoint's ``Decoder`` on the meta device and the source of its weights, checked
    against each other (names and shapes) before anything is read."""
    config = read_decoder_config(path)
    with torch.device("meta"):
        model = Decoder(config)
    source = CheckpointSource(path, config, read_hf_config(path).get("model_type") in EXPERTS_HIDDEN_FIRST)
    source.check({k: v.shape for k, v in model.state_dict().items()})
    return model, source


def export_pretrained(model: Decoder, path: str, max_shard_bytes: Optional[int] = None) -> None:
    """Write ``config.json`` + safetensors that ``AutoModelForCausalLM.from_pretrained`` loads.
    ``max_shard_bytes`` splits the weights into shards with a ``model.safetensors.index.json``."""
    os.makedirs(path, exist_ok=True)
    config = model.config
    hf_cfg = config.to_hf()
    sd = native_state_dict_to_hf(model.state_dict(), config)
    hf_cfg["dtype"] = hf_cfg["torch_dtype"] = str(next(iter(sd.values())).dtype).replace("torch.", "")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)
    write_safetensors(sd, path, max_shard_bytes)


def write_safetensors(sd: Tensors, path: str, max_shard_bytes: Optional[int] = None) -> None:
    """``sd`` as ``model.safetensors``, or as shards of at most ``max_shard_bytes`` with a
    ``model.safetensors.index.json`` (what transformers writes and reads)."""
    from safetensors.torch import save_file

    # safetensors refuses tensors that share storage (expert slices do): give each its own copy.
    sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}
    metadata = {"format": "pt"}
    index_path = os.path.join(path, "model.safetensors.index.json")
    if max_shard_bytes is None:
        if os.path.exists(index_path):
            os.remove(index_path)  # a stale index would make loaders read old shards
        save_file(sd, os.path.join(path, "model.safetensors"), metadata=metadata)
        return
    shards, current, size = [], {}, 0
    for k in sorted(sd):
        nbytes = sd[k].numel() * sd[k].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k] = sd[k]
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata=metadata)
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    with open(index_path, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
