"""Packed rows: several documents in one row compute exactly what each document alone does.
Also the MoE auxiliary loss, gradient flow, the output contract and the FLOPs count."""
import pytest
import torch

from omni.models.llm import Decoder, DecoderConfig, DecoderOutput

from model_helpers import randomize, rel_err

DENSE = dict(family="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
             num_heads=4, num_kv_heads=2, rope_scaling={"rope_type": "llama3", "factor": 8.0,
             "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
MOE = dict(family="qwen2_moe", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3,
           num_heads=4, num_kv_heads=2, attention_bias=True, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
           mlp_only_layers=[1], router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
LENGTHS = [5, 9, 7]


def _model(kind: str) -> Decoder:
    torch.manual_seed(0)
    return randomize(Decoder(DecoderConfig(**(DENSE if kind == "dense" else MOE)))).eval()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_row_equals_separate_documents(kind):
    model = _model(kind)
    docs = [torch.randint(0, 96, (n,)) for n in LENGTHS]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=pos).logits[0]
        alone = torch.cat([model(d[None]).logits[0] for d in docs])
        # Without the restart the documents would see each other: the check has teeth.
        unpacked = model(ids).logits[0]
    assert rel_err(packed, alone) <= 1e-5
    assert rel_err(unpacked, alone) > 1e-3


def test_one_dimensional_input_is_batch_of_one():
    model = _model("dense")
    ids = torch.randint(0, 96, (11,))
    with torch.no_grad():
        out = model(ids)
        ref = model(ids[None], position_ids=torch.arange(11)[None]).logits
    assert isinstance(out, DecoderOutput) and out.logits.shape == (1, 11, 96)
    assert torch.allclose(out.logits, ref, rtol=0, atol=1e-6)


def test_output_hidden_and_inputs_embeds():
    model = _model("moe")
    ids = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        full = model(ids)
        hid = model(inputs_embeds=model.embed(ids), output_hidden=True)
    assert hid.logits is None and hid.hidden_states.shape == (2, 10, 64)
    assert torch.allclose(model.lm_logits(hid.hidden_states), full.logits, rtol=0, atol=1e-6)
    assert torch.allclose(hid.aux_loss, full.aux_loss)


def test_moe_aux_loss_and_router_gradients():
    model = _model("moe").train()
    ids = torch.randint(0, 96, (2, 12))
    out = model(ids)
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss)
    (out.logits.float().pow(2).mean() + out.aux_loss).backward()
    moe_layers = [layer for layer in model.layers if layer.is_moe]
    assert len(moe_layers) == 2
    for layer in moe_layers:
        for p in (layer.mlp.router.weight, layer.mlp.experts.w_gate_up, layer.mlp.experts.w_down):
            assert p.grad is not None and p.grad.abs().sum() > 0

    # The aux loss alone also reaches the router (through the mean router probabilities).
    model.zero_grad()
    model(ids).aux_loss.backward()
    assert model.layers[0].mlp.router.weight.grad.abs().sum() > 0


def test_aux_loss_value_for_uniform_router():
    """Uniform probabilities: E * sum_e f_e / E = sum_e f_e = k per layer, whatever the ties pick;
    z-loss = log(E)^2 per layer (router logits are all zero)."""
    model = _model("moe")
    with torch.no_grad():
        for layer in model.layers:
            if layer.is_moe:
                layer.mlp.router.weight.zero_()
        aux = model(torch.randint(0, 96, (2, 12))).aux_loss
    c = model.config
    expected = 2 * (c.router_aux_loss_coef * c.num_experts_per_tok
                    + c.router_z_loss_coef * torch.log(torch.tensor(4.0)) ** 2)
    assert torch.allclose(aux, expected, rtol=1e-5)


def test_dense_model_has_no_aux_loss_and_init_is_seeded():
    a, b = _model("dense"), _model("dense")
    assert a(torch.randint(0, 96, (1, 4))).aux_loss is None
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    torch.manual_seed(1)
    assert not torch.equal(Decoder(DecoderConfig(**DENSE)).embed_tokens.weight, a.embed_tokens.weight)


def test_num_flops_per_token():
    dense = _model("dense")
    # Dense, untied: active params = every matrix except the embedding lookup (norms are noise).
    matrices = sum(p.numel() for n, p in dense.named_parameters() if "norm" not in n and "embed" not in n)
    assert dense.num_active_params() == matrices
    c = dense.config
    assert dense.num_flops_per_token(32) == 6 * matrices + 12 * c.num_layers * c.num_heads * 16 * 32

    moe = _model("moe")
    total = sum(p.numel() for n, p in moe.named_parameters() if "norm" not in n and "embed" not in n)
    c = moe.config
    inactive = 2 * (c.num_experts - c.num_experts_per_tok) * 3 * 64 * c.moe_intermediate_size
    # Only the top-k experts count; q/k/v biases are not matmul FLOPs.
    biases = sum(p.numel() for n, p in moe.named_parameters() if n.endswith("bias"))
    assert moe.num_active_params() == total - inactive - biases


def test_hydra_structured_config_builds_the_same_model():
    from omegaconf import OmegaConf

    node = OmegaConf.merge(OmegaConf.structured(DecoderConfig), DENSE)
    with pytest.raises(Exception, match="hiden_size"):  # a typo in an override names the key
        OmegaConf.merge(node, {"hiden_size": 8})
    torch.manual_seed(0)
    from_node = Decoder(node)
    assert isinstance(from_node.config, DecoderConfig) and from_node.config.rope_scaling["factor"] == 8.0
    torch.manual_seed(0)
    ref = Decoder(DecoderConfig(**DENSE))
    assert torch.equal(from_node.layers[1].mlp.up_proj.weight, ref.layers[1].mlp.up_proj.weight)
