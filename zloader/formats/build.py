"""Build the format sources from the arguments of ``Pipeline.from_tfrecord`` and friends:
check them, list and stat the files (or URLs) now, so that the fingerprint covers them."""

from __future__ import annotations

import os
from typing import Any

from zloader import _check
from zloader._defaults import (
    MAX_IMAGE_PIXELS,
    MAX_LINE_BYTES,
    MAX_MEMBER_BYTES,
    MAX_RECORD_BYTES,
)
from zloader.formats.base import FormatSource
from zloader.formats.image_folder import ImageFolderSource, find_images
from zloader.formats.jsonl import JsonlSource
from zloader.formats.parquet import ParquetSource, count_row_groups
from zloader.formats.tfrecord import COMPRESSIONS, TFRecordSource
from zloader.formats.webdataset import WebDatasetSource
from zloader.sources import default_split_size
from zloader.storage import list_files

__all__ = ["image_folder", "jsonl", "parquet", "tfrecord", "webdataset"]


def _common(what: str, storage_options: Any, parallel_reads: Any, deterministic: Any,
            options: dict[str, Any]) -> dict[str, Any]:
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"{what}: storage_options must be a dict (fsspec's options for the "
                        f"URLs' filesystem), got {type(storage_options).__name__}")
    return {"storage_options": storage_options,
            "parallel_reads": _check.integer("parallel_reads", parallel_reads, 1),
            "deterministic": _check.boolean("deterministic", deterministic), **options}


def _limit(name: str, value: Any, default: int) -> int:
    """A per-element limit: ``default`` when None, else an int >= 1."""
    return default if value is None else _check.integer(name, value, 1)


def tfrecord(paths: Any, compression: Any, verify: Any, storage_options: Any,
             parallel_reads: Any, deterministic: Any, options: dict[str, Any],
             max_record_bytes: Any = None) -> FormatSource:
    if compression not in COMPRESSIONS:
        raise ValueError(f"from_tfrecord: compression must be one of {COMPRESSIONS}, got "
                         f"{compression!r}")
    common = _common("from_tfrecord", storage_options, parallel_reads, deterministic, options)
    return TFRecordSource(files=list_files(paths, storage_options, "from_tfrecord"),
                          compression=compression, verify=_check.boolean("verify", verify),
                          max_record_bytes=_limit("max_record_bytes", max_record_bytes,
                                                  MAX_RECORD_BYTES),
                          **common)


def webdataset(urls: Any, storage_options: Any, parallel_reads: Any, deterministic: Any,
               options: dict[str, Any], max_member_bytes: Any = None) -> FormatSource:
    common = _common("from_webdataset", storage_options, parallel_reads, deterministic,
                     options)
    return WebDatasetSource(files=list_files(urls, storage_options, "from_webdataset"),
                            max_member_bytes=_limit("max_member_bytes", max_member_bytes,
                                                    MAX_MEMBER_BYTES),
                            **common)


def parquet(paths: Any, columns: Any, batch_rows: Any, storage_options: Any,
            parallel_reads: Any, deterministic: Any, options: dict[str, Any]) -> FormatSource:
    if columns is not None:
        if isinstance(columns, (str, bytes)) or not all(isinstance(c, str) for c in columns):
            raise TypeError("from_parquet: columns must be a list of column names")
        columns = tuple(columns)
    common = _common("from_parquet", storage_options, parallel_reads, deterministic, options)
    files = list_files(paths, storage_options, "from_parquet")
    return ParquetSource(files=files,
                         row_groups=count_row_groups(files, storage_options, columns),
                         columns=columns,
                         batch_rows=_check.optional_integer("batch_rows", batch_rows, 1),
                         **common)


def jsonl(paths: Any, storage_options: Any, parallel_reads: Any, deterministic: Any,
          options: dict[str, Any], max_line_bytes: Any = None) -> FormatSource:
    common = _common("from_jsonl", storage_options, parallel_reads, deterministic, options)
    return JsonlSource(files=list_files(paths, storage_options, "from_jsonl"),
                       max_line_bytes=_limit("max_line_bytes", max_line_bytes,
                                             MAX_LINE_BYTES), **common)


def image_folder(root: Any, split_size: Any, decode: Any, storage_options: Any,
                 parallel_reads: Any, deterministic: Any,
                 options: dict[str, Any], max_pixels: Any = None) -> FormatSource:
    root = os.fspath(root)
    common = _common("from_image_folder", storage_options, parallel_reads, deterministic,
                     options)
    classes, files, labels = find_images(root, storage_options)
    size = (default_split_size(len(files)) if split_size is None
            else _check.integer("split_size", split_size, 1))
    return ImageFolderSource(root=root, classes=classes, files=files, labels=labels,
                             split_size=size, decode=_check.boolean("decode", decode),
                             max_pixels=_limit("max_pixels", max_pixels, MAX_IMAGE_PIXELS),
                             **common)
