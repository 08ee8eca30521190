"""How a Loader's pipeline leaves this process for its workers: inherited by forked
workers (nothing to pickle), pickled into REGISTER when small, or served from the Loader
(zloader/shipping.py, :class:`Served`) when large; a large in-memory source is taken out
and served the same way."""

from __future__ import annotations

import dataclasses
import sys
import threading
import types
from typing import Any

import cloudpickle

from zloader import _check, codec
from zloader._defaults import INLINE_PIPELINE_BYTES, INLINE_SOURCE_BYTES
from zloader._host import loopback
from zloader._pickling import dumps_pipeline
from zloader.client.peers import local_address
from zloader.fingerprint import is_installed, library_version
from zloader.pipeline import Pipeline
from zloader.shipping import Served
from zloader.sources import ArraysSource, ItemsSource
from zloader.transport.keys import Keys

__all__ = ["INLINE_PIPELINE_BYTES", "INLINE_SOURCE_BYTES", "check_exposure", "dumps", "pack",
           "strip_source"]


def pack(pipeline: Pipeline, inherited: bool, local: bool = False) -> tuple[bytes, Served]:
    """The pipeline for REGISTER (empty when ``inherited``: every worker was forked from
    this process; or when it is served) and what this Loader serves its workers.
    ``local``: every worker is this Loader's own, started on this host with its
    ``sys.path``, so the user's modules travel by reference, as torch's spawned workers
    get them: imported afresh (see :func:`dumps`).

    Raises:
        SerializationError: the pipeline cannot be pickled.
    """
    if inherited:
        return b"", Served()
    stripped, source_data = strip_source(pipeline)
    blob = dumps(stripped, by_value=not local)
    served = Served(blob if len(blob) > INLINE_PIPELINE_BYTES else None, source_data)
    if served.pipeline is not None:
        blob = b""  # REGISTER carries only where to fetch it
    return blob, served


def check_exposure(served: Served, broker: str | None, keys: Keys | None,
                   insecure: Any) -> None:
    """Refuse to serve a pipeline or source on an address other hosts can reach without
    keys, unless ``insecure``.

    Raises:
        ValueError: naming keys= and insecure=.
    """
    if (served and broker is not None and keys is None
            and not loopback(f"tcp://{local_address(broker)}:0")
            and not _check.boolean("insecure", insecure)):
        what = ("in-memory source" if served.source is not None
                else f"code ({len(served.pipeline or b'') / 2**20:.1f} MiB pickled)")
        raise ValueError(
            f"this pipeline's {what} is served to the broker's workers from this "
            "process, on an address other hosts can reach, and without keys anyone "
            "could read it: pass keys= (the broker's, see `zloader keygen`), or "
            "insecure=True on a trusted network")


def strip_source(pipeline: Pipeline) -> tuple[Pipeline, tuple[str, list[Any]] | None]:
    """Take a large ``from_arrays``/``from_items`` source's data out of the pipeline (the
    source itself, or the one a cache reads).

    Returns the pipeline to send through the broker and ``(kind, frames)`` for the Loader
    to serve to workers: arrays as codec frames (no pickle), items as one cloudpickle frame.
    """
    outer = pipeline.source
    source = outer.innermost()  # (under a cache, say)
    if isinstance(source, ArraysSource):
        frames = codec.encode(source.structure)
        if sum(memoryview(f).nbytes for f in frames) > INLINE_SOURCE_BYTES:
            stripped = outer.with_innermost(dataclasses.replace(source, structure=None))
            return Pipeline(stripped, pipeline.stages), ("arrays", frames)
    elif isinstance(source, ItemsSource):
        data = cloudpickle.dumps(source.items)
        if len(data) > INLINE_SOURCE_BYTES:
            stripped = outer.with_innermost(dataclasses.replace(source, items=()))
            return Pipeline(stripped, pipeline.stages), ("items", [data])
    return pipeline, None


_BY_VALUE = threading.Lock()
"""Held while the user's modules are registered with cloudpickle to go by value."""


def dumps(pipeline: Pipeline, by_value: bool = True) -> bytes:
    """cloudpickle the pipeline, shipping the user's own modules by value.

    Functions and classes from ``__main__`` and from modules that are not installed (not
    in the standard library or site-packages) travel with the pipeline, so remote workers
    need not have the user's source tree; installed packages travel by reference and must
    be installed on the workers. Without ``by_value`` the user's modules travel by
    reference too (the worker imports them: it must find them on its ``sys.path``, and
    sees their globals as a fresh import makes them, not as they are here); ``__main__``
    always travels by value.
    """
    modules = [module for name, module in list(sys.modules.items())
               if by_value and isinstance(module, types.ModuleType)
               and _is_user_module(name, module)]
    # cloudpickle's registry is the process's: Loaders made on two threads at once would
    # unregister each other's modules (ValueError) or pickle by reference what the other
    # had registered.
    with _BY_VALUE:
        for module in modules:
            cloudpickle.register_pickle_by_value(module)
        try:
            return dumps_pipeline(pipeline)
        finally:
            for module in modules:
                cloudpickle.unregister_pickle_by_value(module)



def _is_user_module(name: str, module: types.ModuleType) -> bool:
    if name == "__main__" or name.partition(".")[0] == "zloader":
        return False
    path = str(getattr(module, "__file__", None) or "")
    return path.endswith(".py") and not is_installed(path) and library_version(name) is None
