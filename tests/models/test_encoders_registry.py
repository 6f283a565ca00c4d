"""Encoder registry: built-ins, entry-point plugins, dotted class paths, config validation."""
import textwrap

import pytest
import torch

from omni.models.encoders import EncoderAnchor, available_encoders, build_encoder, get_encoder_class
from omni.models.encoders.siglip import SiglipEncoder
from omni.models.encoders.whisper import WhisperEncoder

TOY_MODULE = '''
from dataclasses import dataclass
import torch
from omni.models.encoders.base import EncoderAnchor


@dataclass
class ToyConfig:
    width: int = 4


class ToyEncoder(EncoderAnchor):
    modality = "toy"
    Config = ToyConfig

    def __init__(self, config):
        super().__init__(config)
        self.output_dim = config.width
        self.proj = torch.nn.Linear(1, config.width)

    def forward(self, features, sizes):
        return self.proj(features)

    def cost_coefficients(self):
        return 0.0, 2.0 * self.config.width
'''


@pytest.fixture
def toy_plugin(tmp_path, monkeypatch):
    """An installed-looking plugin package: a module plus a .dist-info with an entry point."""
    (tmp_path / "omni_toy_enc.py").write_text(TOY_MODULE)
    info = tmp_path / "omni_toy_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-toy-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [omni.encoders]
            toy = omni_toy_enc:ToyEncoder
            siglip = omni_toy_enc:ToyEncoder
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_builtins_are_available():
    avail = available_encoders()
    assert avail["siglip"] == avail["whisper"] == "omni (built-in)"
    assert get_encoder_class("siglip") is SiglipEncoder
    assert get_encoder_class("whisper") is WhisperEncoder
    assert SiglipEncoder.modality == "image" and WhisperEncoder.modality == "audio"
    assert available_encoders()["qwen_vl"] == "omni (built-in)"
    assert get_encoder_class("qwen_vl").__name__ == "QwenVisionEncoder"
    assert available_encoders()["clip"] == "omni (built-in)"
    assert get_encoder_class("clip").__name__ == "ClipEncoder"
    assert available_encoders()["siglip2"] == "omni (built-in)"
    assert get_encoder_class("siglip2").__name__ == "Siglip2Encoder"


def test_unknown_name_lists_registered_encoders():
    with pytest.raises(ValueError) as err:
        get_encoder_class("nope")
    msg = str(err.value)
    assert "unknown encoder 'nope'" in msg and "siglip, whisper" in msg and "omni.encoders" in msg


def test_dotted_class_paths():
    assert get_encoder_class("omni.models.encoders.siglip:SiglipEncoder") is SiglipEncoder
    assert get_encoder_class("omni.models.encoders.whisper.WhisperEncoder") is WhisperEncoder
    with pytest.raises(ValueError, match="cannot import encoder class"):
        get_encoder_class("omni.models.encoders.nowhere:Thing")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        get_encoder_class("omni.models.encoders.siglip:Nope")
    with pytest.raises(ValueError, match="not an encoder plugin"):
        get_encoder_class("collections:OrderedDict")


def test_entry_point_plugin(toy_plugin):
    with pytest.warns(UserWarning, match="built-in name"):
        avail = available_encoders()
    assert avail["toy"] == "entry point omni.encoders from package omni-toy-plugin 0.3"
    assert avail["siglip"] == "omni (built-in)"  # a plugin cannot shadow a built-in
    with pytest.warns(UserWarning):
        cls = get_encoder_class("toy")
        assert get_encoder_class("siglip") is SiglipEncoder
    assert issubclass(cls, EncoderAnchor) and cls.modality == "toy"
    with pytest.warns(UserWarning):
        enc = build_encoder("toy", {"width": 3})
    assert enc.output_dim == 3 and enc(torch.ones(5, 1), torch.ones(5, 1, dtype=torch.int64)).shape == (5, 3)
    # the built-ins in their order, then the plugin
    names = ", ".join([*(n for n, origin in avail.items() if origin == "omni (built-in)"), "toy"])
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=f"registered encoders: {names} "):
        get_encoder_class("nope")


@pytest.mark.parametrize("cls", [SiglipEncoder, WhisperEncoder])
def test_build_config_rejects_unknown_key(cls):
    with pytest.raises(ValueError) as err:
        cls.build_config({"num_hiden_layers": 2})
    msg = str(err.value)
    assert "'num_hiden_layers'" in msg and cls.__name__ in msg and "valid keys:" in msg
    with pytest.raises(ValueError, match="'bogus'"):
        build_encoder("siglip" if cls is SiglipEncoder else "whisper", {"bogus": 1})


def test_build_encoder_from_hydra_params():
    omegaconf = pytest.importorskip("omegaconf")
    params = omegaconf.OmegaConf.create(
        {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "image_size": 16, "patch_size": 8, "image_mean": [0.1, 0.2, 0.3]}
    )
    enc = build_encoder("siglip", params)
    assert isinstance(enc, SiglipEncoder) and enc.output_dim == 16
    assert enc.config.image_mean == [0.1, 0.2, 0.3] and enc.config.max_patches == 4
    audio = build_encoder("whisper", {"num_mel_bins": 8, "d_model": 16, "encoder_layers": 1,
                                      "encoder_attention_heads": 2, "encoder_ffn_dim": 32,
                                      "max_source_positions": 8})
    assert audio.output_dim == 16 and audio.config.max_frames == 16
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_encoder("whisper", {}, pretrained="/nonexistent/whisper-dir")
