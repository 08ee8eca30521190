"""SHA-256, with ``hashlib`` imported at its first use: importing hashlib loads OpenSSL
(15-25 ms), which ``import zloader`` need not pay before a Loader hashes anything."""

from __future__ import annotations

from typing import Any

__all__ = ["sha256"]


def sha256(data: bytes | memoryview = b"") -> Any:
    """``hashlib.sha256(data)``."""
    import hashlib

    return hashlib.sha256(data)
