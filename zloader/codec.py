"""The element codec: nested structures of arrays as a small header plus raw buffers.

An *element* is a nested ``dict``/``tuple``/``list`` whose leaves are numpy arrays of a
numeric or bool dtype (any shape, including 0-d and empty), torch tensors (any dtype but the
quantized ones, nested tensors included: zloader/codec_torch.py), numpy scalars, Python
``bool``/``int``/``float``/``complex``, ``str``, ``bytes`` and ``None``.

``encode(element)`` returns ``[header, buffer, ...]``: the header describes the structure
and each array's dtype and shape; every array's memory travels as its own buffer, without
a copy when the array is C-contiguous (others are made contiguous once). ``decode`` turns
the buffers back into the element; decoded arrays are views over the given memory, so no
byte is copied (they are read-only when the memory is). ``str`` and ``bytes`` leaves are
immutable Python objects and are copied on decode. A :class:`Stacked` leaf (an array given as
its rows) encodes as the stacked array; its buffer is a :class:`Gather` of the rows.

A tensor travels as the array it is (its dtype named as torch names it) and is decoded as a
tensor over the given memory, copied only when that memory is read-only (a tensor has no
read-only form). Encoding never imports torch (a tensor exists only where torch is
imported); decoding imports it when a header holds a tensor.

There is no pickle on this path by default: a header can describe only the types above, so
bytes from a peer cannot make this process run code. The one exception (docs/torch.md,
design.md's invariant 1) is opt-in at both ends: ``encode(element, objects=True)`` pickles a
leaf of any other type (and a named tuple whole, keeping its type) into a ``b"o"`` node, and
only ``decode(buffers, objects=True)`` unpickles one; the Loader passes True only for
records from its own local workers. Without it a ``b"o"`` node is refused like any unknown
tag. Every field is checked before use; malformed input raises
:class:`~zloader.errors.CodecError` saying what is wrong, and decoding never allocates more
than the input's size (arrays are views; counts are checked
against the bytes that remain).

Header format (version 1, little-endian)::

    header  = b"ZLC" version:u8 node
    node    = b"N" | b"T" | b"F"                          None, True, False
            | b"i" int64 | b"I" len:u32 two's-complement  int (the long form past 64 bits)
            | b"f" float64 | b"c" float64 float64          float, complex
            | b"s" len:u32 utf8 | b"S"                      str inline | str in the next buffer
            | b"b" len:u32 bytes | b"B"                     bytes inline | in the next buffer
            | b"a" dtype ndim:u8 dim:u64*ndim              array, memory in the next buffer
            | b"t" name ndim:u8 dim:u64*ndim               torch tensor, memory in the next
                                                           buffer (C order)
            | b"j" name name count:u32 node*count          nested tensor: layout, dtype and
                                                           its components (b"t" nodes)
            | b"n" dtype raw                               numpy scalar (itemsize bytes)
            | b"L" count:u32 node*count                    list
            | b"U" count:u32 node*count                    tuple
            | b"W" count:u32 (b"s" | b"S")                 list of str: one str node of the
                                                           count strs joined by NUL (none
                                                           holds a NUL; count >= 2)
            | b"w" count:u32 (b"s" | b"S")                 tuple of str, the same way
            | b"D" count:u32 (key:node value:node)*count   dict
            | b"o"                                          pickled object, in the next
                                                           buffer (objects=True only)
    dtype   = len:u8 ascii                                 numpy dtype string, e.g. "<f4"
    name    = len:u8 ascii                                 torch's name: "bfloat16", "jagged"

Buffers are used in the order their nodes appear, each exactly once. Subclasses of the
supported containers and scalars (``OrderedDict``, named tuples, ``IntEnum``) arrive as
their plain base type.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from zloader import codec_torch
from zloader._defaults import CODEC_INLINE_MAX as INLINE_MAX
from zloader._defaults import CODEC_MAX_BIGINT_BYTES as MAX_BIGINT_BYTES
from zloader._defaults import CODEC_MAX_DEPTH as MAX_DEPTH
from zloader._defaults import CODEC_MAX_NDIM as MAX_NDIM
from zloader.errors import CodecError

__all__ = ["MAX_DEPTH", "Gather", "Stacked", "decode", "encode", "joined", "nbytes"]

VERSION = 1
MAGIC = b"ZLC" + bytes([VERSION])

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1

_KINDS = ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")
_DTYPES: dict[str, np.dtype[Any]] = {}
for _kind in _KINDS:
    for _order in ("|", "<", ">"):
        _dt = np.dtype(_order + _kind) if _order != "|" else np.dtype(_kind)
        _DTYPES[_dt.str] = _dt
_DTYPE_BYTES = {name: _U8.pack(len(name)) + name.encode("ascii") for name in _DTYPES}
_NDIM = [_U8.pack(n) for n in range(MAX_NDIM + 1)]
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]


class Stacked:
    """An array given as its rows: it encodes exactly as ``np.stack(rows)`` would, but its
    buffer is a :class:`Gather` of the rows, so the rows are copied once, straight into the
    record's memory (a shared-memory ring slot), instead of into a stacked array first.

    Args:
        rows: C-contiguous numpy arrays of one supported dtype and one shape (at least one).
            They are referenced, not copied: keep them unchanged until the record is sent.

    Raises:
        ValueError: no rows, or rows that differ in dtype or shape or are not contiguous.
    """

    __slots__ = ("dtype", "nbytes", "rows", "shape")

    def __init__(self, rows: Sequence[np.ndarray]) -> None:
        if not rows:
            raise ValueError("Stacked needs at least one row")
        first = rows[0]
        for row in rows:
            if (not isinstance(row, np.ndarray) or row.dtype != first.dtype
                    or row.shape != first.shape or not row.flags.c_contiguous):
                raise ValueError("Stacked rows must be C-contiguous numpy arrays of one dtype "
                                 "and shape")
        self.rows = list(rows)
        self.dtype = first.dtype
        self.shape = (len(self.rows), *first.shape)
        self.nbytes = first.nbytes * len(self.rows)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        stacked = np.stack(self.rows)
        return stacked if dtype is None else stacked.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"Stacked(shape={self.shape}, dtype={self.dtype})"


class Gather(tuple[memoryview, ...]):
    """One buffer of :func:`encode`'s output given as consecutive parts (``memoryview``
    objects); :func:`nbytes` and :func:`joined` deal with both kinds of buffer."""

    __slots__ = ()


def nbytes(buffer: Any) -> int:
    """The size of one buffer of :func:`encode`'s output (a :class:`Gather` included)."""
    if isinstance(buffer, Gather):
        return sum(part.nbytes for part in buffer)
    return memoryview(buffer).nbytes


def joined(buffers: Sequence[Any]) -> list[Any]:
    """``buffers`` with every :class:`Gather` joined into one ``bytes`` (a copy), for
    transports that need each buffer in one piece."""
    return [b"".join(b) if isinstance(b, Gather) else b for b in buffers]


class _EncodeError(Exception):
    """Internal: carries the path to the offending value up to :func:`encode`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []


def encode(element: Any, objects: bool = False) -> list[Any]:
    """Encode an element into ``[header, buffer, ...]``.

    Args:
        element: a nested dict/tuple/list of numpy arrays, scalars, str, bytes and None.
        objects: pickle a leaf of any other type instead of refusing it (for a Loader's
            own forked local workers only: the reader must pass ``objects=True`` too).

    Returns:
        A list whose first item is the header (``bytes``) and whose other items are
        buffer-protocol objects (``memoryview``), one per array or long str/bytes leaf.
        Contiguous arrays are referenced, not copied: keep them unchanged until the
        buffers have been sent. A :class:`Stacked` leaf's buffer is a :class:`Gather`.

    Raises:
        CodecError: a leaf of an unsupported type or dtype, or nesting deeper than
            ``MAX_DEPTH``; the message names the path to the offending value.
    """
    out = bytearray(MAGIC)
    buffers: list[Any] = [b""]
    try:
        _encode_node(element, out, buffers, 0, objects)
    except _EncodeError as exc:
        path = "element" + "".join(reversed(exc.path))
        raise CodecError(f"cannot encode {path}: {exc.message}") from None
    buffers[0] = bytes(out)
    return buffers


def _encode_node(value: Any, out: bytearray, buffers: list[Any], depth: int,
                 objects: bool) -> None:
    kind = type(value)
    # Exact types first, most frequent first: this runs once per node of every element.
    if kind is np.ndarray:
        if objects and value.dtype.str not in _DTYPE_BYTES:  # (str, object, datetime64...)
            _encode_object(value, out, buffers)
        else:
            _encode_array(value, out, buffers)
    elif kind is int:
        if _I64_MIN <= value <= _I64_MAX:
            out += b"i" + _I64.pack(value)
        else:
            _encode_bigint(value, out)
    elif kind is float:
        out += b"f" + _F64.pack(value)
    elif kind is str:
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _EncodeError(f"str is not valid unicode ({exc.reason})") from None
        _encode_blob(b"s", b"S", data, out, buffers)
    elif value is None:
        out += b"N"
    elif kind is bool:
        out += b"T" if value else b"F"
    elif isinstance(value, dict):
        _check_depth(depth)
        out += b"D" + _U32.pack(len(value))
        for key, item in value.items():
            try:
                if isinstance(key, (dict, list, np.ndarray)):
                    raise _EncodeError(f"dict key of type {type(key).__name__} is not allowed")
                _encode_node(key, out, buffers, depth + 1, objects)
                _encode_node(item, out, buffers, depth + 1, objects)
            except _EncodeError as exc:
                exc.path.append(f"[{key!r}]")
                raise
    elif isinstance(value, (list, tuple)) and objects and kind is not list \
            and kind is not tuple:  # a named tuple keeps its type when it may be pickled
        _encode_object(value, out, buffers)
    elif isinstance(value, (list, tuple)):
        _check_depth(depth)
        if (kind is list or kind is tuple) and len(value) > 1 and type(value[0]) is str \
                and _encode_words(value, out, buffers):
            return
        out += (b"U" if isinstance(value, tuple) else b"L") + _U32.pack(len(value))
        for index, item in enumerate(value):
            try:
                _encode_node(item, out, buffers, depth + 1, objects)
            except _EncodeError as exc:
                exc.path.append(f"[{index}]")
                raise
    elif kind is Stacked:
        _encode_stacked(value, out, buffers)
    elif isinstance(value, np.generic) and not isinstance(value, (str, bytes)):
        name = value.dtype.str
        if name not in _DTYPE_BYTES and objects:
            _encode_object(value, out, buffers)
            return
        if name not in _DTYPE_BYTES:
            raise _EncodeError(f"numpy scalar of dtype {value.dtype} is not supported; "
                               f"supported dtypes are bool and numeric ({', '.join(_KINDS)})")
        out += b"n" + _DTYPE_BYTES[name] + value.tobytes()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _encode_blob(b"b", b"B", value, out, buffers)
    elif isinstance(value, np.ndarray):  # (a subclass: pickled whole where it may be)
        if objects:
            _encode_object(value, out, buffers)
        elif isinstance(value, np.ma.MaskedArray):
            raise _EncodeError("a numpy MaskedArray is not supported (its mask would be "
                               "lost); send its data and mask as two arrays")
        else:
            _encode_array(value, out, buffers)
    elif isinstance(value, int):  # bool subclasses were handled above; IntEnum and the like
        _encode_node(int(value), out, buffers, depth, objects)
    elif isinstance(value, float):
        out += b"f" + _F64.pack(value)
    elif isinstance(value, complex):
        out += b"c" + _C128.pack(value.real, value.imag)
    elif isinstance(value, str):
        _encode_node(str(value), out, buffers, depth, objects)
    elif codec_torch.is_tensor(value):
        _encode_tensor(value, out, buffers, depth, objects)
    elif objects:
        _encode_object(value, out, buffers)
    else:
        raise _EncodeError(
            f"type {kind.__module__}.{kind.__qualname__} is not supported; elements hold "
            "dicts, tuples, lists, numpy arrays, torch tensors, numbers, str, bytes and "
            "None (convert the value in a map stage: a datetime to a number or str, a "
            "Decimal to a float; or pass Loader(objects=True) to pickle such values, "
            "embedded only)")


def _encode_tensor(value: Any, out: bytearray, buffers: list[Any], depth: int,
                   objects: bool) -> None:
    """A torch tensor: dense (b"t"), or nested (b"j", its components dense). One the codec
    does not carry (sparse, quantized) is pickled when ``objects`` allows it."""
    mark = len(buffers)
    try:
        if codec_torch.is_nested(value):
            _check_depth(depth)
            layout, dtype, components = codec_torch.nested_parts(value)
            head = bytearray(b"j" + _name(layout) + _name(dtype)
                             + _U32.pack(len(components)))
            for component in components:
                _encode_dense(component, head, buffers)
            out += head
        else:
            _encode_dense(value, out, buffers)
    except TypeError as exc:
        if not objects:
            raise _EncodeError(str(exc)) from None
        del buffers[mark:]  # a nested tensor's components encoded before the failure
        _encode_object(value, out, buffers)


def _encode_dense(value: Any, out: bytearray, buffers: list[Any]) -> None:
    name, shape, data = codec_torch.dense_parts(value)
    if len(shape) > MAX_NDIM:
        raise _EncodeError(f"tensor has {len(shape)} dimensions, more than {MAX_NDIM}")
    out += b"t" + _name(name) + _NDIM[len(shape)] + _SHAPES[len(shape)].pack(*shape)
    buffers.append(data)


def _name(text: str) -> bytes:
    data = text.encode("ascii")
    return _U8.pack(len(data)) + data


def _encode_object(value: Any, out: bytearray, buffers: list[Any]) -> None:
    kind = type(value)
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise _EncodeError(f"{kind.__module__}.{kind.__qualname__} cannot be pickled: "
                           f"{exc}") from None
    out += b"o"
    buffers.append(memoryview(data))


def _check_depth(depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise _EncodeError(f"nested deeper than {MAX_DEPTH} levels (is there a cycle?)")


def _encode_bigint(value: int, out: bytearray) -> None:
    size = (value.bit_length() + 8) // 8
    if size > MAX_BIGINT_BYTES:
        raise _EncodeError(f"int of {size} bytes exceeds {MAX_BIGINT_BYTES}")
    out += b"I" + _U32.pack(size) + value.to_bytes(size, "little", signed=True)


def _encode_words(value: Sequence[Any], out: bytearray, buffers: list[Any]) -> bool:
    """A list (or tuple) of plain ``str`` (a batch's paths or captions, as torch's
    collate gives them) as one ``b"W"`` (``b"w"``) node: its strs joined by NUL in one str
    node, made and split back at C speed instead of a node each (about 1.5 us a str each
    way). False, having written nothing, when it is not one or one of its strs holds a NUL
    or cannot be encoded (each is then encoded on its own, and a bad one named)."""
    if set(map(type, value)) != _JUST_STR:
        return False
    joined = "\x00".join(value)
    if joined.count("\x00") != len(value) - 1:
        return False
    try:
        data = joined.encode("utf-8")
    except UnicodeEncodeError:
        return False
    out += (b"W" if type(value) is list else b"w") + _U32.pack(len(value))
    _encode_blob(b"s", b"S", data, out, buffers)
    return True


_JUST_STR = {str}


def _encode_blob(inline: bytes, buffered: bytes, data: Any, out: bytearray,
                 buffers: list[Any]) -> None:
    try:
        view = memoryview(data).cast("B")
    except (TypeError, BufferError, ValueError):
        raise _EncodeError("bytes-like value is not contiguous memory") from None
    if view.nbytes <= INLINE_MAX:
        out += inline + _U32.pack(view.nbytes)
        out += view
    else:
        out += buffered
        buffers.append(view)


def _encode_array(arr: np.ndarray, out: bytearray, buffers: list[Any]) -> None:
    name = arr.dtype.str
    if name not in _DTYPE_BYTES:
        raise _EncodeError(f"array dtype {arr.dtype} is not supported; supported dtypes are "
                           f"bool and numeric ({', '.join(_KINDS)})")
    if arr.ndim > MAX_NDIM:
        raise _EncodeError(f"array has {arr.ndim} dimensions, more than {MAX_NDIM}")
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    out += b"a" + _DTYPE_BYTES[name] + _NDIM[arr.ndim]
    out += _SHAPES[arr.ndim].pack(*arr.shape)
    try:
        buffers.append(arr.data.cast("B"))
    except (TypeError, ValueError):  # formats memoryview cannot cast (float16, big-endian, 0-d)
        buffers.append(arr.reshape(-1).view(np.uint8).data)


def _encode_stacked(value: Stacked, out: bytearray, buffers: list[Any]) -> None:
    name = value.dtype.str
    if name not in _DTYPE_BYTES or len(value.shape) > MAX_NDIM:
        _encode_array(np.asarray(value), out, buffers)  # raises the array's error
        return
    out += b"a" + _DTYPE_BYTES[name] + _NDIM[len(value.shape)]
    out += _SHAPES[len(value.shape)].pack(*value.shape)
    buffers.append(Gather(row.reshape(-1).view(np.uint8).data for row in value.rows))


def decode(buffers: Sequence[Any], objects: bool = False) -> Any:
    """Decode ``[header, buffer, ...]`` produced by :func:`encode`.

    Args:
        buffers: the header followed by the data buffers; any buffer-protocol objects
            (``bytes``, ``memoryview``, ``zmq.Frame``, shared-memory views).
        objects: unpickle ``b"o"`` nodes (``encode(..., objects=True)``). Only for memory
            written by a process this one trusts as itself: its own forked workers.

    Returns:
        The element. Arrays are views over ``buffers`` (writable only if that memory is);
        keep the memory alive and unchanged while the arrays are in use.

    Raises:
        CodecError: the input is not a valid element; the message says what is wrong.
    """
    if not isinstance(buffers, (list, tuple)) or not buffers:
        raise CodecError(f"expected a non-empty list of buffers, got {type(buffers).__name__}")
    views = [_as_bytes_view(b, i) for i, b in enumerate(buffers)]
    reader = _Reader(bytes(views[0]), views, objects)
    magic = reader.header[:4]
    if len(magic) < 4:
        raise CodecError(f"header truncated: {len(magic)} bytes, a header has at least 5")
    if magic[:3] != MAGIC[:3]:
        raise CodecError(f"header does not start with {MAGIC[:3]!r}: not a zloader element")
    if magic[3] != VERSION:
        raise CodecError(f"codec version {magic[3]} is not supported (this side speaks {VERSION})")
    reader.pos = 4
    element = reader.node(0)
    if reader.pos != reader.end:
        raise CodecError(f"{reader.end - reader.pos} unexpected bytes after the element")
    if reader.next_buffer != len(views):
        raise CodecError(f"header uses {reader.next_buffer - 1} buffers but "
                         f"{len(views) - 1} were given")
    return element


def _as_bytes_view(buf: Any, index: int) -> memoryview:
    try:
        view = memoryview(buf)
    except (TypeError, BufferError):
        raise CodecError(f"buffer {index} is a {type(buf).__name__}, "
                         "not a bytes-like object") from None
    if not view.c_contiguous:
        raise CodecError(f"buffer {index} is not contiguous memory")
    if view.ndim != 1 or view.format != "B":
        try:
            view = view.cast("B")
        except (TypeError, BufferError, ValueError):
            raise CodecError(f"buffer {index} is not contiguous memory") from None
    return view


_TAG = {tag: ord(tag) for tag in "NTFiIfcsSbBanLUDotjWw"}
_A, _D, _L, _U, _I, _F, _S, _N = (_TAG[t] for t in "aDLUifsN")


class _Reader:
    """Walks one header; every read is bounds-checked."""

    __slots__ = ("buffers", "end", "header", "next_buffer", "objects", "pos")

    def __init__(self, header: bytes, buffers: list[memoryview], objects: bool) -> None:
        self.objects = objects
        self.header = header
        self.end = len(header)
        self.buffers = buffers
        self.pos = 0
        self.next_buffer = 1

    def truncated(self, what: str, size: int) -> CodecError:
        return CodecError(f"header truncated while reading {what} at byte {self.pos} "
                          f"(needs {size} bytes, {self.end - self.pos} left)")

    def take(self, size: int, what: str) -> bytes:
        pos = self.pos
        end = pos + size
        if end > self.end:
            raise self.truncated(what, size)
        self.pos = end
        return self.header[pos:end]

    def unpack(self, fmt: struct.Struct, what: str) -> Any:
        pos = self.pos
        if pos + fmt.size > self.end:
            raise self.truncated(what, fmt.size)
        self.pos = pos + fmt.size
        return fmt.unpack_from(self.header, pos)[0]

    def buffer(self, what: str) -> memoryview:
        if self.next_buffer >= len(self.buffers):
            raise CodecError(f"header refers to buffer {self.next_buffer} for {what}, "
                             f"but only {len(self.buffers) - 1} buffers were given")
        view = self.buffers[self.next_buffer]
        self.next_buffer += 1
        return view

    def count(self, what: str, min_node_bytes: int) -> int:
        count: int = self.unpack(_U32, f"{what} length")
        if count * min_node_bytes > self.end - self.pos:
            raise CodecError(f"{what} claims {count} items but only "
                             f"{self.end - self.pos} header bytes remain")
        return count

    def dtype(self) -> np.dtype[Any]:
        size = self.unpack(_U8, "dtype length")
        raw = self.take(size, "dtype")
        dtype = _DTYPES.get(raw.decode("ascii", "replace"))
        if dtype is None:
            raise CodecError(f"unknown or unsupported dtype {raw!r}")
        return dtype

    def node(self, depth: int) -> Any:
        pos = self.pos
        if pos >= self.end:
            raise self.truncated("tag", 1)
        tag = self.header[pos]
        self.pos = pos + 1
        if tag == _A:
            return self.array()
        if tag == _I:
            return self.unpack(_I64, "int")
        if tag == _F:
            return self.unpack(_F64, "float")
        if tag == _S:
            return self.text(self.take(self.unpack(_U32, "length"), "str"))
        if tag == _D:
            return self.mapping(depth)
        if tag in (_L, _U):
            if depth >= MAX_DEPTH:
                raise CodecError(f"nesting deeper than {MAX_DEPTH} levels")
            count = self.count("list" if tag == _L else "tuple", 1)
            items = [self.node(depth + 1) for _ in range(count)]
            return items if tag == _L else tuple(items)
        if tag == _N:
            return None
        return self.rare(tag, depth)

    def rare(self, tag: int, depth: int) -> Any:
        if tag == _TAG["T"]:
            return True
        if tag == _TAG["F"]:
            return False
        if tag == _TAG["b"]:
            return self.take(self.unpack(_U32, "length"), "bytes")
        if tag == _TAG["S"]:
            return self.text(self.buffer("str"))
        if tag == _TAG["B"]:
            return bytes(self.buffer("bytes"))
        if tag == _TAG["n"]:
            dtype = self.dtype()
            return np.frombuffer(self.take(dtype.itemsize, "numpy scalar"), dtype)[0]
        if tag == _TAG["I"]:
            size = self.unpack(_U32, "int length")
            if size > MAX_BIGINT_BYTES:
                raise CodecError(f"int of {size} bytes exceeds {MAX_BIGINT_BYTES}")
            return int.from_bytes(self.take(size, "int"), "little", signed=True)
        if tag == _TAG["c"]:
            real = self.unpack(_F64, "complex")
            return complex(real, self.unpack(_F64, "complex"))
        if tag == _TAG["W"]:
            return self.words()
        if tag == _TAG["w"]:
            return tuple(self.words())
        if tag == _TAG["t"]:
            return self.tensor()
        if tag == _TAG["j"]:
            return self.nested(depth)
        if tag == _TAG["o"]:
            if not self.objects:
                raise CodecError("a pickled value, which only a Loader's own local workers "
                                 "may send (this record came from elsewhere)")
            try:
                return pickle.loads(self.buffer("object"))
            except Exception as exc:
                raise CodecError(f"a pickled value cannot be unpickled: {exc!r}") from None
        raise CodecError(f"unknown tag {bytes([tag])!r} at header byte {self.pos - 1}")

    def words(self) -> list[str]:
        """A ``b"W"`` or ``b"w"`` node's strs (after its tag)."""
        count = self.unpack(_U32, "str list length")
        pos = self.pos
        tag = self.header[pos] if pos < self.end else -1
        self.pos = pos + 1
        if tag == _S:
            joined = self.text(self.take(self.unpack(_U32, "length"), "str list"))
        elif tag == _TAG["S"]:
            joined = self.text(self.buffer("str list"))
        else:
            raise CodecError(f"a str list's text at header byte {pos} is not a str node")
        words = joined.split("\x00")
        if count < 2 or len(words) != count:
            raise CodecError(f"a str list says {count} strs but holds {len(words)} (at least "
                             "2)")
        return words

    def name(self, what: str) -> str:
        raw = self.take(self.unpack(_U8, f"{what} length"), what)
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise CodecError(f"{what} {raw!r} is not ASCII") from None

    def tensor(self) -> Any:
        dtype = codec_torch.dtype_of(self.name("tensor dtype"))
        ndim = self.unpack(_U8, "ndim")
        if ndim > MAX_NDIM:
            raise CodecError(f"tensor has {ndim} dimensions, more than {MAX_NDIM}")
        shape: tuple[int, ...] = _SHAPES[ndim].unpack(self.take(8 * ndim, "shape"))
        data = self.buffer("tensor")
        expected: int = dtype.itemsize
        for dim in shape:
            expected *= dim
        if expected != data.nbytes:
            raise CodecError(f"tensor of shape {shape} and dtype {dtype} needs {expected} "
                             f"bytes but its buffer holds {data.nbytes}")
        return codec_torch.dense(dtype, shape, data)

    def nested(self, depth: int) -> Any:
        if depth >= MAX_DEPTH:
            raise CodecError(f"nesting deeper than {MAX_DEPTH} levels")
        layout = self.name("nested tensor layout")
        dtype = codec_torch.dtype_of(self.name("nested tensor dtype"))
        components = []
        for _ in range(self.count("nested tensor", 1)):
            if self.pos >= self.end or self.header[self.pos] != _TAG["t"]:
                raise CodecError(f"a nested tensor's component at header byte {self.pos} "
                                 "is not a tensor")
            self.pos += 1
            components.append(self.tensor())
        return codec_torch.nested(layout, dtype, components)

    def mapping(self, depth: int) -> dict[Any, Any]:
        if depth >= MAX_DEPTH:
            raise CodecError(f"nesting deeper than {MAX_DEPTH} levels")
        count = self.count("dict", 2)
        result: dict[Any, Any] = {}
        for _ in range(count):
            key = self.node(depth + 1)
            if isinstance(key, (list, dict, np.ndarray)):
                raise CodecError(f"dict key of type {type(key).__name__} is not allowed")
            try:
                hash(key)
            except TypeError:
                raise CodecError(f"dict key of type {type(key).__name__} is not "
                                 "hashable") from None
            if key in result:
                raise CodecError(f"duplicate dict key {key!r}")
            result[key] = self.node(depth + 1)
        return result

    def text(self, raw: bytes | memoryview) -> str:
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise CodecError(f"str is not valid UTF-8 ({exc.reason})") from None

    def array(self) -> np.ndarray:
        dtype = self.dtype()
        ndim = self.unpack(_U8, "ndim")
        if ndim > MAX_NDIM:
            raise CodecError(f"array has {ndim} dimensions, more than {MAX_NDIM}")
        shape = _SHAPES[ndim].unpack(self.take(8 * ndim, "shape"))
        data = self.buffer("array")
        expected = dtype.itemsize
        for dim in shape:
            expected *= dim
        if expected != data.nbytes:
            raise CodecError(f"array of shape {shape} and dtype {dtype} needs {expected} bytes "
                             f"but its buffer holds {data.nbytes}")
        try:
            return np.frombuffer(data, dtype=dtype).reshape(shape)
        except (ValueError, OverflowError) as exc:
            raise CodecError(f"array of shape {shape} cannot be built: {exc}") from None
