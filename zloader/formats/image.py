"""``decode_image``: encoded image bytes (JPEG, PNG, ...) to an HWC uint8 array.

Uses simplejpeg for JPEG when it is installed (faster), else Pillow
(``pip install 'zloader[formats]'``) for every format Pillow reads. The image's size is
read from its header first: one of more than ``max_pixels`` pixels (``MAX_IMAGE_PIXELS``
by default) is refused before any pixel is decoded, so a small file that claims a huge
image (a decompression bomb) costs nothing.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from zloader._defaults import MAX_IMAGE_PIXELS

__all__ = ["decode_image"]

_JPEG_MAGIC = b"\xff\xd8\xff"


def decode_image(data: bytes | bytearray | memoryview, mode: str = "RGB",
                 max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Decode an image.

    Args:
        data: the encoded image.
        mode: ``"RGB"`` (3 channels), ``"L"`` (grey, 1 channel) or ``"RGBA"``.
        max_pixels: the most pixels (width x height) decoded; a larger image is refused.

    Returns:
        An array of shape (height, width, channels), dtype uint8.

    Raises:
        ImportError: Pillow is not installed.
        ValueError: the bytes are not an image Pillow can read, the image is truncated or
            corrupt, or it has more than ``max_pixels`` pixels.
    """
    raw = bytes(data)
    if raw.startswith(_JPEG_MAGIC) and mode in ("RGB", "L"):
        fast = _simplejpeg()
        if fast is not None:
            try:
                height, width = fast.decode_jpeg_header(raw)[:2]
                _check_pixels(width, height, max_pixels)
                array = fast.decode_jpeg(raw, colorspace="GRAY" if mode == "L" else "RGB")
            except ValueError as exc:
                raise ValueError(f"decode_image: {exc}") from None
            return np.ascontiguousarray(array).reshape(array.shape[0], array.shape[1], -1)
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("decode_image needs Pillow: pip install 'zloader[formats]'") \
            from None
    try:
        with Image.open(io.BytesIO(raw)) as image:
            width, height = image.size
            _check_pixels(width, height, max_pixels)
            array = np.asarray(image.convert(mode))
    except Image.UnidentifiedImageError as exc:
        raise ValueError(f"decode_image: not an image Pillow can read ({exc})") from None
    except Image.DecompressionBombError as exc:
        raise ValueError(f"decode_image: {exc} (Pillow's own limit, "
                         "PIL.Image.MAX_IMAGE_PIXELS)") from None
    except _TooLarge as exc:
        raise ValueError(f"decode_image: {exc}") from None
    except MemoryError:
        raise
    except Exception as exc:  # a truncated or corrupt image: any of Pillow's decoders
        raise ValueError(f"decode_image: cannot decode the image ({type(exc).__name__}: "
                         f"{exc})") from None
    return array.reshape(array.shape[0], array.shape[1], -1)


class _TooLarge(ValueError):
    """The image has more pixels than allowed."""


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise _TooLarge(f"the image is {width} x {height} = {width * height} pixels, more "
                        f"than max_pixels={max_pixels}: raise max_pixels= (decode_image, "
                        "from_image_folder) if images this large are meant")


def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg
