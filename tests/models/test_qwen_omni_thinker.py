"""The Omni thinkers (Qwen2.5-Omni, Qwen3-Omni): a tiny random directory of each, in the
thinker-only layout and in the released one (``thinker.`` names, the config nested), loads
with both towers and, on a chat prompt holding an image and two audio clips of different
lengths (built as ``omni generate`` builds it), gives transformers' logits for the same
directory within 1e-5 of their largest; so does a prompt holding an image, a clip and a video
with its own audio track (each family's interleaving)."""
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


@pytest.mark.parametrize("family", sorted(THINKERS))
def test_a_prompt_with_a_clip_and_a_video_with_its_own_track_gives_transformers_logits(tmp_path, family):
    """An image, an audio clip and a 2-second video with its AAC track (Qwen2.5-Omni: interleaved
    in 2-second chunks; Qwen3-Omni: token by token by time) in one prompt: the audio tower takes
    the clip and the track, the vision tower the image and the frames; logits within 1e-5."""
    pytest.importorskip("av")
    import dataclasses

    from PIL import Image

    from dataloading.formats.video import audio_track, decode_video
    from hf_omni_helpers import omni_prompt_media
    from media_helpers import clip_with_audio_bytes
    from recipes.model_source import load_model

    saver, _, _, image_token, audio_token = THINKERS[family]
    hf, tok = saver(tmp_path)
    loaded = load_model(str(tmp_path))
    data = clip_with_audio_bytes(seconds=2.0, height=64, width=96, hz=330.0)
    track = audio_track(data)
    clip = dataclasses.replace(decode_video(data), audio=track)
    mb = omni_prompt_media(loaded, [("image", IMAGE), ("audio", (WAVES[1], 16000)), ("video", clip)],
                           "what do you see and hear?")
    enc = loaded.model.encoders["image"]
    item = type(enc).processor(enc.config).video(decode_video(data))
    assert item.size[0] == 2 and mb.media["audio"].num_tokens.numel() == 2  # the clip and the track
    ids = mb.input_ids.numpy()
    audio = tok.convert_tokens_to_ids(audio_token)
    video_at = np.flatnonzero(ids == tok.convert_tokens_to_ids(image_token))[-item.num_tokens:]
    hf_ids = ids.copy()
    hf_ids[video_at] = tok.convert_tokens_to_ids(image_token.replace("IMAGE", "VIDEO").replace("image", "video"))
    assert np.diff(np.flatnonzero(ids == audio)).max() > 1  # the track's tokens are interleaved with frames
    inputs = omni_hf_inputs(tmp_path, [Image.fromarray(IMAGE)], [WAVES[1], track[0]], hf_ids)
    with torch.no_grad():
        want = hf(**inputs, pixel_values_videos=item.features, video_grid_thw=torch.tensor([list(item.size)]),
                  video_second_per_grid=torch.tensor([1.0]), use_audio_in_video=True).logits[0]
    got = model_logits(loaded.model, mb)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
