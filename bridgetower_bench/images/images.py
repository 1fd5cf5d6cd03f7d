"""Decoding any image value to upright RGB, and the image pipelines ``upstream``, ``fast`` and ``fast-draft``
(docs/ARCHITECTURE.md, "The image pipelines"; what they change from upstream: docs/UPSTREAM.md)."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import numpy as np
import PIL
import torch
from PIL import ExifTags, Image, ImageOps
from torchvision.transforms import CenterCrop, ConvertImageDtype, InterpolationMode, Normalize, Resize
from torchvision.transforms.functional import to_tensor

from bridgetower_bench.images.jpeg_headers import JPEG_MAGIC, read_jpeg_header
from bridgetower_bench.output_dir import run_recipe
from bridgetower_bench.regular_files import NotARegularFile, read_regular_file


try:  # optional: without it JPEGs go to Pillow (at a reduced scale for fast-draft where it helps)
    import simplejpeg
except ImportError:
    simplejpeg = None

IMAGE_PIPELINES = ("upstream", "fast", "fast-draft")

_ALPHA_MODES = ("LA", "La", "PA", "RGBA", "RGBa")
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_WHITE = (255, 255, 255, 255)
_EXIF_ORIENTATION = ExifTags.Base.Orientation
_QUARTER_TURNS = (5, 6, 7, 8)  # EXIF orientations that swap width and height
# the flips that then make a (..., H, W) tensor upright, as PIL.ImageOps.exif_transpose does to the image
_UPRIGHT_FLIPS: dict[int | None, tuple[int, ...]] = {2: (-1,), 3: (-2, -1), 4: (-2,), 6: (-1,), 7: (-2, -1), 8: (-2,)}
# simplejpeg's name of a JPEG's colour space -> what it decodes it to; others take the fallback path. RGBX:
# torch's uint8 resize pads 3 channels to 4 itself, so the decoder's padding is free (the crop drops it).
_SIMPLEJPEG_MODES = {"YCbCr": "RGBX", "RGB": "RGBX", "Gray": "GRAY"}


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode as 8-bit RGB (an RGB image without transparency: itself): transparency composited on white,
    16- and 32-bit integers (``I``: 16-bit PNG and TIFF) divided by 257 (65535 -> 255), ``F`` taken as 0..1."""
    if img.mode in _SIXTEEN_BIT_MODES or img.mode == "F":
        values = np.asarray(img, dtype=np.float64)
        values = values * 255.0 if img.mode == "F" else values / 257.0
        grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = (img.convert("LA") if img.mode == "La" else img).convert("RGBA")  # PIL converts La only to LA
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def upright(img: Image.Image) -> Image.Image:
    """``img`` turned by its EXIF orientation tag (``PIL.ImageOps.exif_transpose``), as ``datasets``' ``Image``
    feature decodes; the result has no tag, so turning an image twice changes nothing."""
    if img.getexif().get(_EXIF_ORIENTATION) is not None:
        return ImageOps.exif_transpose(img)
    return img


def jpeg_has_exif(data: bytes) -> bool:
    """Whether a JPEG has an EXIF block before its scan, from its headers alone (30 times cheaper than searching
    the file), so most images skip PIL; True when the headers cannot be walked (PIL then decides)."""
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
    """A (..., H, W) tensor decoded without regard to EXIF, turned as ``upright`` turns a PIL image (on any
    device); orientations other than 2..8 leave it as it is."""
    if orientation in _QUARTER_TURNS:
        pixels = pixels.transpose(-2, -1)
    flips = _UPRIGHT_FLIPS.get(orientation)
    return pixels if flips is None else pixels.flip(flips)


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
    """The encoded bytes of an image value (``image_source``; a file is read only without bytes) and the label
    error messages name them by ("embedded bytes" or the path); ``ValueError`` when there are none."""
    source = image_source(value)
    if source is None:
        raise ValueError(
            f"unsupported image value of type {type(value).__name__}: expected a PIL image, "
            "a {'bytes', 'path'} dict, a path or bytes"
        )
    if source.data is not None:
        return source.data, "embedded bytes" + (f" (of {source.path!r})" if source.path else "")
    if source.path is None:
        raise ValueError("image value has neither embedded bytes nor a path: " + repr(sorted(value)))
    try:
        return read_regular_file(source.path), repr(os.fspath(source.path))
    except OSError as error:
        reason = error.strerror if isinstance(error, NotARegularFile) else error
        raise ValueError(f"cannot read image file {os.fspath(source.path)!r}: {reason}") from error


def _open_pil(data: bytes, label: str) -> Image.Image:
    """Decode encoded bytes with PIL and turn them upright; ``ValueError`` naming ``label`` on failure."""
    try:
        img: Image.Image = Image.open(io.BytesIO(data))
        img.load()
        img = upright(img)  # a malformed EXIF block fails here, as it does in datasets' decoding
    except Exception as error:  # PIL raises many types for corrupt data
        raise ValueError(f"cannot decode image from {label}: {error}") from error
    return img


def load_image(value: Any) -> Image.Image:
    """Any supported image value as an upright RGB PIL image (``to_rgb``); ``ValueError`` naming the path (or
    "embedded bytes") and the reason when it cannot be read or decoded."""
    if isinstance(value, Image.Image):
        return to_rgb(upright(value))
    return to_rgb(_open_pil(*encoded_image_bytes(value)))


def resize_geometry(width: int, height: int, image_size: int) -> tuple[int, int, int, int]:
    """Upstream's resize-then-centre-crop geometry, ``(new_w, new_h, top, left)``: torchvision's ``Resize([S])``
    and ``CenterCrop(S)`` to the pixel (a pixel's shift costs line art about 8/255 of mean error)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image has an empty size {width}x{height}")
    if width <= height:
        new_w, new_h = image_size, int(image_size * height / width)
    else:
        new_w, new_h = int(image_size * width / height), image_size
    top = int(round((new_h - image_size) / 2.0))
    left = int(round((new_w - image_size) / 2.0))
    return new_w, new_h, top, left


def check_pipeline(pipeline: str) -> None:
    """Raise ``ValueError`` naming ``--image_pipeline`` unless ``pipeline`` is known."""
    if pipeline not in IMAGE_PIPELINES:
        raise ValueError(f"--image_pipeline must be one of {', '.join(IMAGE_PIPELINES)}; got {pipeline!r}")


class UpstreamTransform:
    """The upstream example's transform: path strings resized in uint8, every other value in float (one
    ``Resize`` for both: it computes in the dtype it is given). Picklable."""

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float]):
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
    """Decode to uint8, resize with upstream's geometry in uint8, crop (``fast``; with ``draft=True``,
    ``fast-draft``: large JPEGs decoded at a reduced DCT scale first). Picklable."""

    def __init__(self, image_size: int, draft: bool = False):
        self.image_size = image_size
        self.draft = draft

    def __call__(self, value: Any) -> torch.Tensor:
        pixels, full_size = self.decode(value)
        return resize_and_crop(pixels, self.image_size, full_size)

    def decode(self, value: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        """An image value as upright uint8 (C, H, W) pixels (C is 3; 4 for RGBX, 1 for grey JPEGs) and the full
        image's (width, height), which the pixels' differs from when the JPEG decoder downscaled."""
        if isinstance(value, Image.Image):
            img = load_image(value)
        else:
            data, label = encoded_image_bytes(value)
            decoded = None
            if data.startswith(JPEG_MAGIC):  # the JPEG decoders in order of preference; None leaves it to PIL
                decoded = self._decode_simplejpeg(data) if simplejpeg is not None else None
                if decoded is None and self.draft:
                    decoded = self._decode_drafted(data, label)
            if decoded is not None:  # pixels as stored: turned upright here
                pixels, (width, height) = decoded
                orientation = jpeg_orientation(data)
                if orientation in _QUARTER_TURNS:
                    width, height = height, width
                return upright_tensor(pixels, orientation), (width, height)
            img = to_rgb(_open_pil(data, label))
        pixels = pil_to_uint8_tensor(img)
        return pixels, (pixels.shape[-1], pixels.shape[-2])

    def _min_decoded_size(self, width: int, height: int) -> tuple[int, int] | None:
        """The resized (width, height) when ``fast-draft`` may decode at a reduced scale, else None."""
        if not self.draft or min(width, height) < 2 * self.image_size:
            return None
        new_w, new_h, _, _ = resize_geometry(width, height, self.image_size)
        return new_w, new_h

    def _decode_simplejpeg(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """Channels-last RGBX (4, H, W) or grey (1, H, W) from simplejpeg; None for CMYK/YCCK and what it rejects.
        ``fast-draft``: the smallest scale M/8, M <= 4 (``min_factor=2``), that covers the resized size."""
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
        """PIL's decode at the smallest 1/2, 1/4 or 1/8 scale that covers the resized size (the resize then
        only shrinks); None when the image is under twice the target."""
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


def pil_to_uint8_tensor(img: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a uint8 (3, H, W) tensor (channels-last memory, as the JPEG decoders give)."""
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)  # np.array: torch warns about PIL's read-only buffer


def resize_and_crop(pixels: torch.Tensor, image_size: int, full_size: tuple[int, int] | None = None) -> torch.Tensor:
    """A uint8 (C, H, W) tensor (C: 3, 1 for grey, 4 for RGBX) resized with upstream's geometry, cropped to 3 x S x S.

    torch's uint8 kernel runs with explicit scale factors, which fix where each output pixel samples the input
    whatever the output size: only the rows and columns up to the crop's corner are computed (about 10% less
    work), and ``full_size``, the (width, height) of a JPEG decoded at a scale M/8, maps the full image's
    geometry exactly onto the reduced pixels (resized "to size", their rounded-up sizes would stretch it).
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
    """The M of a JPEG decoded at scale M/8 (8: full) from the two (width, height) sizes, each side being
    ``ceil(full * M / 8)``; the largest M that fits, ``ValueError`` when none does."""
    for eighths in range(8, 0, -1):
        if all(-(-full * eighths // 8) == decoded for full, decoded in zip(full_size, decoded_size)):
            return eighths
    raise ValueError(
        f"a {decoded_size[0]}x{decoded_size[1]} image is no M/8 scale (M = 1..8) of a {full_size[0]}x{full_size[1]} one"
    )


def jpeg_decoder() -> str:
    """The library and version the fast pipelines decode colour and grey JPEGs with: ``"simplejpeg <version>"``
    where it is installed, else ``"Pillow <version>"``. ``fast``'s pixels are the same whichever it is (one
    libjpeg-turbo decode); ``fast-draft``'s are not (each picks its own DCT scales): its recipe names it."""
    if simplejpeg is not None:
        return f"simplejpeg {simplejpeg.__version__}"
    return f"Pillow {PIL.__version__}"


# A resume or rerun of fast-draft on another decoder is another recipe (the recipe module may not import this one).
run_recipe.PIXELS_FROM_THE_DECODER["fast-draft"] = jpeg_decoder


def make_image_transform(
    pipeline: str, image_size: int, mean: Sequence[float], std: Sequence[float]
) -> Callable[[Any], torch.Tensor]:
    """A pipeline's per-image transform, ``value -> (3, S, S)``: ``upstream`` gives float32 normalised with
    ``mean``/``std``; ``fast`` and ``fast-draft`` give uint8 and ignore them (``normalize_on_device``)."""
    check_pipeline(pipeline)
    if not isinstance(image_size, int) or image_size <= 0:
        raise ValueError(f"image_size must be a positive integer; got {image_size!r}")
    if pipeline == "upstream":
        return UpstreamTransform(image_size, mean, std)
    return FastTransform(image_size, draft=pipeline == "fast-draft")


def normalize_on_device(
    pixel_values_uint8: torch.Tensor, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``(x / 255 - mean) / std`` over dimension -3 on ``x``'s device, on a copy: one multiply and one add in
    float32 (a third of the memory traffic of four operations), cast to ``dtype`` last (bf16 rounded once)."""
    x = pixel_values_uint8
    mean_t = torch.as_tensor(mean, dtype=torch.float64).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float64).view(-1, 1, 1)
    scale = (1.0 / (255.0 * std_t)).to(device=x.device, dtype=torch.float32)
    shift = (-mean_t / std_t).to(device=x.device, dtype=torch.float32)
    return x.to(torch.float32, copy=True).mul_(scale).add_(shift).to(dtype)
