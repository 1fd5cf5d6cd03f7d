"""JPEG headers read without decoding: one walk over the marker segments before the first scan (docs/ARCHITECTURE.md,
``images/``; why not Pillow or simplejpeg: "Written here, though a package exists")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


# Frame headers (SOFn): 0xC0 baseline, 0xC1 extended sequential, 0xC2 progressive (Huffman-coded); the rest are
# lossless, hierarchical or arithmetic-coded. 0xC4, 0xC8 and 0xCC, in that range, are DHT, JPG and DAC segments.
SOF_BASELINE = 0xC0
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE_MARKERS = frozenset([0x01, *range(0xD0, 0xD9)])  # TEM, RST0-7, SOI: no length field
_SOS, _EOI, _APP1, _APP14 = 0xDA, 0xD9, 0xE1, 0xEE
_EXIF_PREFIX = b"Exif\x00\x00"
JPEG_SOI = b"\xff\xd8"  # start of image: all the header walk needs
JPEG_MAGIC = JPEG_SOI + b"\xff"  # and the 0xFF of the next marker: what the decoders choose JPEGs by


@dataclass(frozen=True)
class JpegHeader:
    """What a JPEG's headers say about how it is coded."""

    marker: int  # the SOFn marker byte
    precision: int  # bits per sample
    components: int
    component_ids: bytes
    adobe_transform: Optional[int]  # 0: RGB/CMYK stored as is, 1: YCbCr, 2: YCCK; None: no Adobe segment
    has_exif: bool  # an APP1 segment starting "Exif\0\0" before the first scan


def read_jpeg_header(data: bytes) -> Optional[JpegHeader]:
    """The headers of a JPEG, up to its first scan (or a truncated segment); None when `data` is not a JPEG
    whose frame header can be reached (another format, a scan, the end or a cut before any frame header)."""
    if not data.startswith(JPEG_SOI):
        return None
    pos, end = 2, len(data)
    frame, adobe_transform, has_exif = None, None, False
    while pos + 4 <= end:
        if data[pos] != 0xFF:  # not a marker where one must be: the headers end here
            break
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in _STANDALONE_MARKERS:
            pos += 2
            continue
        if marker in (_SOS, _EOI):
            break
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        segment = data[pos + 4 : pos + 2 + length]
        if length < 2 or len(segment) != length - 2:  # truncated: what was read before it stands
            break
        if marker == _APP1 and segment.startswith(_EXIF_PREFIX):
            has_exif = True
        elif marker == _APP14 and segment.startswith(b"Adobe") and len(segment) >= 12:
            adobe_transform = segment[11]
        elif marker in SOF_MARKERS and frame is None:
            if len(segment) < 6:
                return None
            frame = (marker, segment[0], segment[5], bytes(segment[6 : 6 + 3 * segment[5] : 3]))
        pos += 2 + length
    if frame is None:
        return None
    return JpegHeader(*frame, adobe_transform, has_exif)
