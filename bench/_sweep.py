"""The hyper-parameter sweep of bench.sharing: trainers that share a decode and part after
it, on one host ([3/6] item 3).

Four trainers read the same JPEG files, decoded and resized once (the shared prefix), each
with its own suffix: an augmentation of one of two strengths and a batch size of 32, 64,
128 or 256. Side by side in one run:

- zloader prefix-shared: a broker and one ``zloader-worker --processes W``; every trainer a
  ``Loader(share=True)`` (the decode runs once for all, each suffix for its trainer);
- zloader unshared: every trainer an embedded ``Loader`` with W workers of its own;
- torch: every trainer a ``torch.utils.data.DataLoader`` with W workers;
- and the one-trainer reference: the prefix-shared system with the first trainer alone.

Each trainer checks that it got every image once (the index of every row). The photographs
are real: matplotlib's ``grace_hopper.jpg`` (an installed package's sample data), re-encoded
as JPEG files of its crops and flips, each file another view of the photo.
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import Any

import numpy as np

SUFFIXES = ((32, 0.1), (64, 0.4), (128, 0.1), (256, 0.4))
"""Each trainer's (batch size, augmentation strength)."""

SIDE = 160  # the decoded images' side (pixels)


def photo_files(directory: pathlib.Path, count: int) -> list[str]:
    """``count`` JPEG files cut from matplotlib's sample photograph (crops of 400x300 at
    other places, every other one flipped), quality 90."""
    import matplotlib.cbook
    from PIL import Image

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as handle:
        photo = Image.open(handle).convert("RGB")
        photo.load()
    width, height = photo.size
    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        left = int(rng.integers(0, width - 400 + 1))
        top = int(rng.integers(0, height - 300 + 1))
        crop = photo.crop((left, top, left + 400, top + 300))
        if index % 2:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        path = directory / f"photo-{index:05d}.jpg"
        crop.save(path, "JPEG", quality=90)
        paths.append(str(path))
    return paths


def decode(index: int, paths: tuple[str, ...], log: str) -> tuple[np.ndarray, int]:
    """JPEG decode and resize to SIDE x SIDE (the expensive part every trainer shares):
    the pixels (HWC uint8) and the image's index. Each call appends a byte to ``log``."""
    from PIL import Image

    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, b".")
    os.close(fd)
    with Image.open(paths[index % len(paths)]) as opened:
        image = opened.convert("RGB").resize((SIDE, SIDE), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8), index


def augment(sample: tuple[np.ndarray, int], strength: float) -> tuple[np.ndarray, int]:
    """A trainer's own augmentation, seeded by the image's index (so a worker that makes
    it again makes the same): a flip and a brightness change of up to ``strength``."""
    pixels, index = sample
    rng = np.random.default_rng(index)
    if rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    gain = np.float32(1.0 + strength * (2.0 * rng.random() - 1.0))
    out = np.multiply(pixels, gain, dtype=np.float32)
    np.clip(out, 0.0, 255.0, out=out)
    return out.astype(np.uint8), index


def pipeline(paths: list[str], images: int, log: str, which: int) -> Any:
    """Trainer ``which``'s pipeline: the shared decode, then its own suffix."""
    from zloader import Pipeline

    size, strength = SUFFIXES[which]
    shared = Pipeline.range(images, split_size=16).map(
        functools.partial(decode, paths=tuple(paths), log=log), name="decode")
    return shared.map(functools.partial(augment, strength=strength),
                      name=f"augment({strength})").batch(size)


class TorchSweep:
    """The same sample for a torch DataLoader (its own decode in each trainer's workers):
    a map-style dataset over the image indices, batched by the DataLoader."""

    def __init__(self, paths: list[str], images: int, log: str, strength: float) -> None:
        self.paths, self.images, self.log, self.strength = tuple(paths), images, log, strength

    def __len__(self) -> int:
        return self.images

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return augment(decode(index, self.paths, self.log), self.strength)
