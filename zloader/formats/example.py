"""``parse_example``: a serialized ``tf.train.Example`` to a dict, without TensorFlow.

The protobuf wire format, read by hand. The messages (tensorflow/core/example)::

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }     // entries: {key = 1; value = 2}
    Feature   { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                             Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed]; }    // packed or one fixed32 each
    Int64List { repeated int64 value = 1 [packed]; }    // packed or one varint each

Unknown fields are skipped, as protobuf parsers do; a later entry of the same feature name
replaces an earlier one (map semantics).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zloader.errors import CodecError

__all__ = ["parse_example"]

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5  # wire types: facts of the format


def parse_example(record: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Parse a serialized ``tf.train.Example``.

    Args:
        record: the serialized message (a TFRecord's record).

    Returns:
        ``{name: value}``: a float32 array for a float list, an int64 array for an int64
        list, a list of bytes for a bytes list (an empty float32 array for a feature
        with no list set).

    Raises:
        CodecError: the bytes are not a valid Example.
    """
    data = bytes(record)
    features: dict[str, Any] = {}
    for field, wire, start, end in _fields(data, 0, len(data)):
        if field == 1 and wire == _LENGTH:
            for entry, entry_wire, s, e in _fields(data, start, end):
                if entry == 1 and entry_wire == _LENGTH:
                    name, value = _entry(data, s, e)
                    features[name] = value
    return features


def _entry(data: bytes, start: int, end: int) -> tuple[str, Any]:
    name = ""
    value: Any = np.zeros(0, np.float32)
    for field, wire, s, e in _fields(data, start, end):
        if field == 1 and wire == _LENGTH:
            try:
                name = data[s:e].decode("utf-8")
            except UnicodeDecodeError:
                raise CodecError(f"Example: feature name at byte {s} is not UTF-8") from None
        elif field == 2 and wire == _LENGTH:
            value = _feature(data, s, e)
    return name, value


def _feature(data: bytes, start: int, end: int) -> Any:
    value: Any = np.zeros(0, np.float32)
    for field, wire, s, e in _fields(data, start, end):
        if wire != _LENGTH:
            continue
        if field == 1:
            value = [data[a:b] for f, w, a, b in _fields(data, s, e) if f == 1 and w == _LENGTH]
        elif field == 2:
            value = _floats(data, s, e)
        elif field == 3:
            value = _int64s(data, s, e)
    return value


def _floats(data: bytes, start: int, end: int) -> np.ndarray:
    parts = []
    for field, wire, s, e in _fields(data, start, end):
        if field != 1:
            continue
        if wire == _LENGTH:
            if (e - s) % 4:
                raise CodecError(f"Example: packed floats at byte {s} are not 4-byte words")
            parts.append(np.frombuffer(data, "<f4", (e - s) // 4, s))
        elif wire == _FIXED32:
            parts.append(np.frombuffer(data, "<f4", 1, s))
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def _int64s(data: bytes, start: int, end: int) -> np.ndarray:
    parts = []
    for field, wire, s, e in _fields(data, start, end):
        if field != 1:
            continue
        if wire == _LENGTH:
            parts.append(_packed_varints(data[s:e], s))
        elif wire == _VARINT:
            parts.append(np.array([_varint(data, s)[0]], np.uint64).view(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _packed_varints(buf: bytes, offset: int) -> np.ndarray:
    """Decode packed varints all at once: each ends at a byte below 0x80."""
    raw = np.frombuffer(buf, np.uint8)
    if raw.size == 0:
        return np.zeros(0, np.int64)
    if raw[-1] & 0x80:
        raise CodecError(f"Example: packed int64s at byte {offset} end inside a varint")
    ends = np.flatnonzero(raw < 0x80)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() == 1:
        return raw.astype(np.int64)
    if lengths.max() > 10:
        raise CodecError(f"Example: a varint at byte {offset} is longer than 10 bytes")
    place = np.arange(raw.size) - np.repeat(starts, lengths)
    parts = (raw & 0x7F).astype(np.uint64) << (7 * place).astype(np.uint64)
    return np.add.reduceat(parts, starts).view(np.int64)


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at ``position`` (as an unsigned 64-bit value) and the position after it."""
    result = shift = 0
    while True:
        if position >= len(data):
            raise CodecError(f"Example: truncated varint at byte {position}")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, position
        shift += 7
        if shift >= 70:
            raise CodecError(f"Example: a varint at byte {position} is longer than 10 bytes")


def _fields(data: bytes, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """The fields of the message in ``data[start:end]``: (number, wire type, start, end)
    of each value (a varint's own bytes for wire type 0)."""
    fields = []
    position = start
    while position < end:
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value_start = position
            _, position = _varint(data, position)
        elif wire == _LENGTH:
            size, value_start = _varint(data, position)
            position = value_start + size
        elif wire == _FIXED32:
            value_start, position = position, position + 4
        elif wire == _FIXED64:
            value_start, position = position, position + 8
        else:
            raise CodecError(f"Example: unsupported wire type {wire} at byte {position}")
        if position > end or number == 0:
            raise CodecError(f"Example: field {number} at byte {value_start} overruns its "
                             "message")
        fields.append((number, wire, value_start, position))
    return fields

