"""LoRA (``model.lora``, omni/models/lora.py): what trains, the starting point, merging, names,
config errors, ``model.init_from`` from a run without adapters, and a run from a Hugging Face
family directory that resumes exactly and exports merged (transformers gives the adapted
model's logits) and as a peft adapter (peft on the exported base gives them too).
The layouts (FSDP2, TP, PP) are in tests/parallel/test_lora_layouts.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from omni.errors import ConfigError, UserError
from omni.models import lora
from omni.models.build import build_model
from omni.models.config import EncoderSlot, LoraConfig, ModelConfig

pytest.importorskip("peft")

LLM = dict(family="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
           num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
SIGLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16,
              patch_size=2)
SLOTS = {"vision": EncoderSlot(name="siglip", params=SIGLIP)}
LLM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _build(seed: int = 3, **lora_kw) -> nn.Module:
    cfg = ModelConfig(**LLM, lora=LoraConfig(**lora_kw)) if lora_kw else ModelConfig(**LLM)
    return build_model(cfg, SLOTS, vocab_needed=96, seed=seed)


def _logits(model, ids: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of one row of text with (optionally) an image of 4 x 4 patches written at its first 16 tokens."""
    with torch.no_grad():
        h = model.llm.embed_tokens(ids)
        if image is not None:
            rows = model.projectors["image"](model.encoders["image"](image, torch.tensor([[4, 4]])),
                                             torch.tensor([[4, 4]]))
            h = torch.cat([rows, h[16:]])
        out = model.llm(inputs_embeds=h[None], position_ids=torch.arange(ids.numel())[None], output_hidden=True)
        return model.llm.lm_logits(out.hidden_states[0])


def _randomise_adapters(model, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def test_what_trains_and_the_start_is_the_base_model():
    """Trainable: r * (in + out) per adapted linear of the LLM, plus the tower and the projector
    (not adapted, not frozen); every base weight is the unadapted model's (same seed), so with B
    at zero the logits are the base model's."""
    plain, adapted = _build(), _build(rank=4, alpha=8.0)
    expected = sum(4 * (m.in_features + m.out_features) for n, m in plain.llm.named_modules()
                   if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in LLM_TARGETS)
    expected += sum(p.numel() for part in (plain.encoders, plain.projectors) for p in part.parameters())
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == expected
    assert {n for n, p in adapted.named_parameters() if p.requires_grad and n.startswith("llm.")} == \
        {n for n, _ in adapted.named_parameters() if ".lora_" in n}
    sd = adapted.state_dict()
    assert lora.without_adapters(sd).keys() == plain.state_dict().keys()
    assert all(torch.equal(t, lora.without_adapters(sd)[n]) for n, t in plain.state_dict().items())
    lora_b = [t for n, t in sd.items() if ".lora_B." in n]
    lora_a = [t for n, t in sd.items() if ".lora_A." in n]
    assert len(lora_a) == len(lora_b) == 2 * len(LLM_TARGETS) and all(not t.any() for t in lora_b)
    assert all(0 < float(t.abs().max()) <= t.shape[1] ** -0.5 for t in lora_a)  # peft's kaiming-uniform bound
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(adapted, ids), _logits(plain, ids))


def test_the_tower_too_all_linear_and_merging_keeps_the_outputs():
    """Adapters on every linear layer of the LLM and the tower: merging them into the base
    weights (what omni export writes) gives the adapted model's logits, under the plain names."""
    adapted = _build(rank=2, alpha=4.0, targets=["all-linear"], modules=["llm", "encoder.vision"])
    linears = {n for n, m in _build().named_modules() if isinstance(m, nn.Linear)}
    assert set(lora.adapted_layers(adapted)) == {n for n in linears if n.startswith(("llm.", "encoders."))} - {"llm.lm_head"}
    assert all(not p.requires_grad for n, p in adapted.encoders.named_parameters() if ".lora_" not in n)
    assert all(p.requires_grad for p in adapted.projectors.parameters())
    _randomise_adapters(adapted)
    ids = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(1))
    image = torch.randn(16, 12, generator=torch.Generator().manual_seed(2))
    want = _logits(adapted, ids, image)
    merged = lora.merge(copy.deepcopy(adapted))
    assert not lora.is_adapted(merged)
    assert set(merged.state_dict()) == set(_build().state_dict())
    got = _logits(merged, ids, image)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert not torch.allclose(_logits(lora.unload(copy.deepcopy(adapted)), ids, image), want, atol=1e-4)


def test_config_mistakes_are_one_line(monkeypatch):
    checks = [
        (LoraConfig(rank=-1), "model.lora.rank=-1 must be an integer >= 0"),
        (LoraConfig(rank=4, alpha=0.0), "model.lora.alpha=0.0 must be > 0"),
        (LoraConfig(rank=4, dropout=1.0), "model.lora.dropout=1.0 must be in [0, 1)"),
        (LoraConfig(rank=4, modules=["llm", "encoders.audio"]), "model.lora.modules: 'encoders.audio' names no "
                                                                "module of this model"),
        (LoraConfig(rank=4, modules=["projectors"]), "model.lora.modules: projector.vision is a projector"),
        (LoraConfig(rank=4, targets=[]), "model.lora.targets is empty"),
    ]
    for cfg, message in checks:
        with pytest.raises(ConfigError, match=None) as err:
            lora.check(cfg, ["vision"])
        assert message in str(err.value) and "\n" not in str(err.value)
    lora.check(LoraConfig(rank=0, alpha=-1.0), ["vision"])  # off: nothing else is read
    with pytest.raises(ConfigError) as err:
        _build(rank=4, targets=["qkv"])
    assert str(err.value).startswith("model.lora.targets=['qkv'] matches no linear layer of llm (its linear layers: "
                                     "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj); name some of them, or use [all-linear]")
    with pytest.raises(ConfigError, match="llm.lm_head is the LM head"):
        _build(rank=4, targets=["lm_head", "q_proj"])
    monkeypatch.setitem(__import__("sys").modules, "peft", None)
    with pytest.raises(UserError, match=r"model.lora.rank > 0 needs peft: pip install 'omni-mm\[lora\]'"):
        lora.check(LoraConfig(rank=4), [])


def test_init_from_a_run_without_adapters(tmp_path):
    """model.init_from: a LoRA run starts from a checkpoint of the same model without adapters
    (the LLaVA recipe's stage 2 after stage 1): the base weights are the checkpoint's, the
    adapters start as initialised. Another model is still refused in one line."""
    from omni.runtime.checkpoint import Checkpointer
    from omni.runtime.config import CheckpointConfig, OptimConfig
    from omni.runtime.optim import PartOptimizers

    stage1 = _build(seed=5)
    saved = Checkpointer(CheckpointConfig(), tmp_path / "stage1").save(
        1, PartOptimizers([stage1], OptimConfig(), 10), loader_state={})
    stage2 = _build(seed=6, rank=4)
    _randomise_adapters(stage2)
    adapters = {n: t.clone() for n, t in stage2.state_dict().items() if ".lora_" in n}
    Checkpointer(CheckpointConfig(), tmp_path / "stage2").load_weights(saved, [stage2])
    got = stage2.state_dict()
    assert all(torch.equal(lora.without_adapters(got)[n], t) for n, t in stage1.state_dict().items())
    assert all(torch.equal(got[n], t) for n, t in adapters.items())
    other = build_model(ModelConfig(**{**LLM, "num_layers": 3}, lora=LoraConfig(rank=4)), SLOTS, 96, seed=0)
    with pytest.raises(ConfigError, match="holds another model"):
        Checkpointer(CheckpointConfig(), tmp_path / "other").load_weights(saved, [other])


# peft asks transformers' model a question transformers 5 renamed
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_lora_run_resumes_exactly_and_exports_merged_and_as_adapter(demo_root, tmp_path, capsys):
    """Fine-tuning a tiny Qwen2.5-VL directory with LoRA on its LLM (the projector training too):
    the LLM's base weights stay the checkpoint's; a run stopped at step 2 and resumed gives the
    straight run's losses bit for bit; ``omni export`` (merged) loads in transformers with the
    adapted model's logits, and ``--adapter`` writes the base and a peft adapter that peft loads
    onto it with those logits again."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from recipe_helpers import step_losses, train
    from recipes.cli import main
    from recipes.model_source import load_model
    from PIL import Image

    from hf_family_helpers import hf_inputs, model_logits
    from test_export_cmd import IMAGE, _check_export, _family_run, _prompt

    lora_keys = ["model.lora.rank=4", "model.lora.alpha=8", "trainer.max_steps=4", "optim.lr=1e-2",
                 "data.global_batch_size=2"]
    straight, over = _family_run(demo_root, tmp_path, "straight")
    train(over + lora_keys)
    lora_keys.append("checkpoint.every=2")
    run, over = _family_run(demo_root, tmp_path, "run")
    train(over + lora_keys + ["trainer.stop_at=2"])
    train(over + lora_keys)
    assert len(step_losses(run)) == 4 and step_losses(run) == step_losses(straight)

    adapted = load_model(str(run), merge_adapters=False)
    start = load_model(str(tmp_path / "hf"))
    base = lora.without_adapters(dict(adapted.model.named_parameters()))
    assert all(torch.equal(p, base[n]) for n, p in start.model.llm.named_parameters(prefix="llm"))
    assert any(not torch.equal(p, base[n]) for n, p in start.model.projectors.named_parameters(prefix="projectors"))
    assert all(t.any() for n, t in adapted.model.state_dict().items() if ".lora_B." in n)

    assert main(["export", str(run), "--out", str(tmp_path / "merged")]) == 0
    _check_export(tmp_path / "merged", adapted)

    assert main(["export", str(run), "--adapter", "--out", str(tmp_path / "apart")]) == 0
    mb, _ = _prompt(adapted)
    want = model_logits(adapted.model, mb)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "apart").eval()
    inputs = hf_inputs(tmp_path / "apart", [Image.fromarray(IMAGE)], mb.input_ids.numpy(),
                       adapted.tokenizer.placeholder_ids["image"])
    with torch.no_grad():
        without = hf(**inputs).logits[0]
        with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "apart" / "adapter").eval()(**inputs).logits[0]
    assert (with_adapter - want).abs().max() <= 1e-5 * want.abs().max()
    assert (without - want).abs().max() > 1e-3 * want.abs().max()  # the adapters matter
    # --adapter is for runs trained with LoRA: one line for anything else, before any writing
    assert main(["export", str(tmp_path / "hf"), "--adapter", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the exports' progress bars
    assert err.startswith("omni: error: --adapter: ") and "is a Hugging Face directory, not a run trained with LoRA" in err
    assert not (tmp_path / "no").exists()
