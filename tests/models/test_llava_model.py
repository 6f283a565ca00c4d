"""A whole LLaVA-1.5 directory through Omni equals transformers: the language model from
``model.pretrained``, the CLIP tower and its projector from the ``clip`` slot's ``pretrained``,
two samples with an image each processed by the plugin's processor and packed into one row by
the data plane. The logits of the packed row equal transformers' logits of each sample run on
its own (relative error <= 1e-5), and Omni's logits of each sample alone; the summed loss
equals the one from transformers' logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dataloading.construct.batch import IGNORE_INDEX
from dataloading.construct.constructor import Tokenized, assemble
from model_helpers import LLAVA_IMAGE_TOKEN, omni_logits, rel_err, save_tiny_llava
from omni.models.build import build_model, media_processors
from omni.models.config import EncoderSlot, ModelConfig

transformers = pytest.importorskip("transformers")
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402


def _sample(name, before, after, item):
    ids = np.array(before + [LLAVA_IMAGE_TOKEN] * item.num_tokens + after, dtype=np.int64)
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = ids[1:]
    labels[len(before) - 1:len(before) + item.num_tokens] = IGNORE_INDEX  # no loss on the image
    return Tokenized(name, ids, labels, [("image", item, np.arange(len(before), len(before) + item.num_tokens))])


@pytest.mark.parametrize("config", [dict(), dict(vision_feature_layer=-1, vision_feature_select_strategy="full",
                                                  tie_word_embeddings=True)], ids=["llava-1.5", "full-tied"])
def test_the_whole_model_equals_transformers_and_a_packed_row_each_sample(tmp_path, config):
    hf = save_tiny_llava(tmp_path, **config)
    ours = build_model(ModelConfig(pretrained=str(tmp_path)), {"vision": EncoderSlot(name="clip", pretrained=str(tmp_path))},
                       vocab_needed=128, seed=0).eval()
    assert ours.llm.config.tie_word_embeddings == bool(config.get("tie_word_embeddings"))
    proc = media_processors(ours)["image"]
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=s, dtype=np.uint8) for s in [(45, 37, 3), (20, 64, 3)]]
    samples = [_sample("a", [5, 6], [7, 8, 9], proc(images[0])), _sample("b", [11], [12, 13, 14, 15], proc(images[1]))]
    assert samples[0].media[0][1].num_tokens == (26 if config else 25)
    pixels = CLIPImageProcessorPil.from_pretrained(tmp_path)
    row = assemble(samples)
    with torch.no_grad():
        packed = omni_logits(ours, row)
        got_loss = ours(row).ce_sum
        want_loss, start = 0.0, 0
        for s, img in zip(samples, images):
            want = hf(input_ids=torch.from_numpy(s.ids)[None],
                      pixel_values=pixels(img, return_tensors="pt")["pixel_values"]).logits[0]
            assert rel_err(packed[start:start + len(s)], want) <= 1e-5
            torch.testing.assert_close(packed[start:start + len(s)], omni_logits(ours, assemble([s])), rtol=1e-5, atol=1e-5)
            keep = torch.from_numpy(s.labels) != IGNORE_INDEX
            want_loss += F.cross_entropy(want[keep], torch.from_numpy(s.labels)[keep], reduction="sum")
            start += len(s)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)


def test_a_llava_directory_is_a_family(tmp_path):
    """``omni.models.load_pretrained`` builds the whole model of a LLaVA directory (tower and
    projector from the ``clip`` plugin), and such a model is exported as the ``llava`` family."""
    from omni.models import load_pretrained
    from omni.models.families import family_of_model

    hf = save_tiny_llava(tmp_path)
    ours = load_pretrained(str(tmp_path)).eval()
    assert family_of_model(ours)[0] == "llava"
    img = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    s = _sample("a", [5], [6, 7], media_processors(ours)["image"](img))
    pixels = CLIPImageProcessorPil.from_pretrained(tmp_path)(img, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(s.ids)[None], pixel_values=pixels).logits[0]
        assert rel_err(omni_logits(ours, assemble([s])), want) <= 1e-5
