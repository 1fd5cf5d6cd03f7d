"""Synthetic line-art cartoons and the captions that say what they show.

A scene is a setting (room, street, beach, park), a region and up to four kinds of objects; `draw_cartoon`
samples one, draws it with a pen that wobbles like a hand-drawn stroke on tinted paper, and returns the
image with its caption. The New Yorker-shaped fixture data set (`fixtures.py`) and the image
micro-benchmarks use these pictures: their sizes and line art load a JPEG decoder as the real cartoons do.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFilter


IMAGE_SIDE_RANGE = (500, 1100)  # pixels, each side of a synthetic cartoon
MIN_IMAGE_SIDE = 64  # the smallest canvas render_scene draws on
JPEG_QUALITY = 90

# ---------------------------------------------------------------------------------------------
# Cartoon contents and their descriptions
# ---------------------------------------------------------------------------------------------

# kind -> (singular, plural, Wikipedia entity)
THINGS = {
    "person": ("person", "people", "Person"),
    "house": ("house", "houses", "House"),
    "tree": ("tree", "trees", "Tree"),
    "car": ("car", "cars", "Car"),
    "table": ("table", "tables", "Table_(furniture)"),
    "lamp": ("lamp", "lamps", "Lamp"),
    "boat": ("boat", "boats", "Boat"),
    "fish": ("fish", "fish", "Fish"),
}
SETTINGS = {
    "room": "a living room",
    "street": "a city street",
    "beach": "a beach",
    "park": "a park",
}
SETTING_PREPOSITIONS = {"room": "in", "street": "on", "beach": "on", "park": "in"}
REGIONS = {
    "left": "on the left side of",
    "middle": "in the middle of",
    "right": "on the right side of",
}
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
MAX_OBJECTS = 4


@dataclass(frozen=True)
class Scene:
    """What a cartoon shows: a setting, where the objects stand, and which objects (kind, count)."""

    setting: str
    region: str
    things: tuple[tuple[str, int], ...]


def sample_scene(rng: np.random.Generator) -> Scene:
    """Draw random cartoon contents: one or two kinds of object, 1-3 of each, at most four in all."""
    setting = str(rng.choice(list(SETTINGS)))
    region = str(rng.choice(list(REGIONS)))
    n_kinds = 1 if rng.random() < 0.5 else 2
    kinds = [str(k) for k in rng.choice(list(THINGS), size=n_kinds, replace=False)]
    while True:
        counts = [int(c) for c in rng.integers(1, 4, size=n_kinds)]
        if sum(counts) <= MAX_OBJECTS:
            break
    return Scene(setting, region, tuple(zip(kinds, counts)))


def _count_phrase(kind: str, count: int) -> str:
    singular, plural, _ = THINGS[kind]
    return f"{COUNT_WORDS[count]} {singular if count == 1 else plural}"


def describe(scene: Scene) -> str:
    """The caption of a scene, e.g. "Two houses and a tree on the left side of a city street."."""
    subject = " and ".join(_count_phrase(kind, count) for kind, count in scene.things)
    return f"{subject[0].upper()}{subject[1:]} {REGIONS[scene.region]} {SETTINGS[scene.setting]}."


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------

PAPER_RGB = np.array([247.0, 244.0, 236.0])
INK_RGB = np.array([24.0, 23.0, 28.0])


class _Pen:
    """Draws black strokes with a slight hand-drawn wobble, and hatching, on a grayscale canvas."""

    def __init__(self, canvas: Image.Image, rng: np.random.Generator, width: int):
        self.canvas = canvas
        self.draw = ImageDraw.Draw(canvas)
        self.rng = rng
        self.width = width

    def line(self, *points, width: int | None = None, closed: bool = False) -> None:
        """A polyline through `points`; long segments are split and jittered a little."""
        width = width or self.width
        corners = [(float(x), float(y)) for x, y in points]
        if closed:
            corners.append(corners[0])
        path = []
        for (x0, y0), (x1, y1) in zip(corners, corners[1:]):
            steps = max(1, int(math.hypot(x1 - x0, y1 - y0) / (10 * width)))
            for i in range(steps):
                t = i / steps
                jx, jy = self.rng.normal(0.0, 0.25 * width, size=2) if i else (0.0, 0.0)
                path.append((x0 + (x1 - x0) * t + jx, y0 + (y1 - y0) * t + jy))
        path.append(corners[-1])
        self.draw.line(path, fill=0, width=width, joint="curve")

    def ellipse(self, cx: float, cy: float, rx: float, ry: float, width: int | None = None) -> None:
        self.draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), outline=0, width=width or self.width)

    def dot(self, x: float, y: float, r: float) -> None:
        self.draw.ellipse((x - r, y - r, x + r, y + r), fill=0)

    def hatch(
        self, box, *, polygon=None, ellipse: bool = False, spacing: float = 8.0, angle: float = 45.0, shade: int = 70
    ) -> None:
        """Parallel strokes at `angle` degrees, clipped to a rectangle, ellipse or polygon in `box`."""
        x0, y0 = max(0, int(box[0])), max(0, int(box[1]))
        x1, y1 = min(self.canvas.width, int(box[2]) + 1), min(self.canvas.height, int(box[3]) + 1)
        w, h = x1 - x0, y1 - y0
        if w < 2 or h < 2:
            return
        shape = Image.new("L", (w, h), 0 if (polygon or ellipse) else 255)
        shape_draw = ImageDraw.Draw(shape)
        if polygon:
            shape_draw.polygon([(x - x0, y - y0) for x, y in polygon], fill=255)
        elif ellipse:
            shape_draw.ellipse((int(box[0]) - x0, int(box[1]) - y0, int(box[2]) - x0, int(box[3]) - y0), fill=255)
        strokes = Image.new("L", (w, h), 0)
        strokes_draw = ImageDraw.Draw(strokes)
        dx, dy = math.cos(math.radians(angle)), math.sin(math.radians(angle))
        half_diagonal = math.hypot(w, h) / 2
        spacing = max(3.0, spacing)
        stroke_width = max(1, self.width // 2)
        for offset in np.arange(-half_diagonal, half_diagonal + spacing, spacing):
            offset += self.rng.normal(0.0, spacing * 0.08)
            px, py = w / 2 - dy * offset, h / 2 + dx * offset  # a point on this stroke
            strokes_draw.line(
                (px - dx * half_diagonal, py - dy * half_diagonal, px + dx * half_diagonal, py + dy * half_diagonal),
                fill=255,
                width=stroke_width,
            )
        self.canvas.paste(shade, (x0, y0, x1, y1), ImageChops.multiply(shape, strokes))


# Each object drawer gets the pen, the horizontal centre, the ground line and a size (its
# overall height for upright things, its width for wide ones).


def _draw_person(pen: _Pen, cx: float, gy: float, s: float) -> None:
    head_r = 0.09 * s
    head_y = gy - s + head_r
    neck_y = head_y + head_r
    hip_y = gy - 0.42 * s
    pen.ellipse(cx, head_y, head_r, head_r)
    pen.dot(cx - 0.35 * head_r, head_y - 0.1 * head_r, 0.12 * head_r)
    pen.dot(cx + 0.35 * head_r, head_y - 0.1 * head_r, 0.12 * head_r)
    pen.line((cx - 0.4 * head_r, head_y + 0.45 * head_r), (cx + 0.4 * head_r, head_y + 0.45 * head_r))
    coat = [
        (cx - 0.1 * s, neck_y + 0.02 * s),
        (cx + 0.1 * s, neck_y + 0.02 * s),
        (cx + 0.15 * s, hip_y + 0.08 * s),
        (cx - 0.15 * s, hip_y + 0.08 * s),
    ]
    pen.hatch((cx - 0.15 * s, neck_y, cx + 0.15 * s, hip_y + 0.08 * s), polygon=coat, spacing=0.035 * s, angle=60)
    pen.line(*coat, closed=True)
    for side in (-1, 1):
        pen.line((cx + side * 0.1 * s, neck_y + 0.04 * s), (cx + side * 0.21 * s, gy - 0.55 * s))
        pen.line((cx + side * 0.06 * s, hip_y + 0.08 * s), (cx + side * 0.1 * s, gy))
        pen.line((cx + side * 0.1 * s, gy), (cx + side * 0.16 * s, gy))


def _draw_house(pen: _Pen, cx: float, gy: float, s: float) -> None:
    half = 0.42 * s
    eaves_y = gy - 0.55 * s
    apex_y = gy - 0.95 * s
    pen.line((cx - half, gy), (cx - half, eaves_y), (cx + half, eaves_y), (cx + half, gy))
    roof = [(cx - half - 0.06 * s, eaves_y), (cx, apex_y), (cx + half + 0.06 * s, eaves_y)]
    pen.hatch((cx - half - 0.06 * s, apex_y, cx + half + 0.06 * s, eaves_y), polygon=roof, spacing=0.03 * s, angle=-30)
    pen.line(*roof, closed=True)
    chimney_x = cx + 0.2 * s
    pen.line(
        (chimney_x, gy - 0.75 * s),
        (chimney_x, gy - 0.92 * s),
        (chimney_x + 0.08 * s, gy - 0.92 * s),
        (chimney_x + 0.08 * s, gy - 0.68 * s),
    )
    pen.line((cx - 0.08 * s, gy), (cx - 0.08 * s, gy - 0.3 * s), (cx + 0.08 * s, gy - 0.3 * s), (cx + 0.08 * s, gy))
    for wx in (cx - 0.28 * s, cx + 0.2 * s):
        box = (wx, gy - 0.45 * s, wx + 0.12 * s, gy - 0.33 * s)
        pen.hatch(box, spacing=0.02 * s, angle=80, shade=120)
        pen.line((box[0], box[1]), (box[2], box[1]), (box[2], box[3]), (box[0], box[3]), closed=True)


def _draw_tree(pen: _Pen, cx: float, gy: float, s: float) -> None:
    crown_y, crown_r = gy - 0.68 * s, 0.3 * s
    pen.line((cx - 0.05 * s, gy), (cx - 0.04 * s, crown_y + 0.2 * s))
    pen.line((cx + 0.05 * s, gy), (cx + 0.04 * s, crown_y + 0.2 * s))
    pen.hatch((cx - 0.05 * s, crown_y + 0.2 * s, cx + 0.05 * s, gy), spacing=0.025 * s, angle=5, shade=90)
    box = (cx - crown_r, crown_y - crown_r, cx + crown_r, crown_y + crown_r)
    pen.hatch(box, ellipse=True, spacing=0.04 * s, angle=40)
    pen.hatch(box, ellipse=True, spacing=0.06 * s, angle=-50, shade=110)
    pen.ellipse(cx, crown_y, crown_r, crown_r)


def _draw_car(pen: _Pen, cx: float, gy: float, s: float) -> None:
    wheel_r = 0.11 * s
    axle_y = gy - wheel_r
    body = [
        (cx - 0.5 * s, axle_y),
        (cx - 0.5 * s, gy - 0.34 * s),
        (cx - 0.28 * s, gy - 0.36 * s),
        (cx - 0.18 * s, gy - 0.55 * s),
        (cx + 0.2 * s, gy - 0.55 * s),
        (cx + 0.3 * s, gy - 0.36 * s),
        (cx + 0.5 * s, gy - 0.32 * s),
        (cx + 0.5 * s, axle_y),
    ]
    pen.line(*body, closed=True)
    pen.line(
        (cx - 0.14 * s, gy - 0.37 * s),
        (cx - 0.1 * s, gy - 0.5 * s),
        (cx + 0.17 * s, gy - 0.5 * s),
        (cx + 0.23 * s, gy - 0.37 * s),
        closed=True,
    )
    for wx in (cx - 0.3 * s, cx + 0.3 * s):
        box = (wx - wheel_r, axle_y - wheel_r, wx + wheel_r, axle_y + wheel_r)
        pen.hatch(box, ellipse=True, spacing=0.02 * s, angle=30, shade=40)
        pen.ellipse(wx, axle_y, wheel_r, wheel_r)


def _draw_table(pen: _Pen, cx: float, gy: float, s: float) -> None:
    top = (cx - 0.45 * s, gy - 0.48 * s, cx + 0.45 * s, gy - 0.42 * s)
    pen.hatch(top, spacing=0.02 * s, angle=70)
    pen.line((top[0], top[1]), (top[2], top[1]), (top[2], top[3]), (top[0], top[3]), closed=True)
    for lx in (cx - 0.38 * s, cx + 0.38 * s):
        pen.line((lx, top[3]), (lx, gy))
    pen.line(
        (cx + 0.1 * s, top[1]),
        (cx + 0.12 * s, top[1] - 0.12 * s),
        (cx + 0.2 * s, top[1] - 0.12 * s),
        (cx + 0.22 * s, top[1]),
    )


def _draw_lamp(pen: _Pen, cx: float, gy: float, s: float) -> None:
    pen.ellipse(cx, gy - 0.02 * s, 0.14 * s, 0.03 * s)
    pen.line((cx, gy - 0.04 * s), (cx, gy - 0.7 * s))
    shade = [
        (cx - 0.12 * s, gy - 0.95 * s),
        (cx + 0.12 * s, gy - 0.95 * s),
        (cx + 0.24 * s, gy - 0.7 * s),
        (cx - 0.24 * s, gy - 0.7 * s),
    ]
    pen.hatch(
        (cx - 0.24 * s, gy - 0.95 * s, cx + 0.24 * s, gy - 0.7 * s),
        polygon=shade,
        spacing=0.025 * s,
        angle=90,
        shade=100,
    )
    pen.line(*shade, closed=True)


def _draw_boat(pen: _Pen, cx: float, gy: float, s: float) -> None:
    hull = [(cx - 0.5 * s, gy - 0.22 * s), (cx + 0.5 * s, gy - 0.22 * s), (cx + 0.35 * s, gy), (cx - 0.35 * s, gy)]
    pen.hatch((cx - 0.5 * s, gy - 0.22 * s, cx + 0.5 * s, gy), polygon=hull, spacing=0.03 * s, angle=-45)
    pen.line(*hull, closed=True)
    pen.line((cx, gy - 0.22 * s), (cx, gy - s))
    pen.line((cx, gy - 0.95 * s), (cx + 0.42 * s, gy - 0.3 * s), (cx, gy - 0.3 * s))
    pen.line((cx - 0.03 * s, gy - 0.85 * s), (cx - 0.3 * s, gy - 0.3 * s), (cx - 0.03 * s, gy - 0.3 * s))


def _draw_fish(pen: _Pen, cx: float, gy: float, s: float) -> None:
    cy = gy - 0.45 * s
    box = (cx - 0.32 * s, cy - 0.16 * s, cx + 0.32 * s, cy + 0.16 * s)
    pen.hatch(box, ellipse=True, spacing=0.035 * s, angle=-60, shade=110)
    pen.ellipse(cx, cy, 0.32 * s, 0.16 * s)
    pen.line((cx + 0.3 * s, cy), (cx + 0.48 * s, cy - 0.13 * s), (cx + 0.48 * s, cy + 0.13 * s), closed=True)
    pen.dot(cx - 0.2 * s, cy - 0.04 * s, 0.02 * s)
    for i, r in enumerate((0.03, 0.045, 0.06)):
        pen.ellipse(
            cx - 0.3 * s - 0.05 * s * i, cy - 0.3 * s - 0.15 * s * i, r * s, r * s, width=max(1, pen.width // 2)
        )


DRAWERS: dict[str, Callable[[_Pen, float, float, float], None]] = {
    "person": _draw_person,
    "house": _draw_house,
    "tree": _draw_tree,
    "car": _draw_car,
    "table": _draw_table,
    "lamp": _draw_lamp,
    "boat": _draw_boat,
    "fish": _draw_fish,
}


def _draw_room(pen: _Pen, w: int, h: int, gy: float) -> None:
    left, right = 0.07 * w, 0.93 * w
    pen.line((left, 0), (left, gy), (right, gy), (right, 0))
    pen.line((left, gy), (0, 0.97 * h))
    pen.line((right, gy), (w, 0.97 * h))
    for i in range(1, 4):
        y = gy + (h - gy) * (i / 4) ** 1.3
        pen.line((0.2 * w * (1 - i / 4), y), (w - 0.2 * w * (1 - i / 4), y), width=max(1, pen.width // 2))
    fx = pen.rng.uniform(0.2, 0.6) * w
    frame = (fx, 0.12 * h, fx + 0.2 * w, 0.12 * h + 0.14 * w)
    pen.hatch(frame, spacing=0.012 * w, angle=20, shade=150)
    pen.line((frame[0], frame[1]), (frame[2], frame[1]), (frame[2], frame[3]), (frame[0], frame[3]), closed=True)


def _draw_street(pen: _Pen, w: int, h: int, gy: float) -> None:
    x = 0.0
    while x < w:
        bw = pen.rng.uniform(0.08, 0.16) * w
        top = pen.rng.uniform(0.12, 0.35) * h
        box = (x, top, min(w - 1, x + bw), gy)
        pen.hatch(box, spacing=0.03 * w, angle=0.0, shade=170)
        pen.line((box[0], gy), (box[0], top), (box[2], top), (box[2], gy), width=max(1, pen.width // 2))
        x += bw + pen.rng.uniform(0.0, 0.03) * w
    pen.line((0, gy), (w, gy))
    pen.line((0, gy + 0.07 * h), (w, gy + 0.07 * h))
    for x in np.arange(0.02 * w, w, 0.12 * w):
        pen.line((x, gy + 0.17 * h), (x + 0.06 * w, gy + 0.17 * h))


def _draw_beach(pen: _Pen, w: int, h: int, gy: float) -> None:
    horizon = 0.42 * h
    pen.line((0, horizon), (w, horizon))
    for row in range(4):
        y = horizon + (gy - horizon) * (row + 0.6) / 4.5
        wave = [(x, y + 0.01 * h * math.sin(x / (0.03 * w) + row)) for x in np.linspace(0, w, 40)]
        pen.line(*wave, width=max(1, pen.width // 2))
    pen.line(*[(x, gy + 0.012 * h * math.sin(x / (0.05 * w))) for x in np.linspace(0, w, 30)])
    for _ in range(int(w * h / 2500)):
        pen.dot(pen.rng.uniform(0, w), pen.rng.uniform(gy + 0.02 * h, h), 0.6 * pen.width)
    for _ in range(3):
        bx, by = pen.rng.uniform(0.1, 0.9) * w, pen.rng.uniform(0.08, 0.3) * h
        pen.line((bx - 0.02 * w, by - 0.01 * w), (bx, by), (bx + 0.02 * w, by - 0.01 * w))


def _draw_park(pen: _Pen, w: int, h: int, gy: float) -> None:
    pen.line(*[(x, gy - 0.03 * h * math.sin(math.pi * x / w)) for x in np.linspace(0, w, 30)])
    for _ in range(4):
        bx, by = pen.rng.uniform(0.05, 0.95) * w, gy - 0.04 * h
        r = pen.rng.uniform(0.04, 0.07) * w
        box = (bx - r, by - r, bx + r, by + r)
        pen.hatch(box, ellipse=True, spacing=0.01 * w, angle=60, shade=160)
    for _ in range(int(w * h / 9000)):
        x, y = pen.rng.uniform(0, w), pen.rng.uniform(gy + 0.02 * h, h)
        t = 0.012 * h
        pen.line((x - t * 0.6, y - t), (x, y), (x + t * 0.6, y - t), width=max(1, pen.width // 2))


BACKGROUNDS = {"room": _draw_room, "street": _draw_street, "beach": _draw_beach, "park": _draw_park}
REGION_SPANS = {"left": (0.02, 0.6), "middle": (0.2, 0.8), "right": (0.4, 0.98)}


def render_scene(
    scene: Scene, rng: np.random.Generator, width: int, height: int, stroke_scale: float = 1.0
) -> Image.Image:
    """Draw `scene` as black line art on off-white paper: background, then the objects in their region.

    Strokes are about 1/220 of the shorter side wide (at least 2 px), times `stroke_scale`.
    """
    if width < MIN_IMAGE_SIDE or height < MIN_IMAGE_SIDE:
        raise ValueError(f"cartoon width and height must be at least {MIN_IMAGE_SIDE} pixels, got {width}x{height}")
    canvas = Image.new("L", (width, height), 255)
    pen = _Pen(canvas, rng, width=max(1, round(stroke_scale * max(2, round(min(width, height) / 220)))))
    ground_y = rng.uniform(0.72, 0.8) * height
    BACKGROUNDS[scene.setting](pen, width, height, ground_y)

    kinds = [kind for kind, count in scene.things for _ in range(count)]
    kinds = [kinds[i] for i in rng.permutation(len(kinds))]
    lo, hi = REGION_SPANS[scene.region]
    slot = (hi - lo) * width / len(kinds)
    size = min(0.95 * slot, 0.5 * height)
    for i, kind in enumerate(kinds):
        cx = lo * width + slot * (i + 0.5) + rng.uniform(-0.04, 0.04) * slot
        DRAWERS[kind](pen, cx, ground_y + rng.uniform(0.0, 0.03) * height, size * rng.uniform(0.85, 1.0))
    return _ink_on_paper(canvas, rng)


def _ink_on_paper(canvas: Image.Image, rng: np.random.Generator) -> Image.Image:
    """Soften the strokes a little, add paper grain and tint ink and paper: a scanned-drawing look."""
    softened = canvas.filter(ImageFilter.GaussianBlur(0.7))
    coverage = np.asarray(softened, dtype=np.float32) / 255.0
    coverage += rng.normal(0.0, 0.018, size=coverage.shape).astype(np.float32)
    np.clip(coverage, 0.0, 1.0, out=coverage)
    rgb = INK_RGB + coverage[..., None] * (PAPER_RGB - INK_RGB)
    return Image.fromarray(rgb.round().astype(np.uint8), "RGB")


def draw_cartoon(rng: np.random.Generator, width: int, height: int) -> tuple[Image.Image, str]:
    """A random line-art cartoon of `width` x `height` pixels and the caption that says what it shows.

    `rng` is a ``numpy.random.Generator``; the same generator state gives the same cartoon.
    """
    scene = sample_scene(rng)
    return render_scene(scene, rng, width, height), describe(scene)


def jpeg_bytes(img: Image.Image, quality: int = JPEG_QUALITY) -> bytes:
    """Encode `img` as a baseline JPEG (4:2:0 chroma), as photographs and scans usually are."""
    buffer = io.BytesIO()
    img.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


# The EXIF orientation tag (2..8) -> the transposition that stores an upright picture so that the tag turns
# it upright again (the inverse of what PIL.ImageOps.exif_transpose applies for that tag).
_STORED_SIDEWAYS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


def exif_oriented_jpeg_bytes(img: Image.Image, orientation: int, quality: int = JPEG_QUALITY) -> bytes:
    """`img` stored as a camera would store it: transposed, with the EXIF orientation tag that undoes that."""
    exif = Image.Exif()
    exif[0x0112] = orientation  # ExifTags.Base.Orientation
    buffer = io.BytesIO()
    img.transpose(_STORED_SIDEWAYS[orientation]).save(buffer, format="JPEG", quality=quality, exif=exif)
    return buffer.getvalue()


def sample_image_size(rng: np.random.Generator, side_range: tuple[int, int] = IMAGE_SIDE_RANGE) -> tuple[int, int]:
    """Width and height within `side_range`: mostly landscape, aspect ratio up to about 1.6.

    The long side is drawn from the upper three quarters of the range (650-1100 px by default).
    """
    low, high = side_range
    long_side = int(rng.integers(low + (high - low) // 4, high + 1))
    short_side = int(max(low, round(long_side / rng.uniform(1.05, 1.6))))
    return (long_side, short_side) if rng.random() < 0.7 else (short_side, long_side)
