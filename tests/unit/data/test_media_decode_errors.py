"""A corrupt media file on disk is named by its path in the decode error (plait generate --image/--audio and
training both reach load_image/load_audio); embedded bytes still read "the embedded bytes"."""

import pytest

from plait.data.processing import load_audio, load_image
from plait.data.sources import MediaBytes, SampleError


def test_corrupt_image_file_is_named_by_path(tmp_path):
    path = tmp_path / "corrupt.png"
    path.write_bytes(b"not an image")
    with pytest.raises(SampleError) as err:
        load_image(str(path))
    assert str(err.value) == f"cannot decode image {path}: cannot identify image file '{path}'"


def test_non_audio_file_is_named_by_path(tmp_path):
    path = tmp_path / "some.png"
    path.write_bytes(b"not audio at all")
    with pytest.raises(SampleError) as err:
        load_audio(str(path))
    assert str(err.value) == f"cannot decode audio {path}: Error opening '{path}': Format not recognised."


def test_embedded_bytes_keep_their_label():
    data = MediaBytes(b"not an image", "rec-1 image 0 (embedded, 12 bytes)")
    with pytest.raises(SampleError) as err:
        load_image(data)
    assert str(err.value) == ("cannot decode image rec-1 image 0 (embedded, 12 bytes): "
                              "cannot identify image file the embedded bytes")
