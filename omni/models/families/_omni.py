"""What the Omni thinkers' rooms share (``qwen_omni``, ``qwen3_omni``): their ``Family`` entry
(``thinker_family``), the framing-token check before an export, and the processor's files (the
image processor's and the feature extractor's settings, nested in processor_config.json as
transformers writes them)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from dataloading.formats.tokenizer import PlaceholderTokens, Tokenizer
from omni.errors import ConfigError
from omni.models.families._hf_export import write_processor_config
from omni.models.families.family import Family, config_ids
from omni.models.multimodal import OmniModel


def require_framing(ids: Mapping[str, Optional[int]], tokens: Mapping[str, PlaceholderTokens], family: str) -> None:
    """Refuse, in one line, to export a run whose tokenizer lacks the tokens that open an image
    or a clip (``ids``: ``config_ids``, -1 where absent): transformers' thinker finds each item by
    the token before it (get_rope_index), so without it an image would take text positions there
    and the export would compute other logits."""
    absent = [tokens[m].before for m, field in (("image", "vision_start_token_id"), ("audio", "audio_start_token_id"))
              if ids[field] < 0]
    if absent:
        raise ConfigError(f"a {family} thinker finds its images and clips by {' and '.join(absent)}, which this run's "
                          f"tokenizer lacks; train with the family's tokenizer (data.tokenizer=<a {family} directory>) "
                          f"to export")


def write_thinker_processor(model: OmniModel, path: str, processor: str) -> None:
    """processor_config.json of a thinker: its image processor's settings and its feature
    extractor's (``WhisperFeatureExtractor`` as the audio tower's processor computes)."""
    import transformers

    from omni.models.families.qwen_vl import image_processor_settings

    audio = model.encoders["audio"].config
    extractor = transformers.WhisperFeatureExtractor(
        feature_size=audio.num_mel_bins, sampling_rate=audio.sampling_rate, hop_length=audio.hop_length,
        n_fft=audio.n_fft, chunk_length=audio.max_frames * audio.hop_length // audio.sampling_rate)
    write_processor_config(path, processor,
                           transformers.Qwen2VLImageProcessorPil(**image_processor_settings(model.encoders["image"])),
                           feature_extractor=extractor.to_dict())


def thinker_family(vision: str, audio: str, tokens: Mapping[str, PlaceholderTokens], ids: Mapping[str, str],
                   name: str, export: Callable[..., None], processor: str,
                   towers: Callable[[OmniModel], Optional[tuple]]) -> Family:
    """The entry of an Omni thinker family: its two towers' plugins, its ``tokens``, an exporter
    that checks the framing tokens, writes the model (``export(model, path, image_token_id=,
    audio_token_id=, token_ids=)``, the config fields of ``ids``) and the ``processor``'s files;
    it matches a model whose ``towers`` are the family's."""

    def export_family(model: OmniModel, path: str, tokenizer: Tokenizer, vocab: Any) -> None:
        token_ids = config_ids(vocab, ids)
        require_framing(token_ids, tokens, name)
        export(model, path, image_token_id=tokenizer.placeholder_ids["image"],
               audio_token_id=tokenizer.placeholder_ids["audio"], token_ids=token_ids)
        write_thinker_processor(model, path, processor)

    return Family(vision=vision, audio=audio, family_tokens=tokens, export=export_family,
                  matches=lambda model: towers(model) is not None)


def towers_or_refuse(towers: Optional[tuple], name: str, vision: str, audio: str) -> tuple:
    """A thinker's (vision, audio) towers (``towers``: the room's finding of them), or one line
    naming the two plugins a ``name`` thinker holds."""
    if towers is None:
        raise ValueError(f"a {name} thinker has exactly two towers: encoders.vision.name={vision} and "
                         f"encoders.audio.name={audio}")
    return towers
