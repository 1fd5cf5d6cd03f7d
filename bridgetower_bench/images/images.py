"""Decoding image values to RGB, and the three image pipelines.

A data set row holds an image as a PIL image, a ``{"bytes", "path"}`` dict (the
``datasets`` ``Image(decode=False)`` form), a path, or raw encoded bytes. Every
pipeline turns such a value into a (3, S, S) tensor with the upstream example's
geometry: the shorter side resized to S (bicubic, antialiased), the longer side to
``int(S * long / short)``, then a centre crop of S x S.

Every pipeline first turns the image upright by its EXIF orientation tag, as ``datasets``'
``Image`` feature does for the images it decodes for upstream (``upright``).

``upstream``
    The upstream example's math, bit for bit, for each kind of value it reads. Images
    (embedded bytes, PIL images, ``{"bytes", "path"}`` dicts, which ``datasets`` hands
    upstream as PIL images): ``to_tensor`` (float 0..1), torchvision ``Resize([S],
    BICUBIC, antialias=True)`` on the float tensor, ``CenterCrop(S)``, ``Normalize(mean,
    std)``. Path strings (upstream reads them with ``read_image(path, RGB)``): the same
    ``Resize`` on the uint8 pixels (so rounded to uint8), ``CenterCrop(S)``, conversion to
    float, ``Normalize``. Returns float32, normalised. Intended differences from upstream:
    every PIL mode is converted to RGB by ``to_rgb``, files too (upstream only converted
    1-band images, through 8-bit grey, so palette images lost their colour and 16-bit
    images became white, and RGBA, grey-with-alpha or CMYK images failed in ``Normalize``;
    its ``read_image`` drops alpha and resizes 16-bit PNGs in uint16, where the overshoot
    wraps: ``python -m bridgetower_bench.tools.image_fidelity`` measures both), and image
    files are turned upright too (upstream's ``read_image`` ignores the EXIF tag).
``fast``
    Decodes to uint8, resizes in uint8 with the antialiased bicubic kernel and the same
    geometry, crops. Returns uint8, not normalised: normalisation happens on the device
    (``normalize_on_device``), which also makes host-to-device copies 4x smaller.
    JPEGs are decoded by libjpeg-turbo through ``simplejpeg`` when it is installed (about
    10% faster per core than torchvision's ``decode_jpeg``, which is the fallback), PIL
    decodes the rest. Both run libjpeg-turbo with the accurate integer IDCT and fancy
    chroma upsampling, so their pixels are identical, and so is the output. Colour JPEGs
    are decoded to RGBX: torch's uint8 resize works on 4 interleaved channels (it pads 3
    to 4 itself), so the padding comes free from the decoder and is dropped in the crop.
    Grey JPEGs stay 1-channel until after the resize; CMYK/YCCK JPEGs and any JPEG
    ``simplejpeg`` rejects take the fallback path, so they convert and fail as before.
``fast-draft``
    Like ``fast``, but a JPEG at least twice the target size on its shorter side is first
    downscaled by the JPEG decoder in the DCT domain, which saves most of the inverse-DCT
    and resize work (entropy decoding remains). ``simplejpeg`` decodes at the smallest
    scale M/8 (M = 1..4) that still covers the resized size; without it PIL's ``draft``
    does, choosing among 1/8, 1/4 and 1/2. The resize that follows keeps upstream's
    geometry exactly; the DCT-domain filter makes it less faithful the smaller the scale
    (about 1/255 mean deviation at 1/2, 1.5/255 at 3/8, 2.5/255 at 1/4, instead of
    ``fast``'s 0.28/255 on 800 x 650 cartoons; measure with
    ``python -m bridgetower_bench.tools.image_bench``). Its pixels
    therefore depend on the decoder (``jpeg_decoder``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import CenterCrop, ConvertImageDtype, InterpolationMode, Normalize, Resize
from torchvision.transforms.functional import to_tensor

from bridgetower_bench.images.jpeg_headers import JPEG_MAGIC, read_jpeg_header
from bridgetower_bench.regular_files import NotARegularFile, read_regular_file


try:  # optional: without it JPEGs go to torchvision's decode_jpeg, or PIL's draft for fast-draft
    import simplejpeg
except ImportError:
    simplejpeg = None

IMAGE_PIPELINES = ("upstream", "fast", "fast-draft")

_ALPHA_MODES = ("LA", "La", "PA", "RGBA", "RGBa")
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_WHITE = (255, 255, 255, 255)
_EXIF_ORIENTATION = ExifTags.Base.Orientation
# the EXIF orientation tag (2..8) -> the flips and transposes that make a (..., H, W) tensor upright,
# the same as PIL.ImageOps.exif_transpose does to the image
_UPRIGHT_OPS = {
    2: lambda x: x.flip(-1),
    3: lambda x: x.flip(-2, -1),
    4: lambda x: x.flip(-2),
    5: lambda x: x.transpose(-2, -1),
    6: lambda x: x.transpose(-2, -1).flip(-1),
    7: lambda x: x.transpose(-2, -1).flip(-2, -1),
    8: lambda x: x.transpose(-2, -1).flip(-2),
}
# simplejpeg's name of a JPEG's colour space -> what it decodes it to; others take the fallback path
_SIMPLEJPEG_MODES = {"YCbCr": "RGBX", "RGB": "RGBX", "Gray": "GRAY"}


# ----------------------------------------------------------------------------------------
# Any PIL mode -> 8-bit RGB
# ----------------------------------------------------------------------------------------


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert a PIL image of any mode to 3-channel 8-bit RGB.

    Alpha (an alpha band, or a palette/grey/RGB image with a ``transparency`` entry) is
    composited on white, so transparent regions look like paper rather than black.
    High-bit modes are scaled by their range convention instead of being clipped:
    16-bit and 32-bit integer modes (``I;16*``, and ``I``, which PIL uses for 16-bit PNG
    and TIFF files) are divided by 257 (65535 -> 255); float mode ``F`` is taken as 0..1.
    """
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img
    if mode in _SIXTEEN_BIT_MODES:
        return _grey_array_to_rgb(np.asarray(img, dtype=np.float64) / 257.0)
    if mode == "F":
        return _grey_array_to_rgb(np.asarray(img, dtype=np.float64) * 255.0)
    if mode in _ALPHA_MODES or "transparency" in img.info:
        return _composite_on_white(img)
    return img.convert("RGB")


def _grey_array_to_rgb(values: np.ndarray) -> Image.Image:
    """Round a 0..255 float grey array to uint8 and replicate it into RGB."""
    grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
    return Image.fromarray(grey, mode="L").convert("RGB")


def _composite_on_white(img: Image.Image) -> Image.Image:
    """Flatten an image with transparency onto a white background."""
    if img.mode == "La":  # premultiplied grey+alpha: PIL only converts it to LA
        img = img.convert("LA")
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, _WHITE)
    return Image.alpha_composite(background, rgba).convert("RGB")


# ----------------------------------------------------------------------------------------
# EXIF orientation: every pipeline gives upright images
# ----------------------------------------------------------------------------------------


def upright(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation tag, by the rule ``datasets``' ``Image`` feature decodes with.

    The image is transposed (``PIL.ImageOps.exif_transpose``) when the tag is present, and
    returned as it is otherwise. The transposed image no longer carries the tag, so applying
    this twice (to an image ``datasets`` already turned upright) changes nothing.
    """
    if img.getexif().get(_EXIF_ORIENTATION) is not None:
        return ImageOps.exif_transpose(img)
    return img


def jpeg_has_exif(data: bytes) -> bool:
    """Whether a JPEG carries an EXIF block before its scan, from its headers alone (a few microseconds;
    searching the whole file costs 30 times more), so images without EXIF, most of a data set, skip
    opening them with PIL. A file whose headers cannot be read counts as having EXIF, leaving the
    answer to PIL.
    """
    header = read_jpeg_header(data)
    return True if header is None else header.has_exif


def jpeg_orientation(data: bytes) -> int | None:
    """The EXIF orientation tag of JPEG bytes as PIL reads it (None when absent), without decoding pixels."""
    if not jpeg_has_exif(data):
        return None
    try:
        return Image.open(io.BytesIO(data)).getexif().get(_EXIF_ORIENTATION)
    except Exception:  # unreadable headers: the decoder reports the error, if there is one
        return None


def upright_tensor(pixels: torch.Tensor, orientation: int | None) -> torch.Tensor:
    """A (..., H, W) tensor decoded without regard to EXIF, made upright for ``orientation``.

    The same transposition as ``upright`` does to a PIL image (lossless, on any device);
    orientations other than 2..8 leave the tensor as it is.
    """
    op = _UPRIGHT_OPS.get(orientation)
    return pixels if op is None else op(pixels)


def orientation_swaps_sides(orientation: int | None) -> bool:
    """Whether the orientation turns the image a quarter turn (width and height swap)."""
    return orientation in (5, 6, 7, 8)


# ----------------------------------------------------------------------------------------
# Image values -> encoded bytes / PIL images
# ----------------------------------------------------------------------------------------


class ImageSource(NamedTuple):
    """Where an encoded image value's bytes are: ``data`` when it holds them, else the file at ``path``."""

    data: Optional[bytes]  # embedded or raw bytes (a dict's empty bytes count as none)
    path: Optional[str | os.PathLike]  # a path value, or a dict's non-empty path (also beside its bytes)
    from_dict: bool  # the value is a ``{"bytes", "path"}`` dict


def image_source(value: Any) -> Optional[ImageSource]:
    """Which kind of encoded image value this is: a ``{"bytes", "path"}`` dict (its bytes win over its path),
    a ``str``/``os.PathLike`` path, or raw bytes; None for anything else (a PIL image included)."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        return ImageSource(bytes(data) if data else None, path or None, True)
    if isinstance(value, (str, os.PathLike)):
        return ImageSource(None, value, False)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageSource(bytes(value), None, False)
    return None


def encoded_image_bytes(value: Any) -> tuple[bytes, str]:
    """Return the encoded bytes of an image value and a label naming where they came from.

    ``value`` is a ``{"bytes", "path"}`` dict (bytes win when present; the path is read
    only when bytes are absent), a ``str``/``os.PathLike`` path, or raw bytes. The label
    ("embedded bytes" or the path) is what error messages name.
    """
    source = image_source(value)
    if source is not None:
        if source.data is not None:
            return source.data, "embedded bytes" + (f" (of {source.path!r})" if source.path else "")
        if source.path is not None:
            return _read_file(source.path), repr(os.fspath(source.path))
        raise ValueError("image value has neither embedded bytes nor a path: " + repr(sorted(value)))
    raise ValueError(
        f"unsupported image value of type {type(value).__name__}: expected a PIL image, "
        "a {'bytes', 'path'} dict, a path or bytes"
    )


def _read_file(path: str | os.PathLike) -> bytes:
    try:
        return read_regular_file(path)
    except OSError as error:
        reason = error.strerror if isinstance(error, NotARegularFile) else error
        raise ValueError(f"cannot read image file {os.fspath(path)!r}: {reason}") from error


def _open_pil(data: bytes, label: str) -> Image.Image:
    """Decode encoded bytes with PIL and turn them upright; ``ValueError`` naming ``label`` on failure."""
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        img = upright(img)  # a malformed EXIF block fails here, as it does in datasets' decoding
    except Exception as error:  # PIL raises many types for corrupt data
        raise ValueError(f"cannot decode image from {label}: {error}") from error
    return img


def load_image(value: Any) -> Image.Image:
    """Load any supported image value as an upright (``upright``) RGB PIL image (see ``to_rgb`` for modes).

    Raises ``ValueError`` naming the path (or "embedded bytes") and the reason when the
    value cannot be read or decoded.
    """
    if isinstance(value, Image.Image):
        return to_rgb(upright(value))
    data, label = encoded_image_bytes(value)
    return to_rgb(_open_pil(data, label))


# ----------------------------------------------------------------------------------------
# Geometry
# ----------------------------------------------------------------------------------------


def resize_geometry(width: int, height: int, image_size: int) -> tuple[int, int, int, int]:
    """Upstream's resize-then-centre-crop geometry, as ``(new_w, new_h, top, left)``.

    Same arithmetic as torchvision's ``Resize([image_size])`` (shorter side to
    ``image_size``, longer side ``int(image_size * long / short)``; a square counts as
    "width is shorter") and ``CenterCrop(image_size)`` (offsets ``int(round(excess / 2))``,
    Python's round-half-to-even). Any deviation shifts line art by a pixel, which costs
    about 8/255 of mean error.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image has an empty size {width}x{height}")
    if width <= height:
        new_w, new_h = image_size, int(image_size * height / width)
    else:
        new_w, new_h = int(image_size * width / height), image_size
    top = int(round((new_h - image_size) / 2.0))
    left = int(round((new_w - image_size) / 2.0))
    return new_w, new_h, top, left


# ----------------------------------------------------------------------------------------
# Pipelines
# ----------------------------------------------------------------------------------------


def check_pipeline(pipeline: str) -> None:
    """Raise ``ValueError`` naming ``--image_pipeline`` unless ``pipeline`` is known."""
    if pipeline not in IMAGE_PIPELINES:
        raise ValueError(f"--image_pipeline must be one of {', '.join(IMAGE_PIPELINES)}; got {pipeline!r}")


class UpstreamTransform:
    """The upstream example's transform, per kind of value (see the module docstring). Picklable.

    Path strings take upstream's file route (uint8 pixels resized as uint8, then converted to
    float); every other value is what ``datasets`` hands upstream as a PIL image (converted
    to float first, resized as float). Both routes share one torchvision ``Resize``, which
    computes in the dtype it is given.
    """

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float]):
        self.image_size = image_size
        self.transforms = torch.nn.Sequential(
            Resize([image_size], interpolation=InterpolationMode.BICUBIC, antialias=True),
            CenterCrop(image_size),
            ConvertImageDtype(torch.float),
            Normalize(mean, std),
        )

    def __call__(self, value: Any) -> torch.Tensor:
        img = load_image(value)
        if isinstance(value, (str, os.PathLike)):
            return self.transforms(pil_to_uint8_tensor(img).contiguous())
        return self.transforms(to_tensor(img))


class FastTransform:
    """Decode to uint8, resize with upstream's geometry in uint8, crop. Picklable.

    With ``draft=True`` (the ``fast-draft`` pipeline) large JPEGs are decoded at a reduced
    DCT scale first; everything else takes the ``fast`` path.
    """

    def __init__(self, image_size: int, draft: bool = False):
        self.image_size = image_size
        self.draft = draft

    def __call__(self, value: Any) -> torch.Tensor:
        pixels, full_size = self.decode(value)
        return resize_and_crop(pixels, self.image_size, full_size)

    def decode(self, value: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        """Decode an image value to a uint8 (C, H, W) tensor (C is 3; 4 for RGBX, 1 for grey JPEGs).

        Also returns the (width, height) of the full-resolution image, which differs from
        the tensor's size when the JPEG decoder downscaled it (``fast-draft``).
        """
        if isinstance(value, Image.Image):
            return _full_scale(pil_to_uint8_tensor(load_image(value)))
        data, label = encoded_image_bytes(value)
        if data.startswith(JPEG_MAGIC):
            decoded = self._decode_jpeg(data, label)
            if decoded is not None:
                return _upright_decoded(*decoded, jpeg_orientation(data))
        return _full_scale(pil_to_uint8_tensor(to_rgb(_open_pil(data, label))))

    def _decode_jpeg(self, data: bytes, label: str) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """The JPEG decoders in order of preference; None leaves the image to PIL."""
        decoded = self._decode_simplejpeg(data) if simplejpeg is not None else None
        if decoded is None and self.draft:
            decoded = self._decode_drafted(data, label)
        if decoded is None:
            pixels = _decode_jpeg_or_none(data)
            decoded = None if pixels is None else _full_scale(pixels)
        return decoded

    def _min_decoded_size(self, width: int, height: int) -> tuple[int, int] | None:
        """The resized (width, height) when ``fast-draft`` may decode at a reduced scale, else None."""
        if not self.draft or min(width, height) < 2 * self.image_size:
            return None
        new_w, new_h, _, _ = resize_geometry(width, height, self.image_size)
        return new_w, new_h

    def _decode_simplejpeg(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """Decode with simplejpeg; None for CMYK/YCCK JPEGs and for anything it rejects.

        Colour gives channels-last RGBX (4, H, W), grey (1, H, W). For ``fast-draft`` the
        decoder picks the smallest scale M/8, M <= 4 (``min_factor=2``), covering the resized size.
        """
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace not in _SIMPLEJPEG_MODES:
                return None
            scaled_to = self._min_decoded_size(width, height)  # None: decode at full scale
            min_w, min_h = scaled_to or (0, 0)
            decoded = simplejpeg.decode_jpeg(
                data,
                _SIMPLEJPEG_MODES[colorspace],
                min_height=min_h,
                min_width=min_w,
                min_factor=2 if scaled_to else 1,
            )
        except ValueError:  # simplejpeg's error for corrupt or unsupported data
            return None
        return torch.from_numpy(decoded).permute(2, 0, 1), (width, height)

    def _decode_drafted(self, data: bytes, label: str) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """PIL decode at a reduced DCT scale; None when the image is under 2x the target.

        PIL's ``draft`` picks the smallest 1/2, 1/4 or 1/8 scale whose output still covers
        the resized size, so the exact-geometry resize that follows only ever shrinks.
        """
        try:
            img = Image.open(io.BytesIO(data))
        except Exception:
            return None  # let the regular path decode it, or report why it cannot
        full_size = img.size  # draft shrinks img.size
        min_size = self._min_decoded_size(*full_size)
        if img.format != "JPEG" or min_size is None:
            return None
        try:
            img.draft("RGB", min_size)
            img.load()
        except Exception as error:
            raise ValueError(f"cannot decode image from {label}: {error}") from error
        return pil_to_uint8_tensor(to_rgb(img)), full_size


def _full_scale(pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    return pixels, (pixels.shape[-1], pixels.shape[-2])


def _upright_decoded(
    pixels: torch.Tensor, full_size: tuple[int, int], orientation: int | None
) -> tuple[torch.Tensor, tuple[int, int]]:
    """A JPEG decoded as stored, and its full (width, height), turned upright for its EXIF orientation."""
    if orientation_swaps_sides(orientation):
        full_size = (full_size[1], full_size[0])
    return upright_tensor(pixels, orientation), full_size


def _decode_jpeg_or_none(data: bytes) -> torch.Tensor | None:
    """Decode a JPEG with torchvision; None when it declines (e.g. CMYK, odd progressive files).

    Grey JPEGs stay 1-channel here (the resize is then a third of the work; the channel is
    replicated afterwards, exactly as PIL's L -> RGB conversion does). CMYK JPEGs go to
    PIL so they are converted the same way as in the ``upstream`` pipeline.
    """
    try:
        decoded = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.UNCHANGED)
    except RuntimeError:
        return None
    return decoded if decoded.shape[0] in (1, 3) else None


def pil_to_uint8_tensor(img: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a uint8 (3, H, W) tensor (channels-last memory, as decode_jpeg gives).

    ``np.array`` rather than ``np.asarray``: PIL hands numpy a read-only buffer, and torch
    warns about wrapping one.
    """
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


def resize_and_crop(pixels: torch.Tensor, image_size: int, full_size: tuple[int, int] | None = None) -> torch.Tensor:
    """Resize a uint8 (C, H, W) tensor with upstream's geometry and centre-crop it to 3 x S x S.

    C is 3, 1 (grey: replicated to 3 after the resize) or 4 (RGBX: the 4th channel is
    dropped in the crop). Runs torch's native uint8 antialiased bicubic kernel (the filter
    upstream applies in float, horizontally then vertically, each pass rounded and clamped to
    0..255: ``tools/image_fidelity.py`` measures what that changes) with explicit scale factors,
    which fix where every output pixel samples the input independently of the output
    size. That allows

    * computing only the rows and columns up to the crop's bottom-right corner (the same
      values as a full resize followed by the crop, about 10% less work), and
    * ``full_size``: the (width, height) of the full-resolution image when ``pixels`` is a
      JPEG decoded at a scale M/8 (see ``decoded_scale_eighths``). The geometry is then
      upstream's for the full image, mapped exactly onto the reduced pixels (a reduced
      decode rounds sizes up, so resizing it "to size" would stretch the image slightly).
    """
    height, width = pixels.shape[-2:]
    full_w, full_h = full_size if full_size is not None else (width, height)
    new_w, new_h, top, left = resize_geometry(full_w, full_h, image_size)
    if (new_w, new_h) != (width, height) or (full_w, full_h) != (width, height):
        # output pixels per decoded pixel: upstream's per full-resolution pixel, times 8/M of those per decoded one
        eighths = decoded_scale_eighths((full_w, full_h), (width, height))
        scale_h = new_h / full_h * 8 / eighths
        scale_w = new_w / full_w * 8 / eighths
        corner = [top + image_size, left + image_size]
        pixels = torch.ops.aten._upsample_bicubic2d_aa(pixels[None], corner, False, scale_h, scale_w)[0]
    cropped = pixels[:3, top : top + image_size, left : left + image_size]
    return cropped.expand(3, -1, -1).contiguous()


def decoded_scale_eighths(full_size: tuple[int, int], decoded_size: tuple[int, int]) -> int:
    """The M of a JPEG decoded at scale M/8 (1..8; 8 is full scale), from the two (width, height) sizes.

    libjpeg's scaled decode makes each side ``ceil(full * M / 8)``, for PIL's ``draft``
    (M = 4, 2, 1) as for simplejpeg (any M). Once the shorter side is 8 or more, different
    M give different sizes; below that the largest fitting M is taken. ``ValueError`` when
    no M fits both sides.
    """
    for eighths in range(8, 0, -1):
        if all(-(-full * eighths // 8) == decoded for full, decoded in zip(full_size, decoded_size)):
            return eighths
    raise ValueError(
        f"a {decoded_size[0]}x{decoded_size[1]} image is no M/8 scale (M = 1..8) of a {full_size[0]}x{full_size[1]} one"
    )


def jpeg_decoder(draft: bool = False) -> str:
    """Which decoder the fast pipelines use for colour and grey JPEGs, e.g. ``"simplejpeg 1.9.0"``.

    ``fast`` pixels are the same whichever it is; ``fast-draft`` pixels (``draft=True``) are
    not, as the decoders choose different DCT scales.
    """
    if simplejpeg is not None:
        return f"simplejpeg {simplejpeg.__version__}"
    return "PIL draft" if draft else "torchvision decode_jpeg"


def make_image_transform(
    pipeline: str, image_size: int, mean: Sequence[float], std: Sequence[float]
) -> Callable[[Any], torch.Tensor]:
    """Return the per-image transform of a pipeline: ``value -> (3, S, S)`` tensor.

    ``upstream`` returns float32 normalised with ``mean``/``std``; ``fast`` and
    ``fast-draft`` return uint8 and ignore ``mean``/``std`` (normalise on the device).
    """
    check_pipeline(pipeline)
    if not isinstance(image_size, int) or image_size <= 0:
        raise ValueError(f"image_size must be a positive integer; got {image_size!r}")
    if pipeline == "upstream":
        return UpstreamTransform(image_size, mean, std)
    return FastTransform(image_size, draft=pipeline == "fast-draft")


def normalize_on_device(
    pixel_values_uint8: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(x / 255 - mean) / std`` over the channel dimension (-3), on ``x``'s device.

    Computed in float32 as one multiply and one add, in place on the float copy (a third
    of the memory traffic of four separate operations; equal to them within 1e-6), and
    cast to ``dtype`` at the end, so a bf16 result is rounded once, like upstream's
    float32 normalisation followed by autocast.
    """
    x = pixel_values_uint8
    mean_t = torch.as_tensor(mean, dtype=torch.float64).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float64).view(-1, 1, 1)
    scale = (1.0 / (255.0 * std_t)).to(device=x.device, dtype=torch.float32)
    shift = (-mean_t / std_t).to(device=x.device, dtype=torch.float32)
    normalised = x.to(torch.float32, copy=True).mul_(scale).add_(shift)  # never in place on the input
    return normalised.to(dtype)
