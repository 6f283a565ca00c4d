"""KV-cached generation (omni.runtime.generate): the cached engine computes what recomputing the
whole sequence for every token computes (tokens and logits, fp32), for batched prompts of
different lengths with images, on a dense, an MoE and an M-RoPE backbone; greedy generation on a
Llama checkpoint equals transformers' ``generate``; sampling is reproducible and obeys top-p.
(The Qwen2.5-VL checkpoint against transformers: tests/models/test_qwen_vl_model.py.)"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dataloading.construct.batch import IGNORE_INDEX, MicroBatch
from dataloading.construct.constructor import Tokenized, assemble
from omni.models.build import build_model, media_processors
from omni.models.config import EncoderSlot, ModelConfig
from omni.runtime.generate import Sampling, generate, top_k_filter, top_p_filter

VOCAB, IMG = 64, 63
LLM = dict(family="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
           num_kv_heads=2, initializer_range=0.2)
MOE = dict(LLM, family="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=24)
MROPE = dict(LLM, family="qwen2", attention_bias=True, mrope_section=[1, 1, 2])  # head_dim 8: 4 frequencies
SIGLIP = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=4)  # an 8x8 image: 2x2 patches, 4 placeholders
NEW = 6


def _model(llm: dict):
    model = build_model(ModelConfig(**llm), {"vision": EncoderSlot(name="siglip", params=dict(SIGLIP))},
                        vocab_needed=VOCAB, seed=0).eval()
    with torch.no_grad():  # norms away from 1, so a norm applied to the wrong tokens would show
        gen = torch.Generator().manual_seed(1)
        for name, p in model.llm.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    return model


def _prompts(model, mrope: bool) -> list[MicroBatch]:
    """Three prompts of different lengths: text + image + text, text only, two images."""
    proc = media_processors(model)["image"]
    rng = np.random.default_rng(0)

    def image():
        item = proc(rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8))
        return dataclasses.replace(item, rope_grid=(1, 2, 2, 1.0)) if mrope else item

    def prompt(name, parts):
        ids, media = [], []
        for part in parts:
            if part == "img":
                media.append(("image", image(), np.arange(len(ids), len(ids) + 4)))
                ids += [IMG] * 4
            else:
                ids += rng.integers(0, IMG, size=part).tolist()
        ids = np.array(ids, dtype=np.int64)
        return assemble([Tokenized(name, ids, np.full(ids.shape, IGNORE_INDEX), media)])

    return [prompt("a", [3, "img", 2]), prompt("b", [4]), prompt("c", [1, "img", 5, "img", 1])]


def _uncached(model, prompt: MicroBatch, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and next-token logits, each from a forward over the whole sequence so far
    (one row, no cache). Positions continue as transformers does: the first generated token one
    past the prompt's largest position, in all three M-RoPE rows."""
    llm = model.llm
    seq = model.embed(prompt.input_ids, prompt.media)
    length = seq.shape[0]
    mrope = llm.config.mrope_section is not None
    own = prompt.rope_position_ids if mrope and prompt.rope_position_ids is not None else \
        prompt.position_ids.expand(3, length)
    tokens, logits = [], []
    for _ in range(n):
        extra = seq.shape[0] - length
        rope = torch.cat([own, (int(own.max()) + 1 + torch.arange(extra)).expand(3, extra)], dim=1)
        out = llm(inputs_embeds=seq[None], output_hidden=True, rope_position_ids=rope if mrope else None,
                  position_ids=None if mrope else rope[0])
        step = llm.lm_logits(out.hidden_states[0, -1])
        logits.append(step)
        tokens.append(int(step.argmax()))
        seq = torch.cat([seq, llm.embed(torch.tensor([tokens[-1]]))])
    return tokens, logits


@pytest.mark.parametrize("llm", [LLM, MOE, MROPE], ids=["dense", "moe", "mrope"])
def test_cached_generation_equals_recomputing_the_sequence(llm):
    model = _model(llm)
    prompts = _prompts(model, mrope="mrope_section" in llm)
    assert len({p.num_tokens for p in prompts}) == 3
    if "mrope_section" in llm:  # the image rows make the M-RoPE positions differ from the 1-D ones
        assert prompts[0].rope_position_ids is not None and int(prompts[0].rope_position_ids.max()) < 8
    steps = []
    with torch.no_grad():
        got = generate(model, prompts, eos_ids=(), max_new_tokens=NEW, device="cpu", on_logits=steps.append)
        for i, p in enumerate(prompts):
            tokens, logits = _uncached(model, p, NEW)
            assert got[i] == tokens, f"prompt {i}"
            for k, want in enumerate(logits):
                err = ((steps[k][i] - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, f"prompt {i}, token {k}: relative error {err}"
    assert len(steps) == NEW and len({tuple(t) for t in got}) == 3


def test_each_row_stops_at_any_of_the_eos_ids():
    model = _model(LLM)
    prompts = _prompts(model, mrope=False)
    with torch.no_grad():
        full = generate(model, prompts, eos_ids=(), max_new_tokens=NEW, device="cpu")
        eos = {full[0][2], full[1][4]}
        got = generate(model, prompts, eos_ids=eos, max_new_tokens=NEW, device="cpu")
    for row, want in zip(got, full):
        cut = next((k for k, tok in enumerate(want) if tok in eos), len(want))
        assert row == want[:cut]
    assert len(got[0]) <= 2 and len(got[1]) <= 4  # two rows stopped early, the batch went on


def test_greedy_generation_on_a_llama_checkpoint_equals_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=5, pad_token_id=0,
                                   bos_token_id=1)
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # weights large enough that the choice of token is decisive
        for name, p in hf.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.15)
    hf = hf.eval()
    hf.save_pretrained(tmp_path)
    ours = build_model(ModelConfig(pretrained=str(tmp_path)), {}, vocab_needed=96, seed=0).eval()
    prompts = [torch.tensor([1, 17, 40, 3, 88, 9, 61]), torch.tensor([1, 50, 7])]
    with torch.no_grad():
        got = generate(ours, [assemble([Tokenized(str(i), p.numpy(), np.full(len(p), IGNORE_INDEX), [])])
                              for i, p in enumerate(prompts)], eos_ids={5}, max_new_tokens=10, device="cpu")
        for ids, row in zip(prompts, got):
            want = hf.generate(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                               max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
            assert row == (want[:-1] if want[-1] == 5 else want)  # transformers keeps the eos


def test_sampling_is_reproducible_and_obeys_top_p():
    model = _model(LLM)
    prompts = _prompts(model, mrope=False)
    sampling = Sampling(greedy=False, temperature=0.8, top_p=0.7, seed=3)
    with torch.no_grad():
        steps = []
        first = generate(model, prompts, (), 8, "cpu", sampling, on_logits=steps.append)
        again = generate(model, prompts, (), 8, "cpu", sampling)
        other = generate(model, prompts, (), 8, "cpu", dataclasses.replace(sampling, seed=4))
        greedy = generate(model, prompts, (), 8, "cpu")
    assert first == again and first != other and first != greedy
    for k, logits in enumerate(steps):  # every draw lies in its step's nucleus
        allowed = torch.isfinite(top_p_filter(logits / 0.8, 0.7))
        assert all(allowed[i, row[k]] for i, row in enumerate(first))
    with torch.no_grad():  # a vanishing nucleus holds the most likely token alone
        tiny = generate(model, prompts, (), 8, "cpu", Sampling(greedy=False, temperature=1.3, top_p=1e-6, seed=5))
        top1 = generate(model, prompts, (), 8, "cpu", Sampling(greedy=False, top_k=1, seed=6))
    assert tiny == greedy and top1 == greedy


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 2.0
    kept = torch.isfinite(top_p_filter(logits, p))
    probs = logits.double().softmax(-1)
    for i in range(logits.shape[0]):
        order = probs[i].argsort(descending=True).tolist()
        total, want = 0.0, set()
        for tok in order:  # the most likely tokens until their mass reaches p
            want.add(tok)
            total += float(probs[i, tok])
            if total >= p:
                break
        assert set(kept[i].nonzero()[:, 0].tolist()) == want
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_top_k_keeps_the_k_largest():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    kept = torch.isfinite(top_k_filter(logits, 5))
    assert torch.equal(kept, torch.zeros_like(kept).scatter(1, logits.topk(5).indices, True))
    assert torch.equal(top_k_filter(logits, 0), logits)


def test_bad_sampling_options_name_the_option():
    with pytest.raises(ValueError, match="top_p"):
        Sampling(greedy=False, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(greedy=False, temperature=0.0)


def test_kv_cache_refuses_tokens_past_its_length_and_a_growing_trim():
    from omni.models.llm import KVCache

    cache = KVCache(batch=2, max_len=5, device="cpu")
    cache.step(4)
    cache.advance(4)
    cache.trim([2, 4])
    assert cache.lengths == [2, 4] and cache.next_positions(1)[:, 0].tolist() == [2, 4]
    with pytest.raises(ValueError, match="holds 5 tokens per row; 6 do not fit"):
        cache.step(2)
    with pytest.raises(ValueError, match="cannot trim"):
        cache.trim([3, 4])


def test_a_decode_step_reads_grouped_kv_heads_in_place():
    """A decode step attends to the cached keys with grouped-query SDPA: no op copies the cache
    out per query head (repeat_interleave, or expand + clone, or an index of the buffers), only
    the new token's keys are written in. Its tokens and logits are checked above (against
    recomputing the sequence, and against transformers)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from omni.models.llm import KVCache

    model = _model(LLM)
    llm = model.llm
    heads, kv_heads, dim = LLM["num_heads"], LLM["num_kv_heads"], LLM["hidden_size"] // LLM["num_heads"]
    assert heads > kv_heads
    batch, lengths = 2, [7, 4]
    cache = KVCache(batch, max(lengths) + 2, "cpu")
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            reads = [a for a in args if isinstance(a, torch.Tensor)]
            seen.append((func._schema.name, reads, [o for o in outs if isinstance(o, torch.Tensor)]))
            return out

    with torch.no_grad():
        embeds = torch.randn(batch, max(lengths), LLM["hidden_size"], generator=torch.Generator().manual_seed(0))
        llm(inputs_embeds=embeds, output_hidden=True, cache=cache)
        cache.trim(lengths)
        width = max(lengths) + 1
        buffers = {t.untyped_storage().data_ptr() for t in (*cache.keys.values(), *cache.values.values())}
        with Record():
            llm(inputs_embeds=embeds[:, :1], output_hidden=True, cache=cache)
    names = [name for name, _, _ in seen]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names  # the fused kernel, per layer
    assert not [n for n in names if "repeat" in n], names
    cache_size = batch * kv_heads * width * dim  # one layer's keys of this step
    for name, reads, outs in seen:
        for o in outs:
            fresh = o.untyped_storage().data_ptr() not in buffers and not any(
                o.untyped_storage().data_ptr() == r.untyped_storage().data_ptr() for r in reads)
            # a new tensor as large as the step's keys is a copy of them (per head or not)
            assert not (fresh and o.numel() >= cache_size), (name, tuple(o.shape))
            assert tuple(o.shape[-3:]) != (heads, width, dim), (name, tuple(o.shape))
        if name == "aten::index.Tensor":  # gathers from the cache buffers
            assert reads[0].untyped_storage().data_ptr() not in buffers, name


def test_kv_cache_attention_equals_sdpa_on_repeated_heads():
    """Each way ``LayerCache.attend`` calls SDPA (a prompt into an empty cache, a decode step,
    several tokens after cached ones) computes masked attention over the repeated KV heads."""
    import torch.nn.functional as F

    from omni.models.llm import KVCache

    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim = 2, 6, 2, 8
    cache = KVCache(batch, 12, "cpu")
    for t, trim in ((5, [5, 3]), (1, None), (3, None)):  # the second row's prompt: 3 tokens, right-padded
        step = cache.step(t)
        q = torch.randn(batch, heads, t, dim, generator=gen)
        k, v = (torch.randn(batch, kv_heads, t, dim, generator=gen) for _ in range(2))
        got = step.layer(0).attend(q, k, v, scale=0.3)
        keys, values = (buf[:, :, :step.width].repeat_interleave(heads // kv_heads, 1)
                        for buf in (cache.keys[0], cache.values[0]))
        want = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask, scale=0.3)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        cache.advance(t)
        if trim:
            cache.trim(trim)
