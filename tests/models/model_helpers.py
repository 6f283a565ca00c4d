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


def saved_hf_model(model_cls, config, tmp_path_factory, name: str):
    """A random transformers ``model_cls`` of ``config`` (seed 0) saved to a new temporary folder
    ``name``: (the folder, the model in eval mode). For a module-scoped checkpoint fixture."""
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return str(path), hf


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


def plugin_and_hf_pixels(encoder_cls, path, pixel_processor, size):
    """One random image of ``size`` (seed 1) through the processor an encoder plugin builds from
    the directory ``path`` (``plugin_processor``) and through transformers' ``pixel_processor``
    loaded from it: (our item, transformers' output)."""
    import numpy as np

    proc = plugin_processor(encoder_cls, path)
    image = np.random.default_rng(1).integers(0, 256, size=(*size, 3), dtype=np.uint8)
    return proc(image), pixel_processor.from_pretrained(path)(images=[image], return_tensors="pt")


def assert_tile_pixels(item, want, size):
    """An anyres item of an image of ``size`` pixels (the tiny families' tiles: 16 pixels a side
    in 4 x 4 patches) against transformers' ``pixel_values`` ``want``: one tile each, the same
    pixels."""
    n = want.shape[0]
    assert item.size == (n, *size, 0)
    ours = item.features.view(n, 4, 4, 3, 4, 4).permute(0, 3, 1, 4, 2, 5).reshape(n, 3, 16, 16)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)


def assert_export_round_trips(tmp_path, hf, config_keys, pixel_processor):
    """``omni export`` of the directory ``tmp_path/hf`` (``hf``: the model saved there) to
    ``tmp_path/a``: transformers loads it with the same tensors and the same ``config_keys``, the
    image processor's settings are the directory's, Omni loads it back with transformers'
    logits on an image (``pixel_processor``: transformers' processor of the family), and
    exporting the export (to ``tmp_path/b``) writes the same bytes."""
    import json

    import numpy as np
    import transformers

    from dataloading.construct.constructor import assemble
    from omni.models import load_pretrained
    from omni.models.build import media_processors
    from recipes.cli import main

    assert main(["export", str(tmp_path / "hf"), "--out", str(tmp_path / "a")]) == 0
    back = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "a").eval()
    assert type(back) is type(hf)
    want, got = hf.state_dict(), back.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    for key in config_keys:
        assert getattr(back.config, key) == getattr(hf.config, key), key
    pp = [json.loads((tmp_path / d / "preprocessor_config.json").read_text()) for d in ("hf", "a")]
    assert {k: pp[1][k] for k in pp[0]} == pp[0]
    image = np.random.default_rng(2).integers(0, 256, size=(30, 19, 3), dtype=np.uint8)
    ours = load_pretrained(str(tmp_path / "a")).eval()
    item = media_processors(ours)["image"](image)
    s = media_sample("a", [5], [6, 7], item, hf.config.image_token_id)
    with torch.no_grad():
        pixels = pixel_processor.from_pretrained(tmp_path / "a")(images=[image], return_tensors="pt")
        want = back(input_ids=torch.from_numpy(s.ids)[None], **pixels).logits[0]
        assert rel_err(omni_logits(ours, assemble([s])), want) <= 1e-5
    assert main(["export", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 0
    first, second = ({p.name: p.read_bytes() for p in sorted((tmp_path / d).iterdir()) if p.is_file()} for d in "ab")
    assert first.keys() == second.keys() and all(first[k] == second[k] for k in first)
