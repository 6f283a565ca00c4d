"""Helpers shared by the model tests."""
from __future__ import annotations

import torch


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Fresh models have norms at 1 and biases at 0; perturb them so a dropped norm or bias
    would show, and make routing decisive (no near-ties between experts)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "router" in name or name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    return model


def packed_row(lengths, vocab: int, seed: int = 0, device="cpu"):
    """A packed ``MicroBatch`` of documents of ``lengths`` random tokens (seeded), each position a
    target of the next token except a document's last."""
    from dataloading.construct.batch import IGNORE_INDEX, MicroBatch

    ids = torch.randint(0, vocab, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    labels = ids.roll(-1).clone()
    labels[torch.tensor(lengths).cumsum(0) - 1] = IGNORE_INDEX
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return MicroBatch(ids.to(device), pos.to(device), labels.to(device), cu.to(device))


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# A tiny LLaVA-1.5: a CLIP tower of 3 layers over 30 x 30 pixel images in 6 x 6 patches (25
# patches), a Llama with grouped-query attention, the image placeholder 100.
LLAVA_VISION = dict(model_type="clip_vision_model", image_size=30, patch_size=6, hidden_size=32, intermediate_size=48,
                    num_hidden_layers=3, num_attention_heads=4)
LLAVA_TEXT = dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
LLAVA_IMAGE_TOKEN = 100


def save_tiny_llava(path, shortest_edge: int = 36, **config):
    """A random ``LlavaForConditionalGeneration`` (``config`` overrides ``LlavaConfig``'s fields)
    saved to ``path`` with a ``CLIPImageProcessor`` (shorter side to ``shortest_edge``, then the
    30-pixel centre crop); returned in eval mode. Weights are drawn large (norm gains about 1):
    with the default init attention is nearly uniform and positions would barely matter."""
    import transformers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(**{"vision_config": LLAVA_VISION, "text_config": LLAVA_TEXT,
                                      "image_token_id": LLAVA_IMAGE_TOKEN, "image_seq_length": 25, **config})
    model = transformers.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": shortest_edge}, crop_size={"height": 30, "width": 30}).save_pretrained(path)
    return model.eval()


def omni_logits(model, mb) -> torch.Tensor:
    """[T, vocab]: an ``OmniModel``'s logits at every position of the packed row ``mb`` (its
    training forward computes them only where there is a target)."""
    p = model.prepare(mb)
    h, _ = model._body(model._input_hidden(p), p)
    head = model.llm.embed_tokens if model.llm.lm_head is None else model.llm.lm_head
    return torch.nn.functional.linear(model.llm.norm(h)[0], head.weight)


def plugin_processor(encoder_cls, path):
    """The media processor an encoder plugin builds from a saved Hugging Face directory (its
    config.json and preprocessor_config.json), as ``omni train`` would."""
    import json
    from pathlib import Path

    path = Path(path)
    params = {**encoder_cls.params_from_hf_config(json.loads((path / "config.json").read_text())),
              **encoder_cls.params_from_preprocessor_config(json.loads((path / "preprocessor_config.json").read_text()))}
    return encoder_cls.processor(encoder_cls.build_config(params))


def media_sample(name, before, after, item, token, modality: str = "image"):
    """A tokenized sample: ``before`` ids, ``item``'s placeholders (``token`` once per encoder
    output row), ``after`` ids; next-token labels everywhere."""
    import numpy as np

    from dataloading.construct.batch import IGNORE_INDEX
    from dataloading.construct.constructor import Tokenized

    ids = np.array(before + [token] * item.num_tokens + after, dtype=np.int64)
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = ids[1:]
    return Tokenized(name, ids, labels, [(modality, item, np.arange(len(before), len(before) + item.num_tokens))])


def load_with_tower(path, encoder: str):
    """The whole model of a saved Hugging Face directory, its vision tower by the ``encoder``
    plugin, in eval mode."""
    from omni.models.build import build_model
    from omni.models.config import EncoderSlot, ModelConfig

    return build_model(ModelConfig(pretrained=str(path)), {"vision": EncoderSlot(name=encoder, pretrained=str(path))},
                       vocab_needed=0, seed=0).eval()
