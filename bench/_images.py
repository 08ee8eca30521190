"""The synthetic JPEG files and the image augmentation the benchmarks share (no torch)."""

from __future__ import annotations

import math
import pathlib
import random

import numpy as np
from PIL import Image

JPEG_FILES = 256
JPEG_WIDTH, JPEG_HEIGHT = 500, 375
CROP = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


def synthetic_photo(rng: np.random.Generator) -> np.ndarray:
    """A 375x500 RGB uint8 image: per channel a linear gradient and a slow wave in a random
    direction (smooth content), plus Gaussian noise (texture that JPEG cannot drop)."""
    y = np.linspace(0.0, 1.0, JPEG_HEIGHT, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, JPEG_WIDTH, dtype=np.float32)[None, :]
    channels = []
    for _ in range(3):
        gx, gy, wx, wy = rng.uniform(-1.0, 1.0, 4)
        frequency, phase = rng.uniform(1.0, 8.0), rng.uniform(0.0, 2 * math.pi)
        channels.append(128 + 60 * (gx * x + gy * y)
                        + 45 * np.sin(frequency * math.pi * (wx * x + wy * y) + phase))
    image = np.stack(channels, axis=-1) + rng.normal(0.0, 12.0, (JPEG_HEIGHT, JPEG_WIDTH, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def write_jpegs(directory: pathlib.Path, count: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        path = directory / f"{index:05d}.jpg"
        Image.fromarray(synthetic_photo(rng)).save(path, "JPEG", quality=90)
        paths.append(str(path))
    return paths


def random_resized_crop_box(width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, crop width, crop height) as torchvision's ``RandomResizedCrop`` draws
    them: ten tries at a random area and aspect ratio, then a central crop."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target_area = area * random.uniform(*SCALE)
        aspect = math.exp(random.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return random.randint(0, width - w), random.randint(0, height - h), w, h
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif in_ratio > RATIO[1]:
        w, h = round(height * RATIO[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h



def decode_augment(path: str, size: int = CROP) -> np.ndarray:
    """JPEG decode, random resized crop to ``size`` (bilinear), random horizontal flip: a
    fresh writable HWC uint8 array."""
    with Image.open(path) as opened:
        image = opened.convert("RGB")
    left, top, w, h = random_resized_crop_box(*image.size)
    image = image.resize((size, size), Image.Resampling.BILINEAR,
                         box=(left, top, left + w, top + h))
    if random.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.array(image, dtype=np.uint8)
