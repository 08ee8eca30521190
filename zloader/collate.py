"""Batching and unbatching of nested elements (the rules behind ``batch`` and ``unbatch``).

``stack(elements)`` follows tf.data's ``batch`` and torch's ``default_collate``:

===========================================  ============================================
leaves at one position in every element      batched leaf
===========================================  ============================================
numpy arrays (or array-likes: ``__array__``)  ``np.stack`` along a new axis 0; shapes must
                                              match
torch tensors                                 ``torch.stack`` (a tensor, any dtype torch
                                              has, ``bfloat16`` included); shapes must match
numbers (Python or numpy scalars, bools)      1-d array (Python ``int`` -> int64,
                                              ``float`` -> float64, ``bool`` -> bool)
``str``, ``bytes``, ``None``                  a ``list`` of them
dicts / tuples / lists / named tuples         the same container of batched children (dict
                                              keys and sequence lengths must match)
===========================================  ============================================

``stack(elements, pad_value=v)`` (used by ``bucket_by_length``) also batches arrays whose lengths
along axis 0 differ: each is padded with ``v`` at the end of axis 0 to the longest one (the other
dimensions must match).

``split(batch)`` is its inverse: arrays are sliced along axis 0 (views, no copy), lists of
scalars (``str``/``bytes``/``None``/numbers, as ``stack`` makes them) are taken item by item,
and dicts, tuples and other lists are structure. Every leaf must have the same length. A
list is its rows itself, taken item by item too, where it cannot be structure ``stack``
made (:func:`_is_rows`): a list of lists of numbers (``stack`` makes arrays of numbers: a
tokenizer's or packer's rows), or of arrays and lists of scalars of different lengths.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from zloader import codec
from zloader._defaults import STACK_LATER_BYTES
from zloader.codec_torch import is_tensor

__all__ = ["split", "stack"]

_NUMBER_TYPES = (bool, int, float, complex, np.number, np.bool_)
_TEXT_TYPES = (str, bytes, type(None))


def stack(elements: Sequence[Any], pad_value: Any = None, later: bool = False) -> Any:
    """Combine equal-structured elements into one batch (see the module docstring); with
    ``pad_value``, arrays of different lengths along axis 0 are padded to the longest.
    ``later``: the batch goes straight into a record, so a large leaf of equal arrays
    (STACK_LATER_BYTES in all) is left as a :class:`~zloader.codec.Stacked` of them, which
    the record's copy stacks (one copy instead of two; the arrays must not change until
    the record is sent, which for such a record is at once).

    Raises:
        ValueError: the elements differ in structure, keys, lengths or array shapes.
        TypeError: a leaf has a type that cannot be batched.
    """
    if not elements:
        raise ValueError("cannot batch zero elements")
    return _stack(elements, "element", pad_value, later)


def _stack(values: Sequence[Any], path: str, pad: Any = None, later: bool = False) -> Any:
    first = values[0]
    if not isinstance(first, np.ndarray) and is_tensor(first):  # (has __array__ too)
        return _stack_tensors(values, path, pad)
    if isinstance(first, np.ndarray) or (hasattr(first, "__array__")
                                         and not isinstance(first, _NUMBER_TYPES)):
        arrays = [np.asarray(v) if not isinstance(v, np.ndarray) else v for v in values]
        shape = arrays[0].shape
        if pad is not None and arrays[0].ndim >= 1:
            return _padded(arrays, path, pad)
        for arr in arrays:
            if arr.shape != shape:
                raise ValueError(
                    f"cannot batch {path}: arrays have different shapes {shape} and "
                    f"{arr.shape}; pad them to one shape in a map stage (or use "
                    "bucket_by_length)")
        if later and _stacks_later(arrays):
            return codec.Stacked(arrays)
        return np.stack(arrays)
    if isinstance(first, _NUMBER_TYPES):
        try:  # (numbers all: numpy finds a number dtype; checked one by one otherwise)
            batched = np.array(values)
        except (TypeError, ValueError):
            pass
        else:
            if batched.ndim == 1 and batched.dtype.kind in "biufc":
                return batched
        for value in values:
            if not isinstance(value, _NUMBER_TYPES):
                raise TypeError(f"cannot batch {path}: mixes a number with "
                                f"{type(value).__name__}")
        batched = np.array(values)
        if batched.dtype == object:
            raise TypeError(f"cannot batch {path}: ints do not fit in int64")
        return batched
    if isinstance(first, _TEXT_TYPES):
        for value in values:
            if not isinstance(value, _TEXT_TYPES):
                raise TypeError(f"cannot batch {path}: mixes {type(first).__name__} with "
                                f"{type(value).__name__}")
        return list(values)
    if isinstance(first, dict):
        keys = list(first)
        for value in values:
            if not isinstance(value, dict) or value.keys() != first.keys():
                got = sorted(map(repr, value)) if isinstance(value, dict) else type(value)
                raise ValueError(f"cannot batch {path}: elements have different keys "
                                 f"({sorted(map(repr, keys))} and {got})")
        return {key: _stack([v[key] for v in values], f"{path}[{key!r}]", pad, later)
                for key in keys}
    if isinstance(first, (tuple, list)):
        size = len(first)
        for value in values:
            if not isinstance(value, (tuple, list)):
                raise ValueError(f"cannot batch {path}: a {type(first).__name__} and a "
                                 f"{type(value).__name__}")
            if len(value) != size:
                raise ValueError(
                    f"cannot batch {path}: sequences of {size} and {len(value)} items (a "
                    "list or tuple is batched item by item, as torch's default_collate "
                    "does). Rows of different lengths (token lists) batch as arrays with "
                    "bucket_by_length(pad_value=...), or go in the map of the batch that "
                    "makes them: batch(k).map(lambda b: pack(tokenize(b))).unbatch()")
        columns = [_stack([v[i] for v in values], f"{path}[{i}]", pad, later)
                   for i in range(size)]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*columns)
        return tuple(columns) if isinstance(first, tuple) else columns
    raise TypeError(f"cannot batch {path}: values of type {type(first).__qualname__} can't be "
                    "stacked; map them to numpy arrays first")


def _stacks_later(arrays: list[np.ndarray]) -> bool:
    """Whether equal-shaped ``arrays`` can be left to the record's copy: large in all, of
    one plain dtype, each C-contiguous."""
    first = arrays[0]
    return (first.nbytes * len(arrays) >= STACK_LATER_BYTES and first.dtype.kind in "biufc"
            and all(a.dtype == first.dtype and a.flags.c_contiguous for a in arrays))


def _stack_tensors(values: Sequence[Any], path: str, pad: Any) -> Any:
    """Stack torch tensors into one tensor (padded along axis 0 with ``pad``); torch is
    imported already (the tensors came from it), and is not imported here."""
    torch = sys.modules["torch"]

    for value in values:
        if not is_tensor(value):
            raise TypeError(f"cannot batch {path}: mixes a tensor with "
                            f"{type(value).__name__}")
    shape = values[0].shape
    if pad is not None and len(shape) >= 1:
        rest = shape[1:]
        if any(len(v.shape) == 0 or v.shape[1:] != rest for v in values):
            raise ValueError(f"cannot pad {path}: tensors differ beyond axis 0; only axis 0 "
                             "is padded")
        out = values[0].new_full((len(values), max(v.shape[0] for v in values), *rest), pad)
        for row, value in zip(out, values, strict=True):
            row[:value.shape[0]] = value
        return out
    for value in values:
        if value.shape != shape:
            raise ValueError(f"cannot batch {path}: tensors have different shapes "
                             f"{tuple(shape)} and {tuple(value.shape)}; pad them to one shape "
                             "in a map stage (or use bucket_by_length)")
    return torch.stack(list(values))


def _padded(arrays: list[np.ndarray], path: str, pad: Any) -> np.ndarray:
    """Stack arrays padded with ``pad`` along axis 0 to the longest of them."""
    rest = arrays[0].shape[1:]
    for arr in arrays:
        if arr.ndim == 0 or arr.shape[1:] != rest:
            raise ValueError(
                f"cannot pad {path}: arrays differ beyond axis 0 ({arrays[0].shape} and "
                f"{arr.shape}); only axis 0 is padded")
    longest = max(arr.shape[0] for arr in arrays)
    dtype = np.result_type(*arrays)
    try:
        out = np.full((len(arrays), longest, *rest), pad, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"cannot pad {path}: pad_value {pad!r} does not fit dtype "
                         f"{dtype}: {exc}") from None
    for row, arr in zip(out, arrays, strict=True):
        row[:arr.shape[0]] = arr
    return out


def split(batch: Any) -> Iterator[Any]:
    """Yield the rows of a batch, the inverse of :func:`stack` (see the module docstring).

    Raises:
        ValueError: leaves have different lengths, or a leaf is a scalar.
    """
    batch = _marked(batch)
    size = _length(batch, "element")
    if size is None:
        raise ValueError("cannot unbatch element: it holds no arrays or lists")
    for row in range(size):
        yield _row(batch, row)


class _Rows(list):
    """A list that is its rows itself (:func:`_is_rows`), marked once per batch."""


def _is_rows(value: Any) -> bool:
    """Whether ``value`` is a list of rows rather than structure: lists of numbers (never
    one of ``stack``'s, which makes arrays of them), or arrays and lists of scalars whose
    lengths differ (structure's leaves have one length)."""
    if type(value) is not list or not value:
        return False
    lengths, numbers = set(), True
    for item in value:
        if isinstance(item, np.ndarray) or is_tensor(item):
            if item.ndim == 0:
                return False
            lengths.add(int(item.shape[0]))
            numbers = False
        elif type(item) is list:
            for v in item:  # (one pass: scalars all, and numbers so far)
                if not isinstance(v, _NUMBER_TYPES):
                    if not isinstance(v, _TEXT_TYPES):
                        return False
                    numbers = False
            lengths.add(len(item))
        else:
            return False
    return numbers or len(lengths) > 1


def _marked(value: Any) -> Any:
    """``value`` with each list of rows in it (:func:`_is_rows`) a :class:`_Rows`."""
    if _is_rows(value):
        return _Rows(value)
    if isinstance(value, dict):
        return {k: _marked(v) for k, v in value.items()}
    if type(value) is list and not _is_scalar_list(value):
        return [_marked(v) for v in value]
    if isinstance(value, tuple):
        items = [_marked(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _is_scalar_list(value: Any) -> bool:
    return type(value) is list and all(isinstance(v, _TEXT_TYPES + _NUMBER_TYPES) for v in value)


def _length(value: Any, path: str) -> int | None:
    if isinstance(value, np.ndarray) or is_tensor(value):
        if len(value.shape) == 0:
            raise ValueError(f"cannot unbatch {path}: it is a 0-d "
                             f"{'array' if isinstance(value, np.ndarray) else 'tensor'}")
        return int(value.shape[0])
    if _is_scalar_list(value) or type(value) is _Rows:
        return len(value)
    if isinstance(value, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (tuple, list)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        raise ValueError(f"cannot unbatch {path}: a {type(value).__name__} has no rows")
    found: int | None = None
    for child_path, child in children:
        size = _length(child, child_path)
        if size is not None and found is not None and size != found:
            raise ValueError(f"cannot unbatch {path}: {child_path} has {size} rows, "
                             f"others have {found}")
        found = size if size is not None else found
    return found


def _row(value: Any, row: int) -> Any:
    if isinstance(value, np.ndarray) or _is_scalar_list(value) or is_tensor(value):
        return value[row]
    if type(value) is _Rows:
        return list.__getitem__(value, row)
    if isinstance(value, dict):
        return {k: _row(v, row) for k, v in value.items()}
    rows = [_row(v, row) for v in value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*rows)
    return tuple(rows) if isinstance(value, tuple) else rows
