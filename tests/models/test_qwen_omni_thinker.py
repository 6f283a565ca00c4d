"""The Omni thinkers (Qwen2.5-Omni, Qwen3-Omni): a tiny random directory of each, in the
thinker-only layout and in the released one (``thinker.`` names, the config nested), loads
with both towers and, on a chat prompt holding an image and two audio clips of different
lengths (built as ``omni generate`` builds it), gives transformers' logits for the same
directory within 1e-5 of their largest."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_family_helpers import model_logits
from hf_omni_helpers import THINKERS, omni_hf_inputs, omni_prompt, tone

transformers = pytest.importorskip("transformers")

IMAGE = np.random.default_rng(5).integers(0, 256, size=(50, 90, 3), dtype=np.uint8)
WAVES = [tone(1.37, 440.0), tone(0.61, 880.0)]  # 219 and 97 mel frames: several chunks, odd counts


@pytest.mark.parametrize("released", [False, True], ids=["thinker-only", "released layout"])
@pytest.mark.parametrize("family", sorted(THINKERS))
def test_a_thinker_directory_gives_transformers_logits(tmp_path, family, released):
    from PIL import Image

    from omni.models.families import family_of, family_of_model
    from recipes.model_source import load_model

    saver, thinker_type, whole_type, image_token, audio_token = THINKERS[family]
    hf, tok = saver(tmp_path, released=released)
    assert family_of(str(tmp_path))[0] == (whole_type if released else thinker_type)
    loaded = load_model(str(tmp_path))
    assert set(loaded.model.encoders) == {"image", "audio"}
    assert family_of_model(loaded.model)[0] in (thinker_type, whole_type)
    mb = omni_prompt(loaded, IMAGE, WAVES)
    ids = mb.input_ids.numpy()
    audio, image = tok.convert_tokens_to_ids(audio_token), tok.convert_tokens_to_ids(image_token)
    assert int((ids == image).sum()) > 0 and int((ids == audio).sum()) > 0
    with torch.no_grad():
        want = hf(**omni_hf_inputs(tmp_path, [Image.fromarray(IMAGE)], WAVES, ids)).logits[0]
    got = model_logits(loaded.model, mb)
    assert got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
