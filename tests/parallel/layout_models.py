"""The equality tests' tiny models and data: a decoder (dense or MoE), its encoder slots (SigLIP,
LLaVA-OneVision, Qwen's tower, Whisper), and global batches of packed rows with media items, the
same for the single-process reference and every layout (``layout_harness``)."""
from __future__ import annotations

import torch

from dataloading.construct.batch import IGNORE_INDEX, MediaInputs, MicroBatch
from dataloading.construct.positions import mrope_position_ids
from omni.models.encoders.llava_ov import LlavaOvEncoder, LlavaOvEncoderConfig
from omni.models.encoders import qwen3_omni_audio
from omni.models.encoders.qwen3_omni_audio import Qwen3OmniAudioConfig, Qwen3OmniAudioEncoder
from omni.models.encoders.qwen3_omni_vision import Qwen3OmniVisionEncoder
from omni.models.encoders.qwen3_vl import Qwen3VisionConfig, Qwen3VisionEncoder
from omni.models.encoders.qwen_omni_audio import QwenOmniAudioConfig, QwenOmniAudioEncoder, llm_tokens
from omni.models.encoders.qwen_omni_vision import QwenOmniVisionEncoder
from omni.models.encoders.qwen_vl import QwenVisionConfig, QwenVisionEncoder
from omni.models.encoders.siglip import SiglipEncoder, SiglipEncoderConfig
from omni.models.encoders.whisper import WhisperEncoder, WhisperEncoderConfig, output_frames
from omni.models.llm import Decoder
from omni.models.llm.config import DecoderConfig
from omni.models.multimodal import OmniModel
from omni.models.projector import Projector

STEPS = 5
MICRO_PER_STEP = 4


def model_config(moe: bool | str, num_layers: int = 4, mrope: bool | str = False) -> DecoderConfig:
    """``moe``: False a Llama, True a Qwen2-MoE (with its shared expert); "qwen3" / "qwen3_moe":
    Qwen3's backbone (QK-norm, head_dim 12 apart from hidden / heads; the MoE without a shared
    expert). ``mrope``: a Qwen2-VL-style backbone (qwen2, M-RoPE sections of the 4 frequencies);
    "qwen3": Qwen3-VL's (qwen3, head_dim 12, interleaved M-RoPE over its 6 frequencies)."""
    kw = dict(family="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=num_layers,
              num_heads=4, num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    if mrope == "qwen3":
        kw.update(family="qwen3", head_dim=12, mrope_section=[2, 2, 2], mrope_interleaved=True)
    elif mrope:
        kw.update(family="qwen2", attention_bias=True, mrope_section=[1, 1, 2])
    if moe in ("qwen3", "qwen3_moe"):
        kw.update(family=moe, head_dim=12)
    if moe is True or moe == "qwen3_moe":
        kw.update(family="qwen2_moe" if moe is True else moe, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32 if moe is True else 0,
                  norm_topk_prob=True, router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
    return DecoderConfig(**kw)


PATCH_FEATURES = 3 * 2 * 2  # channels x patch x patch
MEL_BINS = 8
PLACEHOLDER = 95  # any id: the media rows overwrite its embedding


QWEN_PATCH_FEATURES = 3 * 2 * 2 * 2  # channels x frames x patch x patch
MROPE_TOWERS = ("qwen", "qwen3", "omni", "qwen3_omni")  # Qwen towers: (t, h, w) sizes, an M-RoPE backbone
# LLaVA-OneVision's tower: 8-pixel tiles of 4 x 4 patches, tilings up to 2 x 2 (max 1 tile's worth
# of rows: larger grids are shrunk)
LLAVA_OV = LlavaOvEncoderConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                image_size=8, patch_size=2, image_grid_pinpoints=[[8, 8], [8, 16], [16, 8], [16, 16]],
                                vision_aspect_ratio="anyres_max_1")


def encoders(media: tuple, merge: int = 1, vision: str = "siglip") -> tuple[dict, dict]:
    """Tiny SigLIP ("image") and Whisper ("audio") towers (4 heads: Ulysses over 2 or 4 ranks).
    ``merge``: the vision tower's spatial merge (its projector joins merge x merge patches).
    ``vision="qwen"``: a Qwen2.5-VL tower instead (2 x 2 merge, windows of 2 x 2 merge groups,
    the second layer full), its projector Qwen's merger (RMSNorm); ``vision="qwen3"``: a Qwen3-VL
    tower (learned positions from a 3 x 3 table, DeepStack features of its two layers, which the
    LLM's first two layers add), its projector Qwen3-VL's mergers; ``vision="omni"``: Qwen2.5-Omni's
    thinker towers, the Qwen2.5-VL one and its audio tower (chunks of 4 mel frames, pooled pairs,
    a linear projector); ``vision="qwen3_omni"``: Qwen3-Omni's, the Qwen3-VL one (DeepStack) and
    its audio tower (a Conv2d stem over chunks of 4 mel frames, one token each, windows of 4
    chunks; the stem drawn at std 0.5 by ``build``)."""
    enc, proj = {}, {}
    if "image" in media and vision in ("qwen", "omni"):
        tower = QwenOmniVisionEncoder if vision == "omni" else QwenVisionEncoder
        enc["image"] = tower(QwenVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, patch_size=2, window_size=8,
                                              fullatt_block_indexes=[1], min_pixels=16))
        proj["image"] = Projector(16, 32, merge=4, norm="rms")
    elif "image" in media and vision in ("qwen3", "qwen3_omni"):
        tower = Qwen3OmniVisionEncoder if vision == "qwen3_omni" else Qwen3VisionEncoder
        enc["image"] = tower(Qwen3VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                            num_attention_heads=4, patch_size=2, min_pixels=16,
                                                            num_position_embeddings=9, deepstack_visual_indexes=[0, 1]))
        proj["image"] = enc["image"].new_projector(32)
    elif "image" in media and vision == "llava_ov":  # a projector that lays out whole items from their sizes
        enc["image"] = LlavaOvEncoder(LLAVA_OV)
        proj["image"] = enc["image"].new_projector(32)
    elif "image" in media:
        enc["image"] = SiglipEncoder(SiglipEncoderConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                         num_attention_heads=4, image_size=16, patch_size=2,
                                                         spatial_merge=merge))
        proj["image"] = Projector(16, 32, merge=merge * merge)
    if "audio" in media and vision == "omni":
        enc["audio"] = QwenOmniAudioEncoder(QwenOmniAudioConfig(
            num_mel_bins=MEL_BINS, d_model=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=32,
            max_source_positions=64, n_window=2, max_frames=64))
        proj["audio"] = enc["audio"].new_projector(32)
    elif "audio" in media and vision == "qwen3_omni":
        enc["audio"] = Qwen3OmniAudioEncoder(Qwen3OmniAudioConfig(
            num_mel_bins=MEL_BINS, d_model=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=32,
            max_source_positions=64, n_window=2, n_window_infer=16, downsample_hidden_size=8, max_frames=64))
        proj["audio"] = enc["audio"].new_projector(32)
    elif "audio" in media:
        enc["audio"] = WhisperEncoder(WhisperEncoderConfig(num_mel_bins=MEL_BINS, d_model=16, encoder_layers=2,
                                                           encoder_attention_heads=4, encoder_ffn_dim=32,
                                                           max_source_positions=64))
        proj["audio"] = Projector(16, 32)
    return enc, proj


def build(moe: bool | str, num_layers: int, media: tuple = (), frozen: tuple = (), merge: int = 1,
          vision: str = "siglip", lora: int = 0) -> OmniModel:
    """``frozen``: modalities whose encoder does not train (its projector still does);
    ``merge``, ``vision``: the vision tower's spatial merge and kind (``encoders``); ``lora``:
    LoRA adapters of that rank on the LLM's linear layers (its base weights frozen), their B
    initialised non-zero so that the first step's gradients reach every adapter."""
    torch.manual_seed(1234)
    llm = Decoder(model_config(moe, num_layers, mrope={"qwen": True, "omni": True, "qwen3": "qwen3",
                                                       "qwen3_omni": "qwen3"}.get(vision, False)))
    model = OmniModel(llm, *encoders(media, merge, vision), frozen=set(frozen))
    with torch.no_grad():  # decisive routing and non-trivial norms (see tests/models/model_helpers.py)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "router" in name:
                p.normal_(0.0, 0.5)
            elif name.startswith("encoders.audio.conv2d"):
                # Qwen3-Omni's stem at its default init gives every token nearly the same state (the
                # biases outgrow the signal over three convolutions): attention then barely depends
                # on q and k, whose gradients (1e-5 of the others) are fp32 rounding and differ
                # between layouts by 1e-3. Drawn larger, the tokens differ and the check is sharp.
                p.normal_(0.0, 0.5)
    if lora:
        from omni.models import lora as adapters
        from omni.models.config import LoraConfig

        adapters.inject(model, LoraConfig(rank=lora, alpha=2.0 * lora), {m: m for m in model.encoders})
        random_adapters(model, seed=5)
    return model


def random_adapters(model: torch.nn.Module, seed: int) -> None:
    """Draw the LoRA adapters anew (seeded): A as peft draws it (scale 1/sqrt(in)), B small but not
    zero, so that A's first gradient is not zero either."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if ".lora_B" in name else p.shape[1] ** -0.5))


def _media_item(gen: torch.Generator, modality: str, size: int, merge: int = 1, vision: str = "siglip"):
    """(features, sizes row, tokens) of one item: an image of a x b patches (multiples of
    ``merge``, whose projector joins merge x merge of them into one token; for the Qwen tower
    one temporal patch of a x b, sizes (1, a, b)), an audio clip of ``size`` mel frames."""
    if modality == "image" and vision == "llava_ov":  # an image of h x w pixels, or (one in three) a video
        layout = LLAVA_OV.layout
        h, w = (int(torch.randint(3, 20, (1,), generator=gen)) for _ in range(2))
        if float(torch.rand(1, generator=gen)) < 1 / 3:
            frames = int(torch.randint(1, 4, (1,), generator=gen))
            return torch.randn(frames * 16, PATCH_FEATURES, generator=gen), [frames, h, w, 1], layout.video_tokens(frames)
        r, c = layout.tiles(h, w)
        return (torch.randn((1 + r * c) * 16, PATCH_FEATURES, generator=gen), [1 + r * c, h, w, 0],
                layout.image_tokens(h, w))
    if modality == "image":
        a = int(torch.randint(1, 4, (1,), generator=gen)) if size == 0 else size
        b = int(torch.randint(1, 5, (1,), generator=gen))
        a, b = a * merge, b * merge
        if vision in MROPE_TOWERS:
            return torch.randn(a * b, QWEN_PATCH_FEATURES, generator=gen), [1, a, b], a * b // (merge * merge)
        return torch.randn(a * b, PATCH_FEATURES, generator=gen), [a, b], a * b // (merge * merge)
    if vision == "omni":  # 3 to 12 mel frames (1 to 3 chunks of 4), one row per pooled pair of conv tokens
        frames = int(torch.randint(3, 13, (1,), generator=gen)) if size == 0 else size
        return torch.randn(frames, MEL_BINS, generator=gen), [frames], llm_tokens(frames)
    if vision == "qwen3_omni":  # 8 to 40 mel frames (2 to 10 chunks of 4, one token each)
        frames = int(torch.randint(8, 41, (1,), generator=gen)) if size == 0 else size
        return torch.randn(frames, MEL_BINS, generator=gen), [frames], qwen3_omni_audio.llm_tokens(frames, n_window=2)
    frames = int(torch.randint(1, 9, (1,), generator=gen)) if size == 0 else size
    return torch.randn(frames, MEL_BINS, generator=gen), [frames], output_frames(frames)


def media_micro_batch(gen: torch.Generator, vocab: int, index: int, media: tuple, long_items: bool,
                      merge: int = 1, vision: str = "siglip") -> MicroBatch:
    """A packed row of documents, each with up to two media items (inside the prompt, so the
    loss flows back into the encoders through the later tokens). ``long_items``: some items
    are much longer than the rest (what long-short SP splits)."""
    ids, pos, labels, lens, rope = [], [], [], [], []
    items: dict[str, list] = {m: [] for m in media}
    offset = 0
    while offset < 24:
        n = int(torch.randint(4, 14, (1,), generator=gen))
        doc = torch.randint(0, vocab - 1, (n + 1,), generator=gen)
        d_ids, d_lab, grids = [doc[:2]], [doc[1:3]], []
        for m in media:
            if float(torch.rand(1, generator=gen)) < 0.6:
                big = long_items and float(torch.rand(1, generator=gen)) < 0.3
                feats, size, tok = _media_item(gen, m, (6 if m == "image" else 24) if big else 0, merge, vision)
                start = offset + sum(t.numel() for t in d_ids)
                items[m].append((feats, size, tok, torch.arange(start, start + tok)))
                if vision in MROPE_TOWERS and m == "image":  # M-RoPE grid of its placeholders
                    grids.append((start - offset, 1, size[1] // merge, size[2] // merge, 1.0))
                d_ids.append(torch.full((tok,), PLACEHOLDER))
                d_lab.append(torch.full((tok,), IGNORE_INDEX))
        d_ids.append(doc[2:-1])
        d_lab.append(doc[3:])
        row = torch.cat(d_ids)
        lab = torch.cat(d_lab)[: row.numel()]
        lab[:1] = IGNORE_INDEX
        ids.append(row)
        labels.append(lab)
        pos.append(torch.arange(row.numel()))
        rope.append(mrope_position_ids(row.numel(), grids))
        lens.append(row.numel())
        offset += row.numel()
    out = {}
    for m, its in items.items():
        if its:
            out[m] = MediaInputs(torch.cat([f for f, _, _, _ in its]), torch.tensor([s for _, s, _, _ in its]),
                                 torch.tensor([t for _, _, t, _ in its]), torch.cat([p for _, _, _, p in its]))
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return MicroBatch(torch.cat(ids), torch.cat(pos), torch.cat(labels), cu, media=out, sample_ids=[f"mb{index}"],
                      rope_position_ids=torch.cat(rope, dim=1) if vision in MROPE_TOWERS else None)


def micro_batch(gen: torch.Generator, vocab: int, index: int) -> MicroBatch:
    lens = []
    while sum(lens) < 24:
        lens.append(int(torch.randint(1, 14, (1,), generator=gen)))
    ids, pos, labels = [], [], []
    for n in lens:
        doc = torch.randint(0, vocab, (n + 1,), generator=gen)
        ids.append(doc[:-1])
        pos.append(torch.arange(n))
        lab = doc[1:].clone()
        lab[: n // 3] = IGNORE_INDEX  # a prompt without loss
        labels.append(lab)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return MicroBatch(torch.cat(ids), torch.cat(pos), torch.cat(labels), cu, sample_ids=[f"mb{index}"])


def global_batches(vocab: int, media: tuple = (), long_items: bool = False, text_only: bool = False,
                   only_group: int | None = None, dp: int = 1, steps: int = STEPS,
                   micro: int = MICRO_PER_STEP, merge: int = 1, vision: str = "siglip") -> list[list[MicroBatch]]:
    """``media``: modalities the rows carry (``text_only``: none, for a model with encoders).
    ``only_group``: only data group ``only_group`` (of ``dp``) gets media. ``micro``:
    micro-batches per global batch. ``merge``, ``vision``: images for a vision tower of that
    spatial merge and kind (``encoders``)."""
    gen = torch.Generator().manual_seed(99)
    if not media:
        return [[micro_batch(gen, vocab, s * micro + i) for i in range(micro)] for s in range(steps)]
    out = []
    for s in range(steps):
        row = []
        for i in range(micro):
            kinds = () if text_only else media if only_group is None or i % dp == only_group else ()
            row.append(media_micro_batch(gen, vocab, s * micro + i, kinds, long_items, merge, vision))
        out.append(row)
    return out
