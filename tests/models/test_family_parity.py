"""Every Hugging Face family Omni loads, in one table (``hf_family_helpers.SAVERS``: adding a family
adds a row): a tiny checkpoint directory of the family, loaded with ``omni.models.load_pretrained``
and called as a module on a chat prompt with an image (built as ``omni generate`` builds it), gives
transformers' logits for the same directory within 1e-5 of their largest."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_family_helpers import SAVERS, hf_inputs, image_prompt, model_logits

transformers = pytest.importorskip("transformers")

IMAGE = np.random.default_rng(3).integers(0, 256, size=(48, 72, 3), dtype=np.uint8)


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_a_family_directory_gives_transformers_logits(tmp_path, family):
    from PIL import Image

    from omni.models.families import family_of, family_of_model
    from recipes.model_source import load_model

    hf, _ = SAVERS[family](tmp_path)
    assert family_of(str(tmp_path))[0] == family
    loaded = load_model(str(tmp_path))
    assert family_of_model(loaded.model)[0] == family
    mb, _ = image_prompt(loaded, IMAGE)
    pad = loaded.tokenizer.placeholder_ids["image"]
    assert int((mb.input_ids == pad).sum()) > 0
    with torch.no_grad():
        want = hf(**hf_inputs(tmp_path, [Image.fromarray(IMAGE)], mb.input_ids.numpy(), pad)).logits[0]
    got = model_logits(loaded.model, mb)
    assert got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
