import pytest

from dataloading.errors import DataError
from dataloading.formats.sample import decode_sample, parse_fields


def test_fields_in_placeholder_order(media_bytes):
    png, wav = media_bytes
    raw = parse_fields("s/1", {"txt": b"<audio> <image> <image>", "2.png": png(8, 8), "0.wav": wav(100),
                               "1.PNG": png(16, 8), "json": b'{"a": 1}', "__url__": b"x"})
    assert [(m, n) for m, n, _ in raw.media] == [("audio", "0.wav"), ("image", "1.PNG"), ("image", "2.png")]
    assert raw.meta == {"a": 1} and raw.response is None
    # a video's field and placeholder (tests/data/test_video.py decodes them)
    raw = parse_fields("s/2", {"txt": b"<image> then <video>", "0.jpg": b"", "1.webm": b""})
    assert [(m, n) for m, n, _ in raw.media] == [("image", "0.jpg"), ("video", "1.webm")]
    sample = decode_sample("s/1", {"txt": b"<image>", "png": png(16, 8), "response.txt": b"ok"})
    (modality, image), = sample.media
    assert modality == "image" and image.shape == (16, 8, 3) and image.dtype.name == "uint8"


@pytest.mark.parametrize("fields, needle, kind", [
    ({"png": b""}, "no 'txt' or 'messages.json' field", "bad_fields"),
    ({"txt": b"<image>", "png": b"", "0.png": b""}, "mixes a plain media field", "bad_fields"),
    ({"txt": b"<image><image>", "0.png": b"", "2.png": b""}, "numbered [0, 2]", "bad_fields"),
    ({"txt": b"<image>", "0.avi": b""}, "unsupported media type", "bad_fields"),
    ({"txt": b"<image>", "0.mp4": b""}, "['image'] do not match media fields ['0.mp4'] (['video'])",
     "placeholder_mismatch"),
    ({"txt": b"<image>", "png": b"", "jpg": b""}, "several plain media fields", "bad_fields"),
    ({"txt": b"<image> <audio>", "0.wav": b"", "1.png": b""}, "['image', 'audio'] do not match", "placeholder_mismatch"),
    ({"txt": b"hi", "png": b""}, "text placeholders [] do not match", "placeholder_mismatch"),
    ({"txt": b"hi", "response.txt": b"<image>"}, "response.txt contains a media placeholder", "placeholder_mismatch"),
    ({"txt": b"\xff\xfe"}, "'txt' is not UTF-8", "bad_text"),
    ({"txt": b"hi", "json": b"{"}, "'json' is not valid JSON", "bad_fields"),
])
def test_format_errors_name_the_sample(fields, needle, kind):
    with pytest.raises(DataError) as info:
        parse_fields("src/007", fields)
    assert str(info.value).startswith("sample src/007: ") and needle in str(info.value)
    assert info.value.kind == kind
