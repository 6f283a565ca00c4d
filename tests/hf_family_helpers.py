"""Tiny Hugging Face model directories of the supported families, with a tokenizer and a chat
template, saved by transformers itself (no hub): what a user's downloaded checkpoint holds."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# The special tokens of Qwen2-VL's vocabulary that a chat and an image need.
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
# ChatML, as Qwen2-VL's template writes it: a turn per message, each image (video) framed by
# the vision tokens, and the assistant's header when a generation prompt is asked for.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokenizer(specials: list[str], eos: str, chat_template: str | None = None):
    """A byte-level BPE without merges (ids 0..255 are bytes) plus ``specials``: any text
    tokenizes, the vocabulary stays small."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core)
    fast.add_tokens(specials, special_tokens=True)
    fast.eos_token = eos
    fast.pad_token = specials[0]
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def save_tiny_qwen2_5_vl(path: Path, seed: int = 0, std: float = 0.15):
    """A tiny Qwen2.5-VL (window attention, a full-attention layer, M-RoPE), its chat tokenizer
    and its image processor's settings in ``path``; returns (the transformers model, the tokenizer). Weights are drawn
    large enough that positions and windows change the output."""
    import transformers

    tok = byte_level_tokenizer(QWEN_SPECIALS, eos="<|im_end|>", chat_template=CHATML)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    torch.manual_seed(seed)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=272, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32,
                           window_size=56, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"])
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                p.normal_(0.0, std)
    model = model.eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    # transformers' Qwen2-VL image processor settings (its PIL variant: the default needs torchvision)
    transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}).save_pretrained(path)
    return model, tok


def qwen_hf_inputs(ids: np.ndarray, items, image_token_id: int) -> dict:
    """transformers' Qwen2-VL inputs for a prompt Omni built: the image patches and grids of
    ``items`` (Omni's MediaItems, in order) and the token types (1: image) from which
    transformers computes its M-RoPE positions."""
    return dict(input_ids=torch.as_tensor(ids)[None],
                pixel_values=torch.cat([it.features for it in items]),
                image_grid_thw=torch.tensor([list(it.size) for it in items]),
                mm_token_type_ids=torch.as_tensor(np.asarray(ids) == image_token_id, dtype=torch.int64)[None])
