"""A whole Qwen3-VL checkpoint through Omni equals transformers on a packed row: two samples,
the first with two images of different sizes, the second with one; Omni's logits over the row
equal transformers' for each sample alone (1e-5 of their largest). DeepStack adds each image's
tower features after the first LLM layers at that image's positions only, and the interleaved
M-RoPE positions restart with each sample."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dataloading.construct.constructor import SampleConstructor, assemble
from dataloading.formats.sample import DecodedSample
from omni.models.build import media_processors

transformers = pytest.importorskip("transformers")


def test_a_packed_row_of_images_equals_transformers_per_sample(tmp_path):
    from hf_family_helpers import save_tiny_qwen3_vl
    from model_helpers import omni_logits, rel_err
    from omni.models.families import load_pretrained, pretrained_tokenizer

    hf, _ = save_tiny_qwen3_vl(tmp_path)
    ours = load_pretrained(str(tmp_path)).eval()
    assert ours.deepstack_layers == 2 and ours.llm.config.mrope_interleaved
    tok = pretrained_tokenizer(str(tmp_path))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=s, dtype=np.uint8) for s in ((48, 72, 3), (100, 60, 3), (96, 128, 3))]
    c = SampleConstructor({}, tok, media_processors(ours), None)
    first = c.tokenize(DecodedSample("a", "two views <image> and <image> of one thing", "a shape", [
        ("image", images[0]), ("image", images[1])]))
    second = c.tokenize(DecodedSample("b", "<image>what is it?", "a square", [("image", images[2])]))
    mb = assemble([first, second])
    pad = tok.placeholder_ids["image"]
    with torch.no_grad():
        got = omni_logits(ours, mb)
        wants = []
        for sample in (first, second):
            items = [it for _, it, _ in sample.media]
            wants.append(hf(input_ids=torch.as_tensor(sample.ids)[None],
                            pixel_values=torch.cat([it.features for it in items]),
                            image_grid_thw=torch.tensor([list(it.size) for it in items]),
                            mm_token_type_ids=torch.as_tensor(sample.ids == pad, dtype=torch.int64)[None]).logits[0])
    sizes = [it.size for s in (first, second) for _, it, _ in s.media]
    assert len(set(sizes)) == 3, sizes  # three grids of different shapes
    n = len(first)
    assert rel_err(got[:n], wants[0]) <= 1e-5
    assert rel_err(got[n:], wants[1]) <= 1e-5
