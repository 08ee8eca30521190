"""``decode_image``: encoded image bytes (JPEG, PNG, ...) to an HWC uint8 array.

Uses simplejpeg for JPEG when it is installed (faster), else Pillow
(``pip install 'zloader[formats]'``) for every format Pillow reads.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = ["decode_image"]

_JPEG_MAGIC = b"\xff\xd8\xff"


def decode_image(data: bytes | bytearray | memoryview, mode: str = "RGB") -> np.ndarray:
    """Decode an image.

    Args:
        data: the encoded image.
        mode: ``"RGB"`` (3 channels), ``"L"`` (grey, 1 channel) or ``"RGBA"``.

    Returns:
        An array of shape (height, width, channels), dtype uint8.

    Raises:
        ImportError: Pillow is not installed.
        ValueError: the bytes are not an image Pillow can read.
    """
    raw = bytes(data)
    if raw.startswith(_JPEG_MAGIC) and mode in ("RGB", "L"):
        fast = _simplejpeg()
        if fast is not None:
            array = fast.decode_jpeg(raw, colorspace="GRAY" if mode == "L" else "RGB")
            return np.ascontiguousarray(array).reshape(array.shape[0], array.shape[1], -1)
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("decode_image needs Pillow: pip install 'zloader[formats]'") \
            from None
    try:
        with Image.open(io.BytesIO(raw)) as image:
            array = np.asarray(image.convert(mode))
    except Image.UnidentifiedImageError as exc:
        raise ValueError(f"decode_image: not an image Pillow can read ({exc})") from None
    return array.reshape(array.shape[0], array.shape[1], -1)


def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg
