"""Native decoder vs transformers: identical logits for every supported family and RoPE variant.

Each case builds a tiny HF model with random weights, saves it with ``save_pretrained`` (the
on-disk layout real checkpoints have), loads it with ``load_pretrained`` and compares logits.
"""
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from omni.models.hf_io import load_pretrained_llm as load_pretrained
from omni.models.llm import DecoderConfig
from omni.models.llm.rope import rope_parameters

from model_helpers import randomize, rel_err

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

CASES = {
    "llama_gqa_llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama_tied_yarn": ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})),
    "llama_bias_linear": ("llama", dict(attention_bias=True, num_key_value_heads=4, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    # max_position_embeddings < seq: dynamic NTK rescales the base for this length.
    "llama_dynamic_long": ("llama", dict(max_position_embeddings=16, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen2_bias_tied": ("qwen2", dict(tie_word_embeddings=True, num_hidden_layers=3)),
    "mixtral_top2of4": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe_norm_topk": ("qwen2_moe", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe_no_norm_sparse_step": ("qwen2_moe", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2)),
    # Qwen3: QK-norm, a head_dim apart from hidden / heads, biases on all four projections.
    "qwen3_head_dim_bias_tied": ("qwen3", dict(head_dim=24, attention_bias=True, tie_word_embeddings=True,
                                               num_hidden_layers=3)),
    "qwen3_moe_norm_topk_dense_layer": ("qwen3_moe", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], head_dim=8)),
    "qwen3_moe_no_norm_sparse_step": ("qwen3_moe", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
        decoder_sparse_step=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    torch.manual_seed(0)
    hf_cfg = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    randomize(hf)
    hf.eval()  # no router jitter / dropout
    hf.save_pretrained(tmp_path)

    ours = load_pretrained(str(tmp_path))
    assert ours.config.family == model_type
    ids = torch.randint(0, BASE["vocab_size"], (2, 24))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = ours(ids)
    assert out.logits.shape == ref.shape
    assert rel_err(out.logits, ref) <= 1e-5
    assert (out.aux_loss is not None) == (ours.config.num_experts > 0)


def test_layer_kinds_follow_qwen2_moe_rules(tmp_path):
    _, overrides = CASES["qwen2_moe_norm_topk"]
    cfg = DecoderConfig.from_hf({**BASE, **overrides, "model_type": "qwen2_moe"})
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
    _, overrides = CASES["qwen2_moe_no_norm_sparse_step"]
    cfg = DecoderConfig.from_hf({**BASE, **overrides, "model_type": "qwen2_moe"})
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, False]


def test_qwen3_takes_its_config_class_defaults_where_the_file_is_silent():
    """Qwen3's config class defaults head_dim to 128 (not hidden / heads); Qwen3-MoE's writes
    its expert count as num_local_experts (the released files: num_experts)."""
    cfg = DecoderConfig.from_hf({**BASE, "model_type": "qwen3"})
    assert cfg.resolved_head_dim() == 128 and cfg.qk_norm() and not cfg.attention_bias
    moe = DecoderConfig.from_hf({**BASE, "model_type": "qwen3_moe", "num_local_experts": 10, "moe_intermediate_size": 32})
    assert (moe.num_experts, moe.shared_expert_intermediate_size, moe.num_experts_per_tok) == (10, 0, 8)
    with pytest.raises(ValueError, match="layer_types has 1 'sliding_attention' layers"):
        DecoderConfig.from_hf({**BASE, "model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]})


ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 32},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                              "truncate": False, "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.3 * i for i in range(8)]},
}


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("seq_len", [None, 40, 200])
def test_rope_parameters_match_transformers(name, seq_len):
    """inv_freq and attention scaling equal transformers' ROPE_INIT_FUNCTIONS, also for lengths
    past the trained one where dynamic NTK / LongRoPE change the frequencies."""
    hf_cfg = AutoConfig.for_model("llama", **{**BASE, "rope_parameters": {"rope_theta": 10000.0, **ROPES[name]}})
    ours = DecoderConfig.from_hf(hf_cfg.to_dict())
    rope_type = ROPES[name]["rope_type"]
    if rope_type == "default":
        ref_inv, ref_scale = type(AutoModelForCausalLM.from_config(hf_cfg).model.rotary_emb).compute_default_rope_parameters(hf_cfg)
    else:
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, None, seq_len=seq_len)
    inv, scale = rope_parameters(ours, seq_len=seq_len)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
    assert math.isclose(scale, ref_scale, rel_tol=1e-9)


def test_dynamic_rope_is_default_within_trained_length():
    cfg = DecoderConfig(hidden_size=64, num_heads=4, max_position_embeddings=64,
                        rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    default = DecoderConfig(hidden_size=64, num_heads=4, max_position_embeddings=64)
    for seq_len in (None, 10, 64):
        assert torch.equal(rope_parameters(cfg, seq_len)[0], rope_parameters(default)[0])
    assert not torch.equal(rope_parameters(cfg, 65)[0], rope_parameters(default)[0])
