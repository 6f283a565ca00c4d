"""A model is called as any module is (issue 39): ``model(input_ids)`` on a model loaded with
``omni.models.load_pretrained`` returns the logits transformers gives for the same directory,
text rows as a batch and a row with its image (media written at the placeholders), outside any
training step; what it cannot run is one ``TypeError`` / ``RuntimeError`` line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dataloading.construct.batch import IGNORE_INDEX
from dataloading.construct.constructor import Tokenized, assemble
from model_helpers import LLAVA_IMAGE_TOKEN, rel_err, save_tiny_llava

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from omni.models import load_pretrained

    path = tmp_path_factory.mktemp("llava")
    hf = save_tiny_llava(path)
    return hf, load_pretrained(str(path)).eval(), path


def test_text_rows_give_transformers_logits(llava):
    hf, ours, _ = llava
    ids = torch.randint(0, LLAVA_IMAGE_TOKEN, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours(ids), hf(input_ids=ids).logits
        one = ours(ids[1])
    assert got.shape == want.shape == (2, 12, hf.config.text_config.vocab_size)
    assert rel_err(got, want) <= 1e-5
    torch.testing.assert_close(one[0], got[1], rtol=1e-6, atol=1e-6)  # a [T] row is a batch of one


def test_a_row_with_its_image_gives_transformers_logits(llava):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from omni.models.build import media_processors

    hf, ours, path = llava
    img = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    item = media_processors(ours)["image"](img)
    ids = np.array([5, 6] + [LLAVA_IMAGE_TOKEN] * item.num_tokens + [7, 8], dtype=np.int64)
    row = assemble([Tokenized("a", ids, np.full(ids.shape, IGNORE_INDEX), [("image", item, np.arange(2, 2 + item.num_tokens))])])
    pixels = CLIPImageProcessorPil.from_pretrained(path)(img, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        got = ours(row.input_ids, media=row.media)
        want = hf(input_ids=torch.from_numpy(ids)[None], pixel_values=pixels).logits
    assert rel_err(got, want) <= 1e-5


def test_what_a_model_call_cannot_run_is_one_line(llava):
    _, ours, _ = llava
    with pytest.raises(TypeError, match="pipeline stage's activation with its Prepared micro-batch"):
        ours(torch.zeros(1, 4, 32))  # an activation without its micro-batch
    with pytest.raises(ValueError, match="media go with one row"):
        ours(torch.zeros(2, 4, dtype=torch.long), media={"image": None})
