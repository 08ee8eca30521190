"""CRC-32C (Castagnoli), as TFRecord files checksum their lengths and records.

Uses the ``crc32c`` or ``google-crc32c`` package when one is installed (the ``formats``
extra installs ``crc32c``), else a table-driven pure-Python version: correct, but slow
(some MB/s), so large files then read faster with ``verify=False``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["crc32c", "masked_crc32c"]

_POLYNOMIAL = 0x82F63B78  # reflected Castagnoli polynomial: a fact of the format


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLYNOMIAL if crc & 1 else crc >> 1
        table.append(crc)
    return table


def _pure(data: bytes) -> int:
    table = _TABLE
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _pick() -> Callable[[bytes], int]:
    try:
        import crc32c as fast

        return fast.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        return google_crc32c.value  # type: ignore[no-any-return,unused-ignore]
    except ImportError:
        return _pure


_TABLE = _table()
crc32c: Callable[[bytes], int] = _pick()


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C of ``data`` that TFRecord stores (rotated right by 15 bits, plus a
    constant), so that a CRC of data holding CRCs is not trivially related."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
