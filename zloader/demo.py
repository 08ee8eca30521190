"""The demo job: a synthetic image pipeline shaped like ImageNet preprocessing.

Each source item is a zlib-compressed image (standing in for a JPEG file); the pipeline
decodes it, takes a random crop, flips it at random, normalizes it to float32 and batches.
Randomness is seeded per image, so every run yields the same batches.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from zloader._defaults import DEMO_BATCH_SIZE, DEMO_PIPELINE_IMAGES, DEMO_SIZE
from zloader._defaults import DEMO_DISTINCT as _DISTINCT
from zloader.pipeline import Pipeline

__all__ = ["demo_pipeline"]

_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255


def _encoded_images(size: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    images = []
    for _ in range(_DISTINCT):
        base = ramp[:, None, None] * rng.random(3, dtype=np.float32) + ramp[None, :, None] / 2
        noisy = base + rng.normal(0, 8, (size, size, 3)).astype(np.float32)
        images.append(zlib.compress(np.clip(noisy, 0, 255).astype(np.uint8).tobytes(), 1))
    return images


def demo_pipeline(images: int = DEMO_PIPELINE_IMAGES, batch_size: int = DEMO_BATCH_SIZE,
                  size: int = DEMO_SIZE) -> Pipeline:
    """The demo pipeline over ``images`` (default 4096) synthetic images of ``size`` x ``size``
    pixels (default 64), in batches of ``batch_size`` (default 64)."""
    encoded = _encoded_images(size)
    crop = size * 7 // 8

    def decode(index: int) -> dict[str, Any]:
        raw = zlib.decompress(encoded[index % _DISTINCT])
        return {"image": np.frombuffer(raw, np.uint8).reshape(size, size, 3), "label": index}

    def augment(sample: dict[str, Any]) -> dict[str, Any]:
        rng = np.random.default_rng(sample["label"])
        top, left = rng.integers(0, size - crop + 1, 2)
        image = sample["image"][top:top + crop, left:left + crop]
        if rng.random() < 0.5:
            image = image[:, ::-1]
        return {"image": (image.astype(np.float32) - _MEAN) / _STD, "label": sample["label"]}

    return (Pipeline.range(images, name="images")
            .map(decode, name="decode")
            .map(augment, name="augment")
            .batch(batch_size))
