"""Readers of the file formats users keep their data in, and their sources (see
docs/sources.md): TFRecord (:mod:`~zloader.formats.tfrecord`), WebDataset shards
(:mod:`~zloader.formats.webdataset`), Parquet (:mod:`~zloader.formats.parquet`), JSON
lines (:mod:`~zloader.formats.jsonl`) and image folders
(:mod:`~zloader.formats.image_folder`), built by ``Pipeline.from_tfrecord`` and friends.

Two helpers for the elements they yield: :func:`parse_example` (a ``tf.train.Example``,
without TensorFlow) and :func:`decode_image`. Importing this package imports neither
pyarrow, Pillow nor fsspec: each is imported when first needed.
"""

from zloader.formats.example import parse_example
from zloader.formats.image import decode_image

__all__ = ["decode_image", "parse_example"]
