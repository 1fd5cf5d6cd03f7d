"""The CPU emulation of the HPU decoder's geometry, and the figure the README's differences table quotes."""

import numpy as np
import pytest
from PIL import Image

import mediapipe_geometry as mg
from helpers import encode


def jpeg(img):
    return {"bytes": encode(img, "JPEG", quality=95), "path": None}


@pytest.mark.parametrize(
    "size, box", [((800, 600), (100, 0, 700, 600)), ((600, 801), (0, 100, 600, 700)), ((5, 5), (0, 0, 5, 5))]
)
def test_decoder_takes_the_centred_square(size, box):
    assert mg.decoder_crop_box(*size) == box


def test_side_margins_are_cut_off_before_the_resize():
    # Red margins left and right of a white square: the decoder's square holds no red at all.
    pixels = np.full((60, 100, 3), 255, dtype=np.uint8)
    pixels[:, :20] = pixels[:, 80:] = (255, 0, 0)
    out = mg.emulate_decoder_geometry(Image.fromarray(pixels), 30)
    assert out.shape == (3, 30, 30)
    assert out.min() > 0.97


def test_square_images_match_upstream_exactly():
    rng = np.random.default_rng(0)
    square = jpeg(Image.fromarray(rng.integers(0, 256, (90, 90, 3), dtype=np.uint8)))
    assert mg.geometry_deviation([square], 32)["max_abs_deviation_per_255"] < 1e-3


def test_fixture_cartoons_deviation_is_measured_and_small(fixtures):
    result = mg.geometry_deviation(mg.fixture_images(8), 294)
    print(f"\nHPU decoder geometry vs upstream on 8 fixture cartoons: {result}")
    assert result["images"] == 8
    # Line art moved by a fraction of a pixel: visible, but far below a one-pixel shift (about 8/255).
    assert 0.3 < result["mean_abs_deviation_per_255"] < 5
