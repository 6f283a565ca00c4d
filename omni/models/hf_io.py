"""Load and export HF checkpoints (local directories) for the native decoder.

A checkpoint is ``config.json`` + ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Supported: LlamaForCausalLM, Qwen2ForCausalLM,
MixtralForCausalLM, Qwen2MoeForCausalLM.

Native names are HF names without the ``model.`` prefix, except for the MoE parts:

    HF (per expert, what save_pretrained writes)         native
    mlp.gate.weight           (mixtral: block_sparse_moe.*)   mlp.router.weight
    mlp.experts.{e}.gate_proj / up_proj   (mixtral: w1 / w3)  mlp.experts.w_gate_up[e] = cat(gate, up)
    mlp.experts.{e}.down_proj             (mixtral: w2)       mlp.experts.w_down[e]
    HF (fused, transformers 5.x in-memory layout)
    mlp.experts.gate_up_proj / mlp.experts.down_proj          mlp.experts.w_gate_up / w_down

Both HF layouts load; export writes the per-expert layout, which transformers 4.x and 5.x read.
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from typing import Dict, Optional

import torch

from .hf_checkpoint import CheckpointReader, read_hf_config
from .llm.config import DecoderConfig
from .llm.decoder import Decoder

Tensors = Dict[str, torch.Tensor]

# Per-expert projection names in HF checkpoints: (gate, up, down).
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}
_PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")


def hf_state_dict_to_native(sd: Tensors, config: DecoderConfig) -> Tensors:
    """HF ``*ForCausalLM`` tensor names -> ``Decoder.state_dict()`` names (either expert layout)."""
    out: Tensors = {}
    experts: Dict[int, Dict[int, Dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, t in sd.items():
        if name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out[name] = t
            continue  # tied: the head is the embedding (some checkpoints still store a copy)
        if name.endswith("rotary_emb.inv_freq"):
            continue  # older checkpoints store the derived RoPE buffer; we recompute it
        if name.startswith("model."):
            name = name[len("model."):]
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's legacy module name
        m = _PER_EXPERT.match(name)
        if m:
            experts[int(m.group(1))][int(m.group(2))][m.group(3)] = t
            continue
        name = re.sub(r"\.mlp\.gate\.weight$", ".mlp.router.weight", name)
        name = re.sub(r"\.mlp\.experts\.gate_up_proj$", ".mlp.experts.w_gate_up", name)
        name = re.sub(r"\.mlp\.experts\.down_proj$", ".mlp.experts.w_down", name)
        out[name] = t
    if experts:
        gate_n, up_n, down_n = _EXPERT_NAMES.get(config.family, _EXPERT_NAMES["qwen2_moe"])
        for layer, per in experts.items():
            try:
                ws = [per[e] for e in range(config.num_experts)]
                out[f"layers.{layer}.mlp.experts.w_gate_up"] = torch.stack([torch.cat([w[gate_n], w[up_n]]) for w in ws])
                out[f"layers.{layer}.mlp.experts.w_down"] = torch.stack([w[down_n] for w in ws])
            except KeyError as e:
                raise ValueError(
                    f"checkpoint layer {layer} lacks expert weight {e} (expected {config.num_experts} experts with "
                    f"{gate_n}/{up_n}/{down_n}); the checkpoint does not match config.json."
                ) from None
    return out


def native_state_dict_to_hf(sd: Tensors, config: DecoderConfig, fused_experts: bool = False) -> Tensors:
    """``Decoder.state_dict()`` names -> HF names. Experts are written per expert (the layout
    ``save_pretrained`` writes) unless ``fused_experts`` (transformers 5.x in-memory layout)."""
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
                out[hf.replace(".w_gate_up", ".gate_up_proj").replace(".w_down", ".down_proj")] = t
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


def _read_config(path: str) -> DecoderConfig:
    return DecoderConfig.from_hf(read_hf_config(path))


def load_pretrained(path: str, dtype: torch.dtype = torch.float32) -> Decoder:
    """Build a ``Decoder`` from a local HF checkpoint directory, weights cast to ``dtype``."""
    config = _read_config(path)
    hf_sd = CheckpointReader(path).tensors()
    sd = {k: v.to(dtype) for k, v in hf_state_dict_to_native(hf_sd, config).items()}

    # Build on the meta device: no random init for weights that are overwritten anyway.
    with torch.device("meta"):
        model = Decoder(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path!r} does not match its config.json: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]} ({len(missing)} / {len(unexpected)} in all)."
        )
    for k, v in expected.items():
        if v.shape != sd[k].shape:
            raise ValueError(f"checkpoint {path!r}: {k} has shape {tuple(sd[k].shape)}, config.json implies {tuple(v.shape)}.")
    model.load_state_dict(sd, assign=True)
    model.rotary.reset_parameters(device=torch.device("cpu"))
    return model


def export_pretrained(model: Decoder, path: str, max_shard_bytes: Optional[int] = None) -> None:
    """Write ``config.json`` + safetensors that ``AutoModelForCausalLM.from_pretrained`` loads.
    ``max_shard_bytes`` splits the weights into shards with a ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = model.config
    hf_cfg = config.to_hf()
    sd = native_state_dict_to_hf(model.state_dict(), config)
    # safetensors refuses tensors that share storage (expert slices do): give each its own copy.
    sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}
    dtype = next(iter(sd.values())).dtype
    hf_cfg["dtype"] = hf_cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)

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
