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
    """A byte-level BPE without merges (id b is byte b) plus ``specials`` (ids 256...): any text
    tokenizes, the vocabulary stays small."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from dataloading.formats.tokenizer import byte_stand_ins

    stand_in = byte_stand_ins()
    core = Tokenizer(models.BPE(vocab={stand_in[b]: b for b in range(256)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core)
    fast.add_tokens(specials, special_tokens=True)
    fast.eos_token = eos
    fast.pad_token = specials[0]
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def save_tiny_qwen_vl(path: Path, variant: str = "qwen2_5_vl", seed: int = 0, std: float = 0.15):
    """A tiny Qwen2-VL or Qwen2.5-VL (``variant``; 2.5: window attention with a full-attention
    layer) with M-RoPE, its chat tokenizer and its image processor's settings in ``path``;
    returns (the transformers model, the tokenizer). Weights are drawn large enough that
    positions and windows change the output."""
    import transformers

    tok = byte_level_tokenizer(QWEN_SPECIALS, eos="<|im_end|>", chat_template=CHATML)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    torch.manual_seed(seed)
    text = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=272, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  eos_token_id=ids["<|im_end|>"])
    if variant == "qwen2_5_vl":
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                                 out_hidden_size=32, window_size=56, fullatt_block_indexes=[1]),
            **tokens)
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        cfg = transformers.Qwen2VLConfig(
            text_config=text, vision_config=dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=32),
            **tokens)
        model = transformers.Qwen2VLForConditionalGeneration(cfg)
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


def save_tiny_qwen2_5_vl(path: Path, seed: int = 0, std: float = 0.15):
    """``save_tiny_qwen_vl`` of Qwen2.5-VL."""
    return save_tiny_qwen_vl(path, "qwen2_5_vl", seed, std)


def save_tiny_qwen3_vl(path: Path, seed: int = 0, std: float = 0.15, moe: bool = False):
    """A tiny Qwen3-VL: a Qwen3 backbone (QK-norm, head_dim 12 apart from hidden / heads) with
    interleaved M-RoPE, a vision tower of 16-pixel patches whose learned positions (a 3 x 3
    table) are interpolated to every grid, and DeepStack features of two tower layers added
    after the first two LLM layers; its chat tokenizer and image processor in ``path``.
    ``moe``: Qwen3-VL-MoE (``save_tiny_qwen3_vl_moe``). Returns (the transformers model, the
    tokenizer)."""
    import transformers

    tok = byte_level_tokenizer(QWEN_SPECIALS, eos="<|im_end|>", chat_template=CHATML)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    torch.manual_seed(seed)
    text = dict(hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, vocab_size=272, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2],
                                 "mrope_interleaved": True})
    if moe:  # 5 experts of 24 (top 2) in layers 0 and 2, layer 1 dense (mlp_only_layers)
        text.update(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, out_hidden_size=40,
                  num_position_embeddings=9, deepstack_visual_indexes=[0, 2])
    config_cls, model_cls = ((transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration) if moe
                             else (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration))
    cfg = config_cls(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    model = model_cls(cfg)
    model = _drawn_and_saved(model, tok, path, std)
    if moe:
        _experts_hidden_first(Path(path) / "model.safetensors")
    transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 16}, patch_size=16,
                                          image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]).save_pretrained(path)
    return model, tok


def save_tiny_qwen3_vl_moe(path: Path, seed: int = 0, std: float = 0.15):
    """A tiny Qwen3-VL-MoE: ``save_tiny_qwen3_vl``'s model with a Qwen3-MoE backbone (5 experts of
    intermediate size 24, top 2, renormalised; its middle layer dense), the experts stored as
    the released checkpoints store them (one fused tensor per layer and projection, hidden first;
    transformers' save_pretrained writes its in-memory layout, and loads either)."""
    return save_tiny_qwen3_vl(path, seed, std, moe=True)


def _experts_hidden_first(file: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(file)
    for name in [n for n in sd if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        sd[name] = sd[name].transpose(1, 2).contiguous()
    save_file(sd, file, metadata={"format": "pt"})


# LLaVA-1.5's conversation format ("USER: <image>\n... ASSISTANT:"), each image as <image>.
LLAVA_CHAT = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %} {% else %}ASSISTANT: "
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def _llava_tokenizer():
    """LLaVA's vocabulary as the tiny models have it: ``<s>`` BOS, ``</s>``, ``<image>``, LLaVA's chat format."""
    tok = byte_level_tokenizer(["<unk>", "<s>", "</s>", "<image>"], eos="</s>", chat_template=LLAVA_CHAT)
    tok.bos_token = "<s>"
    return tok


def _drawn_and_saved(model, tok, path: Path, std: float):
    """``model`` with weights drawn large (norm gains about 1, the rest N(0, std)), so positions and
    layout matter, saved with ``tok`` to ``path``; returned in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, std)
    model = model.eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def save_tiny_llava_chat(path: Path, seed: int = 0, std: float = 0.15):
    """A tiny LLaVA-1.5 (CLIP tower of 3 layers on 30 x 30 images in 6 x 6 patches, feature
    layer -2, a Llama with grouped-query attention), its tokenizer (``<s>`` BOS, ``</s>``,
    ``<image>``) with LLaVA's chat format and its image processor (shorter side 36, 30-pixel
    crop) in ``path``; returns (the transformers model, the tokenizer)."""
    import transformers

    tok = _llava_tokenizer()
    torch.manual_seed(seed)
    cfg = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", image_size=30, patch_size=6, hidden_size=32,
                           intermediate_size=48, num_hidden_layers=3, num_attention_heads=4),
        text_config=dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=272,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        image_token_id=tok.convert_tokens_to_ids("<image>"), image_seq_length=25)
    model = transformers.LlavaForConditionalGeneration(cfg)
    model = _drawn_and_saved(model, tok, path, std)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    CLIPImageProcessorPil(size={"shortest_edge": 36}, crop_size={"height": 30, "width": 30}).save_pretrained(path)
    return model, tok




def hf_inputs(directory: Path, images, ids: np.ndarray, image_token_id: int) -> dict:
    """transformers' inputs for ``ids`` (the image placeholders already expanded) and PIL
    ``images``, prepared by the directory's own image processor (its PIL variant: the default
    needs torchvision); Qwen2-VL also takes the token types (1: image) it computes M-RoPE from."""
    import transformers

    pixels = dict(transformers.AutoImageProcessor.from_pretrained(directory)(images=list(images), return_tensors="pt"))
    out = dict(input_ids=torch.as_tensor(ids)[None], **pixels)
    if "image_grid_thw" in pixels:
        out["mm_token_type_ids"] = torch.as_tensor(np.asarray(ids) == image_token_id, dtype=torch.int64)[None]
    return out


# LLaVA-OneVision's chat format (ChatML; an image as <image>, a video as <video>, each on its line).
LLAVA_OV_CHAT = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'video' %}<video>\n"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAVA_OV_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]


def save_tiny_llava_onevision(path: Path, seed: int = 0, std: float = 0.15, tile: int = 16, **config):
    """A tiny LLaVA-OneVision (SigLIP tower of 3 layers on ``tile``-pixel tiles of 4-pixel
    patches: 16 gives 4 x 4 patches; 18, like the real 384-pixel tiles of 14-pixel patches, is
    no whole number of patches and the convolution drops the last pixels; tilings up to 2 x 2, a
    Qwen2 with grouped-query attention; ``config`` overrides the ``LlavaOnevisionConfig`` fields),
    its ChatML tokenizer with ``<image>``/``<video>`` and its image processor (the PIL variant) in
    ``path``; returns (the transformers model, the tokenizer). Weights are drawn large (norm
    gains about 1) so that positions and layout matter."""
    import transformers

    tok = byte_level_tokenizer(LLAVA_OV_SPECIALS, eos="<|im_end|>", chat_template=LLAVA_OV_CHAT)
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAVA_OV_SPECIALS}
    pinpoints = [[tile, tile], [tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]
    torch.manual_seed(seed)
    cfg = transformers.LlavaOnevisionConfig(**{
        "vision_config": dict(model_type="siglip_vision_model", image_size=tile, patch_size=4, hidden_size=32,
                              intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, vision_use_head=False),
        "text_config": dict(model_type="qwen2", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=272, bos_token_id=None,
                            eos_token_id=ids["<|im_end|>"]),
        "image_token_index": ids["<image>"], "video_token_index": ids["<video>"], "image_grid_pinpoints": pinpoints,
        **config})
    model = transformers.LlavaOnevisionForConditionalGeneration(cfg)
    model = _drawn_and_saved(model, tok, path, std)
    transformers.LlavaOnevisionImageProcessorPil(size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints,
                                                 image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    return model, tok


def save_tiny_llava_next_chat(path: Path, seed: int = 0, std: float = 0.15, **config):
    """A tiny LLaVA-NeXT (CLIP tower of 3 layers on 16-pixel tiles of 4 x 4 patches, feature
    layer -2 without the class token, tilings 1 x 2, 2 x 1 and 2 x 2, a Llama with grouped-query
    attention; ``config`` overrides the ``LlavaNextConfig`` fields), its tokenizer (``<s>`` BOS,
    ``</s>``, ``<image>``) with LLaVA's chat format and its image processor (the PIL variant,
    CLIP's normalisation) in ``path``; returns (the transformers model, the tokenizer). Weights
    are drawn large (norm gains about 1) so that positions and layout matter."""
    import transformers

    tok = _llava_tokenizer()
    pinpoints = config.pop("image_grid_pinpoints", [[16, 32], [32, 16], [32, 32]])
    torch.manual_seed(seed)
    cfg = transformers.LlavaNextConfig(**{
        "vision_config": dict(model_type="clip_vision_model", image_size=16, patch_size=4, hidden_size=32,
                              intermediate_size=48, num_hidden_layers=3, num_attention_heads=4),
        "text_config": dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=272,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        "image_token_index": tok.convert_tokens_to_ids("<image>"), "image_grid_pinpoints": pinpoints, **config})
    model = transformers.LlavaNextForConditionalGeneration(cfg)
    model = _drawn_and_saved(model, tok, path, std)
    transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                            image_grid_pinpoints=pinpoints).save_pretrained(path)
    return model, tok


# Tiny language models of the LLM-only families, with odd sizes: a head_dim apart from
# hidden / heads, grouped KV heads, MoE layers among dense ones.
LLM_CONFIGS = {
    "qwen3": dict(hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12, attention_bias=True),
    "qwen3_moe": dict(hidden_size=40, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=12, num_experts=5, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1]),
}


def save_tiny_llm(path: Path, model_type: str, seed: int = 0, std: float = 0.15):
    """A tiny causal LM of ``model_type`` (``LLM_CONFIGS``) with Qwen's chat tokenizer (ChatML,
    ``<|im_end|>`` its end of turn) in ``path``; returns (the transformers model, the tokenizer)."""
    import transformers

    tok = byte_level_tokenizer(QWEN_SPECIALS, eos="<|im_end|>", chat_template=CHATML)
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=272, bos_token_id=None,
                                            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                                            pad_token_id=tok.pad_token_id, **LLM_CONFIGS[model_type])
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return _drawn_and_saved(model, tok, path, std), tok


SAVERS = {"qwen2_vl": lambda path, **kw: save_tiny_qwen_vl(path, "qwen2_vl", **kw), "qwen2_5_vl": save_tiny_qwen2_5_vl,
          "qwen3_vl": save_tiny_qwen3_vl, "qwen3_vl_moe": save_tiny_qwen3_vl_moe,
          "llava": save_tiny_llava_chat, "llava_onevision": save_tiny_llava_onevision,
          "llava_next": save_tiny_llava_next_chat}


def image_prompt(loaded, image: np.ndarray):
    """One image and a chat prompt, built as ``omni generate`` builds it, for a loaded model
    (``recipes.model_source.load_model``): Omni's micro-batch and the image's MediaItem."""
    from dataloading.construct.constructor import SampleConstructor
    from dataloading.formats.sample import DecodedSample
    from omni.models.build import media_processors
    from recipes.generate_cmd import prompt_text

    text = prompt_text(loaded.tokenizer, ["image"], "what is this?")
    c = SampleConstructor({}, loaded.tokenizer, media_processors(loaded.model), None)
    mb, _ = c.build_prompt(DecodedSample("prompt", text, None, [("image", image)]))
    return mb, media_processors(loaded.model)["image"](image)


def model_logits(model, mb) -> torch.Tensor:
    """[T, vocab]: an ``OmniModel``'s logits for the prompt row ``mb``, called as a module."""
    with torch.no_grad():
        return model(mb.input_ids, media=mb.media, position_ids=mb.position_ids,
                     rope_position_ids=mb.rope_position_ids)[0]
