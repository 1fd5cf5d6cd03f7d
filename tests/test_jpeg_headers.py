"""One reader of JPEG headers for every image path: frame, Adobe transform and EXIF, as Pillow writes them."""

import io

import pytest
from PIL import Image

from bridgetower_bench.images.jpeg_headers import read_jpeg_header
from helpers import encode


def jpeg(mode="RGB", size=(24, 16), **save):
    return encode(Image.new(mode, size, 128 if mode == "L" else None), "JPEG", **save)


@pytest.mark.parametrize(
    "mode, options, marker, components",
    [("RGB", {}, 0xC0, 3), ("RGB", {"progressive": True}, 0xC2, 3), ("L", {}, 0xC0, 1), ("CMYK", {}, 0xC0, 4)],
)
def test_the_frame_header_says_how_the_file_is_coded(mode, options, marker, components):
    header = read_jpeg_header(jpeg(mode, **options))
    assert (header.marker, header.precision, header.components) == (marker, 8, components)
    assert header.has_exif is False
    assert header.adobe_transform == (0 if mode == "CMYK" else None)  # Pillow stores CMYK as is, in an Adobe segment
    assert len(header.component_ids) == components


def test_an_exif_block_is_seen_and_pillow_agrees_on_the_orientation():
    exif = Image.Exif()
    exif[0x0112] = 6
    data = jpeg(exif=exif)
    assert read_jpeg_header(data).has_exif
    assert Image.open(io.BytesIO(data)).getexif()[0x0112] == 6


# nothing, a PNG, a bare start marker, garbage after it, a scan before any frame
@pytest.mark.parametrize(
    "data", [b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8", b"\xff\xd8garbage", b"\xff\xd8\xff\xda\x00\x02"]
)
def test_no_header_when_there_is_no_readable_frame(data):
    assert read_jpeg_header(data) is None


def test_a_file_cut_inside_its_headers_has_none():
    data = jpeg()
    frame_at = data.index(b"\xff\xc0")
    assert read_jpeg_header(data[: frame_at + 6]) is None  # inside the frame header
    assert read_jpeg_header(data[: frame_at + 40]).components == 3  # the frame header whole, a later segment cut
