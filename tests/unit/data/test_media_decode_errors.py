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
