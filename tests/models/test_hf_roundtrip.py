"""HF checkpoint IO: export -> transformers, load -> export -> load, both MoE layouts, shards,
and the errors a user sees for a bad path or an unsupported model."""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from omni.models.hf_io import export_pretrained, load_pretrained_llm as load_pretrained
from omni.models.llm import Decoder, DecoderConfig

from model_helpers import randomize, rel_err

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
NATIVE = {
    "llama_llama3_tied": dict(family="llama", tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
    "llama_yarn_bias": dict(family="llama", attention_bias=True, head_dim=32,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    # attention_bias=False: export writes the zero q/k/v biases Qwen2 always has.
    "qwen2_no_bias": dict(family="qwen2"),
    "mixtral": dict(family="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    "qwen2_moe": dict(family="qwen2_moe", num_layers=3, attention_bias=True, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[0]),
    # QK-norm; head_dim apart from hidden / heads; o_proj's bias too
    "qwen3_bias_head_dim": dict(family="qwen3", attention_bias=True, head_dim=24),
    "qwen3_moe": dict(family="qwen3_moe", num_layers=3, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0]),
}


def _native(name: str) -> Decoder:
    torch.manual_seed(0)
    return randomize(Decoder(DecoderConfig(**{**COMMON, **NATIVE[name]}))).eval()


def _hf_moe(model_type: str):
    torch.manual_seed(0)
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
    if model_type == "mixtral":
        kw.update(num_local_experts=4)
    elif model_type == "qwen3_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    else:
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), attn_implementation="eager")
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    return hf.eval()


@pytest.mark.parametrize("name", list(NATIVE))
def test_export_loads_in_transformers_with_same_logits(name, tmp_path):
    model = _native(name)
    export_pretrained(model, str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert hf.config.model_type == model.config.family
    ids = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        ours = model(ids).logits
    assert rel_err(ours, ref) <= 1e-5
    # Our own loader reads the export back, and config.json is a fixed point of from_hf/to_hf
    # (from_hf normalises what HF cannot express, e.g. Qwen2's always-on biases).
    with torch.no_grad():
        assert rel_err(load_pretrained(str(tmp_path))(ids).logits, ours) <= 1e-6
    written = json.loads((tmp_path / "config.json").read_text())
    written.pop("dtype"), written.pop("torch_dtype")
    assert DecoderConfig.from_hf(written).to_hf() == written


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_load_export_load_is_identity(model_type, tmp_path):
    hf = _hf_moe(model_type)
    hf.save_pretrained(tmp_path / "hf")  # per-expert legacy names (transformers 5.24 save format)
    first = load_pretrained(str(tmp_path / "hf"))
    export_pretrained(first, str(tmp_path / "ours"), max_shard_bytes=40_000)  # sharded + index
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    second = load_pretrained(str(tmp_path / "ours"))
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert first.config == second.config


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_fused_expert_layout_loads(model_type, tmp_path):
    """transformers 5.x in-memory names (``mlp.experts.gate_up_proj`` 3D) load like the per-expert ones."""
    hf = _hf_moe(model_type)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf.config.to_json_file(str(tmp_path / "config.json"))
    ours = load_pretrained(str(tmp_path))
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, hf(input_ids=ids).logits) <= 1e-5


def test_sharded_hf_checkpoint_and_dtype(tmp_path):
    hf = _hf_moe("qwen2_moe")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ref = load_pretrained(str(tmp_path))
    assert torch.equal(ours.layers[0].mlp.experts.w_down, ref.layers[0].mlp.experts.w_down.bfloat16())


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist.*does not exist"):
        load_pretrained(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        load_pretrained(str(tmp_path))
    cfg = DecoderConfig(**COMMON).to_hf()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="sliding"):
        load_pretrained(str(tmp_path))


def test_transformers_4x_config_layout():
    """Older config.json files keep rope_theta / rope_scaling (with "type") at the top level."""
    cfg = DecoderConfig.from_hf({**DecoderConfig(**COMMON).to_hf(), "rope_parameters": None, "rope_theta": 5e5,
                                 "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_theta == 5e5 and cfg.rope_type() == "linear" and cfg.rope_scaling["factor"] == 2.0
    mixtral = DecoderConfig(**{**COMMON, **NATIVE["mixtral"]}).to_hf()
    for key in ("rope_parameters", "rope_theta", "rope_scaling"):
        mixtral.pop(key)
    assert DecoderConfig.from_hf(mixtral).rope_theta == 1e6  # Mixtral's default theta, as in transformers


def test_a_checkpoint_of_a_newer_transformers_type_is_refused_in_one_line(tmp_path):
    """A config.json saved by a newer transformers for a model type the installed one lacks
    names both versions (pyproject.toml pins the range the parity tests pass on); a newer file of
    a known type, or an older one of an unknown type, reads as before."""
    import transformers

    from omni.models.hf_checkpoint import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen9_vl", "transformers_version": "99.1.0"}))
    with pytest.raises(ValueError) as err:
        read_hf_config(str(tmp_path))
    line = str(err.value)
    assert "\n" not in line and "99.1.0" in line and transformers.__version__ in line and "'qwen9_vl'" in line
    for config in ({"model_type": "qwen3", "transformers_version": "99.1.0"},
                   {"model_type": "qwen9_vl", "transformers_version": "4.0.0"}):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert read_hf_config(str(tmp_path)) == config


def test_hidden_first_experts_are_read_by_region(tmp_path):
    """Qwen3-VL-MoE's released files store a layer's experts fused and hidden first; a rank that
    holds some experts and rows (expert or FSDP sharding) reads just those, transposed into
    Omni's [E, 2I, H] / [E, H, I], whichever layout the file has."""
    from hf_family_helpers import save_tiny_qwen3_vl_moe
    from omni.models.hf_io import CheckpointSource, read_decoder_config

    save_tiny_qwen3_vl_moe(tmp_path)
    config = read_decoder_config(str(tmp_path))
    source = CheckpointSource(str(tmp_path), config, experts_hidden_first=True)
    stored = source.reader.tensors(["model.language_model.layers.0.mlp.experts.gate_up_proj",
                                    "model.language_model.layers.0.mlp.experts.down_proj"])
    gate_up, down = (t.transpose(1, 2) for t in stored.values())  # Omni's layout
    assert source.shape("layers.0.mlp.experts.w_gate_up") == tuple(gate_up.shape) == (5, 48, 40)
    index = (slice(1, 4), slice(10, 30), slice(5, 40))
    assert torch.equal(source.read("layers.0.mlp.experts.w_gate_up", None, None, index), gate_up[index])
    index = (slice(2, 5), slice(0, 40), slice(7, 19))
    assert torch.equal(source.read("layers.0.mlp.experts.w_down", None, None, index), down[index])
