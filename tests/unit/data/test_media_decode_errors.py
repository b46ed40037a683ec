"""A corrupt media file on disk is named by its path in the decode error (plait generate --image/--audio and
training both reach load_image/load_audio); embedded bytes still read "the embedded bytes"."""

import pytest

from plait.data.processing import load_audio, load_image
from plait.data.sources import MediaBytes, SampleError


@pytest.mark.parametrize("load, name, content, message", [
    (load_image, "corrupt.png", b"not an image", "cannot decode image {path}: cannot identify image file '{path}'"),
    (load_audio, "some.png", b"not audio at all",
     "cannot decode audio {path}: Error opening '{path}': Format not recognised."),
], ids=["image", "audio"])
def test_corrupt_media_file_is_named_by_path(tmp_path, load, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SampleError) as err:
        load(str(path))
    assert str(err.value) == message.format(path=path)


def test_embedded_bytes_keep_their_label():
    data = MediaBytes(b"not an image", "rec-1 image 0 (embedded, 12 bytes)")
    with pytest.raises(SampleError) as err:
        load_image(data)
    assert str(err.value) == ("cannot decode image rec-1 image 0 (embedded, 12 bytes): "
                              "cannot identify image file the embedded bytes")


@pytest.mark.parametrize("name, content, reason", [
    ("empty.wav", b"", "no audio frames (empty file, 0 bytes)"),
    ("empty.flac", b"", "no audio frames (empty file, 0 bytes)"),
    ("short.wav", b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00",
     "no audio frames (the file ends inside its header: truncated)"),
])
def test_an_empty_or_truncated_audio_file_says_why(tmp_path, name, content, reason):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(SampleError) as err:
        load_audio(str(path))
    assert str(err.value) == f"cannot decode audio {path}: {reason}"
    with pytest.raises(SampleError) as err:
        load_audio(MediaBytes(content, "rec-1 audio 0 (embedded)"))
    assert str(err.value).endswith(reason.replace(f"{path}", "the embedded bytes"))


def test_an_empty_image_says_why(tmp_path):
    path = tmp_path / "empty.png"
    path.write_bytes(b"")
    with pytest.raises(SampleError) as err:
        load_image(str(path))
    assert str(err.value) == f"cannot decode image {path}: no image data (empty file, 0 bytes)"


def test_decode_reason_keeps_a_decoders_message_and_drops_a_dangling_colon():
    from plait.data.processing import decode_reason

    assert decode_reason(ValueError("Error opening 'x.flac': "), "missing-file.flac") == "Error opening 'x.flac'"
    assert decode_reason(RuntimeError(), "missing-file.flac") == "RuntimeError"


def test_the_metadata_scan_gives_the_same_reason(tmp_path):
    """Training reads audio headers first (plait.data.record_metadata): an empty WAV reads as load_audio says it."""
    from plait.data.record_metadata import Headers, _audio_header

    path = tmp_path / "empty.wav"
    path.write_bytes(b"")
    with pytest.raises(SampleError) as err:
        _audio_header(str(path), Headers())
    assert str(err.value) == f"cannot decode audio {path}: no audio frames (empty file, 0 bytes)"
