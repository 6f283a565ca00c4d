"""OmniModel: placeholder replacement, global-batch loss normalisation, freezing, the MoE
backbone, and building the model from config."""
from __future__ import annotations

import math

import pytest
import torch

from dataloading.construct.batch import IGNORE_INDEX, MediaInputs, MicroBatch
from omni.errors import ConfigError
from omni.models.build import build_model
from omni.models.config import EncoderSlot, ModelConfig
from omni.models.encoders.siglip import SiglipEncoder
from omni.models.encoders.whisper import WhisperEncoder
from omni.models.llm import Decoder, DecoderConfig
from omni.models.multimodal import LossParts, OmniModel
from omni.models.projector import Projector

VOCAB = 64
IMG_ID, AUD_ID = 62, 63  # placeholder token ids
TEXT_HI = 60  # text tokens are drawn from [0, TEXT_HI)
LLM = dict(family="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
           num_heads=4, num_kv_heads=2)
MOE = dict(family="qwen2_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
           num_heads=4, num_kv_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=24, router_aux_loss_coef=0.01)
SIGLIP = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
              image_size=8, patch_size=4)  # 48-dim patches, a 2x2 learned position grid
WHISPER = dict(num_mel_bins=8, d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
               max_source_positions=16)
PATCH_DIM = 3 * 4 * 4


def _siglip() -> SiglipEncoder:
    return SiglipEncoder(SiglipEncoder.build_config(SIGLIP))


def _model(llm: dict = LLM, audio: bool = False, frozen: set[str] | None = None, **llm_over) -> OmniModel:
    torch.manual_seed(0)
    decoder = Decoder(DecoderConfig(**{**llm, **llm_over}))
    encoders = {"image": _siglip()}
    if audio:
        encoders["audio"] = WhisperEncoder(WhisperEncoder.build_config(WHISPER))
    projectors = {m: Projector(e.output_dim, decoder.config.hidden_size) for m, e in encoders.items()}
    return OmniModel(decoder, encoders, projectors, frozen=frozen)


# ------------------------------------------------------------------------------------------
# Hand-built packed batches.
#
# A sample is (prompt_len, image grids, response_len): prompt text, then one placeholder run
# per image (grid_h * grid_w ids), then the response. labels[t] = ids[t+1] where t+1 is in the
# response; IGNORE_INDEX on the prompt, on the placeholders and on the sample's last position.


def _make_sample(gen: torch.Generator, prompt: int, grids: list[tuple[int, int]], response: int):
    ids = [torch.randint(0, TEXT_HI, (prompt,), generator=gen)]
    feats, local_pos = [], []
    at = prompt
    for gh, gw in grids:
        n = gh * gw
        ids.append(torch.full((n,), IMG_ID))
        feats.append(torch.randn(n, PATCH_DIM, generator=gen))
        local_pos.append(torch.arange(at, at + n))
        at += n
    ids.append(torch.randint(0, TEXT_HI, (response,), generator=gen))
    ids = torch.cat(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    start = max(at, 1)  # first target: the first response token (no position predicts token 0)
    labels[start - 1 : len(ids) - 1] = ids[start:]
    return dict(ids=ids, labels=labels, grids=list(grids), feats=feats, pos=local_pos)


def _pack(samples: list[dict]) -> MicroBatch:
    ids, pos_ids, labels, feats, grids, positions, ntok = [], [], [], [], [], [], []
    offset = 0
    for s in samples:
        n = len(s["ids"])
        ids.append(s["ids"])
        labels.append(s["labels"])
        pos_ids.append(torch.arange(n))
        for f, g, p in zip(s["feats"], s["grids"], s["pos"]):
            feats.append(f)
            grids.append(g)
            positions.append(p + offset)
            ntok.append(g[0] * g[1])
        offset += n
    lengths = torch.tensor([0] + [len(s["ids"]) for s in samples])
    media = {}
    if grids:
        media["image"] = MediaInputs(
            features=torch.cat(feats),
            sizes=torch.tensor(grids, dtype=torch.int64),
            num_tokens=torch.tensor(ntok, dtype=torch.int64),
            positions=torch.cat(positions),
        )
    return MicroBatch(
        input_ids=torch.cat(ids), position_ids=torch.cat(pos_ids), labels=torch.cat(labels),
        cu_seqlens=lengths.cumsum(0).to(torch.int32), media=media,
    )


def _global_batch() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    specs = [
        (3, [(2, 2)], 5),          # one square image
        (0, [], 9),                # text only, every position but the last is a target
        (2, [(1, 3), (2, 1)], 2),  # two images of different grids (position table interpolated)
        (4, [], 3),                # text with a prompt
        (1, [(3, 2)], 7),
        (0, [], 14),
    ]
    return [_make_sample(gen, *spec) for spec in specs]


def _capture_llm_inputs(model: OmniModel) -> dict:
    seen = {}

    def hook(module, args):  # the first block's input is the embedded row
        seen["embeds"] = args[0]

    model.llm.layers[0].register_forward_pre_hook(hook)
    return seen


# ------------------------------------------------------------------------------------------


def test_placeholders_are_replaced_by_projected_encoder_outputs():
    model = _model(audio=True)
    samples = _global_batch()[:3]
    mb = _pack(samples)
    # An audio clip of 7 mel frames -> 4 tokens, written over 4 placeholder ids in sample 1's text.
    n_frames, n_aud = 7, 4
    aud_pos = torch.arange(1, 1 + n_aud) + len(samples[0]["ids"])
    mb.input_ids[aud_pos] = AUD_ID
    mb.labels[aud_pos - 1] = IGNORE_INDEX
    mb.labels[aud_pos] = IGNORE_INDEX
    mb.media["audio"] = MediaInputs(
        features=torch.randn(n_frames, WHISPER["num_mel_bins"]), sizes=torch.tensor([[n_frames]]),
        num_tokens=torch.tensor([n_aud]), positions=aud_pos,
    )
    seen = _capture_llm_inputs(model)
    parts = model(mb)
    assert isinstance(parts, LossParts) and parts.aux_loss is None
    assert parts.num_targets == mb.num_target_tokens > 0

    fed = seen["embeds"][0].detach()
    img, aud = mb.media["image"], mb.media["audio"]
    with torch.no_grad():
        want_img = model.projectors["image"](model.encoders["image"](img.features, img.sizes))
        want_aud = model.projectors["audio"](model.encoders["audio"](aud.features, aud.sizes))
        text_emb = model.llm.embed_tokens(mb.input_ids)
    assert want_img.shape[0] == img.positions.numel() and want_aud.shape[0] == n_aud
    torch.testing.assert_close(fed[img.positions], want_img, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fed[aud.positions], want_aud, rtol=1e-6, atol=1e-6)
    is_text = torch.ones(mb.num_tokens, dtype=torch.bool)
    is_text[img.positions] = False
    is_text[aud.positions] = False
    assert torch.equal(fed[is_text], text_emb[is_text])
    # The placeholder's own embedding must not leak through.
    assert not torch.allclose(fed[img.positions], text_emb[img.positions])

    parts.ce_sum.backward()
    for name in ("image", "audio"):
        for module in (model.encoders[name], model.projectors[name]):
            grads = [p.grad for p in module.parameters() if p.requires_grad]
            assert grads and all(g is not None for g in grads), name
            assert sum(g.abs().sum() for g in grads) > 0, name
    emb_grad = model.llm.embed_tokens.weight.grad
    # Text tokens at loss positions get gradient; the placeholder rows (overwritten, never a
    # target, untied head) get none.
    at_loss = is_text & (mb.labels != IGNORE_INDEX)
    assert emb_grad[mb.input_ids[at_loss]].abs().sum(-1).gt(0).all()
    assert emb_grad[IMG_ID].abs().sum() == 0 and emb_grad[AUD_ID].abs().sum() == 0


def test_placeholder_count_mismatch_is_an_error():
    model = _model()
    mb = _pack(_global_batch()[:1])
    mb.media["image"].positions = mb.media["image"].positions[:-1]
    with pytest.raises(RuntimeError, match="image encoder produced 4 tokens for 3 placeholders"):
        model(mb)


def _loss_and_grads(model: OmniModel, mbs: list[MicroBatch]):
    model.zero_grad(set_to_none=True)
    total_targets = sum(mb.num_target_tokens for mb in mbs)
    loss_value = 0.0
    for mb in mbs:
        parts = model(mb)
        assert parts.num_targets == mb.num_target_tokens
        loss = parts.ce_sum / total_targets
        loss.backward()
        loss_value += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss_value, grads


def test_loss_is_normalised_over_the_global_batch():
    model = _model()
    samples = _global_batch()
    packed = [_pack(samples)]
    # Uneven target counts per micro-batch, and one micro-batch without images.
    split = [_pack(samples[0:1]), _pack(samples[1:4:2]), _pack([samples[2], samples[4], samples[5]])]
    assert sorted(s for mb in split for s in mb.input_ids.tolist()) == sorted(packed[0].input_ids.tolist())
    assert "image" not in split[1].media and {len(mb.media) for mb in split} == {0, 1}

    loss_a, grads_a = _loss_and_grads(model, packed)
    loss_b, grads_b = _loss_and_grads(model, split)

    assert math.isclose(loss_a, loss_b, rel_tol=1e-5, abs_tol=1e-6)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads_a) == set(grads_b) == trainable
    for name in trainable:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(grads_a[n].abs().sum() > 0 for n in grads_a if n.startswith("encoders.image."))

    # The check has teeth: the micro-batches hold different numbers of targets, so averaging
    # per-micro-batch means weights tokens differently and gives other gradients.
    assert len({mb.num_target_tokens for mb in split}) > 1
    model.zero_grad(set_to_none=True)
    per_mb = [model(mb) for mb in split]
    mean_of_means = sum(p.ce_sum / p.num_targets for p in per_mb) / len(per_mb)
    mean_of_means.backward()
    differs = [n for n, p in model.named_parameters()
               if p.grad is not None and not torch.allclose(p.grad, grads_a[n], rtol=1e-3, atol=1e-6)]
    assert differs


def test_frozen_encoder_gets_no_gradient_but_its_projector_trains():
    model = _model(frozen={"image"})
    enc = model.encoders["image"]
    assert all(not p.requires_grad for p in enc.parameters())
    assert all(p.requires_grad for p in model.projectors["image"].parameters())
    assert all(p.requires_grad for p in model.llm.parameters())
    model(_pack(_global_batch()[:3])).ce_sum.backward()
    assert all(p.grad is None for p in enc.parameters())
    for p in model.projectors["image"].parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0
    # Without the flag the same encoder does get gradient (so the check above has teeth).
    unfrozen = _model()
    unfrozen(_pack(_global_batch()[:3])).ce_sum.backward()
    assert all(p.grad is not None for p in unfrozen.encoders["image"].parameters())


def test_moe_backbone_returns_finite_aux_loss():
    model = _model(MOE)
    parts = model(_pack(_global_batch()[:4]))
    assert parts.aux_loss is not None and parts.aux_loss.dim() == 0
    assert torch.isfinite(parts.aux_loss) and parts.aux_loss > 0
    assert torch.isfinite(parts.ce_sum)
    (parts.ce_sum / parts.num_targets + parts.aux_loss).backward()
    router = [p for n, p in model.named_parameters() if n.endswith("mlp.router.weight")]
    assert router and all(p.grad is not None and p.grad.abs().sum() > 0 for p in router)
    assert model.encoders["image"].embeddings.patch_embedding.weight.grad is not None


# ------------------------------------------------------------------------------------------
# build_model


def _cfg(**over) -> ModelConfig:
    return ModelConfig(**{**LLM, **over})


def test_build_model_from_config():
    slots = {"vision": EncoderSlot(name="siglip", params=dict(SIGLIP), freeze=True)}
    slots["vision"].projector.hidden_mult = 2.0
    torch.manual_seed(0)
    model = build_model(_cfg(), slots, vocab_needed=VOCAB)
    assert isinstance(model, OmniModel) and model.modalities == ["image"]
    enc = model.encoders["image"]
    assert isinstance(enc, SiglipEncoder) and enc.config.hidden_size == SIGLIP["hidden_size"]
    proj = model.projectors["image"]
    assert (proj.fc1.in_features, proj.fc1.out_features, proj.fc2.out_features) == (24, 64, 32)
    assert all(not p.requires_grad for p in enc.parameters())  # freeze=true
    parts = model(_pack(_global_batch()[:3]))
    assert torch.isfinite(parts.ce_sum) and parts.num_targets > 0


def test_build_model_vocab_too_small():
    slots = {"vision": EncoderSlot(name="siglip", params=dict(SIGLIP))}
    with pytest.raises(ConfigError, match=rf"model\.vocab_size={VOCAB}.*model\.vocab_size={VOCAB + 1}"):
        build_model(_cfg(), slots, vocab_needed=VOCAB + 1)


def test_build_model_two_slots_same_modality():
    slots = {"vision": EncoderSlot(name="siglip", params=dict(SIGLIP)),
             "vision2": EncoderSlot(name="siglip", params=dict(SIGLIP))}
    with pytest.raises(ConfigError, match=r"encoders\.vision2 and encoders\.vision both encode 'image'"):
        build_model(_cfg(), slots, vocab_needed=VOCAB)


def test_build_model_unknown_encoder_lists_registered():
    slots = {"vision": EncoderSlot(name="no_such_encoder")}
    with pytest.raises(ConfigError, match=r"encoders\.vision: unknown encoder 'no_such_encoder'") as info:
        build_model(_cfg(), slots, vocab_needed=VOCAB)
    assert "siglip" in str(info.value) and "whisper" in str(info.value)


def test_build_model_bad_encoder_param_is_config_error():
    slots = {"vision": EncoderSlot(name="siglip", params={**SIGLIP, "hidden_sise": 8})}
    with pytest.raises(ConfigError, match=r"encoders\.vision: unknown config key 'hidden_sise'"):
        build_model(_cfg(), slots, vocab_needed=VOCAB)


@pytest.mark.parametrize("tied", [False, True])
def test_build_model_pretrained_grows_vocab_for_placeholders(tmp_path, tied):
    """An HF tokenizer appends the configured modalities' placeholders (here <image> alone: one
    vision slot) to the checkpoint's vocabulary: the embedding (and an untied head) grow by those
    rows; a tokenizer larger than that is an error (a vision-only model once grew by two rows,
    <audio> included)."""
    from omni.models import export_pretrained

    torch.manual_seed(0)
    ref = Decoder(DecoderConfig(**{**LLM, "tie_word_embeddings": tied}))
    export_pretrained(ref, str(tmp_path))
    slots = {"vision": EncoderSlot(name="siglip", params=dict(SIGLIP))}
    model = build_model(ModelConfig(pretrained=str(tmp_path)), slots, vocab_needed=VOCAB + 1)
    llm = model.llm
    assert llm.config.vocab_size == VOCAB + 1 and llm.embed_tokens.weight.shape == (VOCAB + 1, 32)
    torch.testing.assert_close(llm.embed_tokens.weight[:VOCAB], ref.embed_tokens.weight, rtol=0, atol=0)
    if not tied:
        assert llm.lm_head.weight.shape == (VOCAB + 1, 32)
        torch.testing.assert_close(llm.lm_head.weight[:VOCAB], ref.lm_head.weight, rtol=0, atol=0)
    mb = _pack(_global_batch()[:2])
    mb.input_ids[mb.media["image"].positions] = VOCAB  # the new placeholder id
    assert llm.lm_logits(torch.zeros(1, 32)).shape == (1, VOCAB + 1)
    parts = model(mb)
    assert torch.isfinite(parts.ce_sum)
    parts.ce_sum.backward()
    assert llm.embed_tokens.weight.grad.shape == (VOCAB + 1, 32)

    with pytest.raises(ConfigError, match=r"model\.pretrained=.*model\.vocab_size=64.*data\.tokenizer="):
        build_model(ModelConfig(pretrained=str(tmp_path)), slots, vocab_needed=VOCAB + 2)
    with pytest.raises(ConfigError, match=r"model\.pretrained=.*model\.vocab_size=64.*data\.tokenizer="):
        build_model(ModelConfig(pretrained=str(tmp_path)), slots, vocab_needed=VOCAB + 40)
