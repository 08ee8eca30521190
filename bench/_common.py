"""Helpers shared by the benchmarks."""

from __future__ import annotations

import importlib.metadata


def version(distribution: str) -> str:
    """An installed distribution's version, or "not installed"."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
