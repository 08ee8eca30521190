"""The element codec: round trips, zero copy, and malformed input."""

from __future__ import annotations

import contextlib
import math
import struct
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zloader import CodecError, codec

DTYPES = [np.dtype(order + kind) for kind in
          ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
          for order in "<>"] + [np.dtype(bool)]


def same(a, b) -> bool:
    """Equality that also compares types, dtypes, NaN payloads and signed zeros."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


arrays = st.sampled_from(DTYPES).flatmap(
    lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0,
                                                     max_side=5)))
strided = arrays.filter(lambda a: a.ndim >= 1).map(lambda a: a[::2])
transposed = arrays.map(lambda a: a.T)
numpy_scalars = st.sampled_from(DTYPES).flatmap(hnp.from_dtype).map(lambda v: v[()]
                                                                    if isinstance(v, np.ndarray)
                                                                    else v)
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True), st.complex_numbers(allow_nan=True),
    st.text(max_size=20), st.text(min_size=300, max_size=400).map(lambda t: t * 4),
    st.binary(max_size=20), st.binary(min_size=1025, max_size=1100),
    arrays, strided, transposed, numpy_scalars.filter(lambda v: isinstance(v, np.generic)),
)
keys = st.one_of(st.text(max_size=8), st.integers(-5, 5), st.none(), st.booleans())
elements = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(elements)
def test_round_trip(element):
    assert same(codec.decode(codec.encode(element)), element)


@settings(max_examples=100, deadline=None)
@given(elements)
def test_round_trip_through_one_contiguous_copy(element):
    # What a transport does: copy every buffer into one block, decode views of it.
    buffers = codec.encode(element)
    sizes = [memoryview(b).nbytes for b in buffers]
    block = bytearray(b"".join(bytes(b) for b in buffers))
    views, offset = [], 0
    for size in sizes:
        views.append(memoryview(block)[offset:offset + size])
        offset += size
    assert same(codec.decode(views), element)


def test_decoded_arrays_are_views_of_the_input_memory():
    element = {"a": np.arange(1000, dtype=np.float32), "b": [np.ones((3, 4), np.int16)]}
    buffers = codec.encode(element)
    block = bytearray(b"".join(bytes(b) for b in buffers))
    views, offset = [], 0
    for b in buffers:
        size = memoryview(b).nbytes
        views.append(memoryview(block)[offset:offset + size])
        offset += size
    decoded = codec.decode(views)
    start = np.frombuffer(block, np.uint8).__array_interface__["data"][0]
    for array in (decoded["a"], decoded["b"][0]):
        address = array.__array_interface__["data"][0]
        assert start <= address and address + array.nbytes <= start + len(block)
    decoded["a"][0] = 42.0  # writable memory gives writable arrays, writing into the block
    assert np.frombuffer(block, np.float32, count=1, offset=len(buffers[0]))[0] == 42.0


def test_contiguous_arrays_are_sent_without_a_copy():
    array = np.arange(100, dtype=np.int64).reshape(10, 10)
    buffers = codec.encode([array])
    assert np.shares_memory(np.frombuffer(buffers[1], np.int64), array)
    strided = array[:, ::2]
    buffers = codec.encode(strided)
    decoded = codec.decode(buffers)
    assert decoded.flags.c_contiguous and same(decoded, np.ascontiguousarray(strided))


def test_read_only_memory_gives_read_only_arrays():
    buffers = [bytes(b) for b in codec.encode(np.zeros(4))]
    decoded = codec.decode(buffers)
    assert not decoded.flags.writeable


def test_container_subclasses_arrive_as_plain_containers():
    Point = namedtuple("Point", "x y")
    decoded = codec.decode(codec.encode([Point(1, 2), OrderedDict(a=1)]))
    assert type(decoded[0]) is tuple and decoded[0] == (1, 2)
    assert type(decoded[1]) is dict and decoded[1] == {"a": 1}


def test_bool_and_int_keep_their_types():
    decoded = codec.decode(codec.encode([True, 1, 1.0, np.bool_(True), np.int8(1)]))
    assert [type(v) for v in decoded] == [bool, int, float, np.bool_, np.int8]


@pytest.mark.parametrize("element, message", [
    (object(), "element: type builtins.object is not supported"),
    ({"a": [1, {2, 3}]}, r"element\['a'\]\[1\]: type builtins.set"),
    (np.array(["text"]), "array dtype <U4 is not supported"),
    (np.array([object()]), "array dtype object is not supported"),
    (np.datetime64("2020-01-01"), "numpy scalar of dtype datetime64"),
    (2**9000, "int of 1126 bytes"),
    ("\ud800", "not valid unicode"),
    ({frozenset(): 3}, r"element\[frozenset\(\)\]: type builtins.frozenset"),
    ({np.zeros(1).tobytes(): np.zeros((1,) * 40)}, "40 dimensions"),
])
def test_unsupported_elements_raise_codec_error_naming_the_path(element, message):
    with pytest.raises(CodecError, match=message):
        codec.encode(element)


def test_cycles_are_refused_not_recursed_forever():
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(CodecError, match="nested deeper"):
        codec.encode(cycle)


# --- malformed input -------------------------------------------------------------------------

def header(*parts: bytes) -> bytes:
    return codec.MAGIC + b"".join(parts)


U32 = struct.Struct("<I").pack


def dtype(name: str) -> bytes:
    return bytes([len(name)]) + name.encode()


def array_node(name: str, shape: tuple[int, ...]) -> bytes:
    return b"a" + dtype(name) + bytes([len(shape)]) + struct.pack(f"<{len(shape)}Q", *shape)


MALFORMED = [
    ("no buffers", [], "non-empty list"),
    ("not a list", b"ZLC\x01N", "non-empty list"),
    ("a buffer that is not bytes", [header(b"a"), 12], "not a bytes-like object"),
    ("wrong magic", [b"XYZ\x01N"], "not a zloader element"),
    ("other version", [b"ZLC\x07N"], "codec version 7"),
    ("empty header", [b""], "truncated"),
    ("unknown tag", [header(b"?")], "unknown tag"),
    ("trailing bytes", [header(b"NN")], "unexpected bytes"),
    ("truncated int", [header(b"i\x01\x02")], "truncated while reading int"),
    ("unknown dtype", [header(array_node("<U4", (1,))), b"abcd"], "unsupported dtype"),
    ("object dtype", [header(array_node("|O", (1,))), bytes(8)], "unsupported dtype"),
    ("buffer too short", [header(array_node("<f4", (4,))), bytes(15)], "needs 16 bytes"),
    ("buffer too long", [header(array_node("<f4", (4,))), bytes(17)], "holds 17"),
    ("absurd shape", [header(array_node("<f8", (2**40, 2**40))), bytes(8)], "needs"),
    ("shape too big for numpy", [header(array_node("<f8", (0, 2**63))), b""], "cannot be built"),
    ("too many dims", [header(b"a" + dtype("<f8") + bytes([200])), b""], "200 dimensions"),
    ("missing buffer", [header(array_node("<f4", (1,)))], "only 0 buffers"),
    ("extra buffer", [header(b"N"), b"x"], "1 were given"),
    ("list longer than header", [header(b"L" + U32(2**31))], "claims 2147483648"),
    ("dict longer than header", [header(b"D" + U32(5) + b"NN")], "claims 5"),
    ("bad utf-8", [header(b"s" + U32(2) + b"\xff\xfe")], "not valid UTF-8"),
    ("bad utf-8 buffer", [header(b"S"), b"\xc3"], "not valid UTF-8"),
    ("huge int", [header(b"I" + U32(10**6))], "exceeds"),
    ("str past the end", [header(b"s" + U32(100) + b"abc")], "truncated"),
    ("list key", [header(b"D" + U32(1) + b"L" + U32(0) + b"N")], "key of type list"),
    ("unhashable tuple key", [header(b"D" + U32(1) + b"U" + U32(1) + b"L" + U32(0) + b"N")],
     "not hashable"),
    ("duplicate key", [header(b"D" + U32(2) + b"NTNF")], "duplicate dict key"),
    ("deep nesting", [codec.MAGIC + (b"L" + U32(1)) * 150 + b"N"], "deeper than"),
    ("scalar past the end", [header(b"n" + dtype("<f8") + b"\x00")], "truncated"),
    ("non-contiguous buffer", [header(array_node("|u1", (2,))),
                               np.zeros((2, 2), np.uint8)[:, 0]], "not contiguous"),
    ("str list of fewer strs", [header(b"W" + U32(3) + b"s" + U32(3) + b"a\x00b")],
     "says 3 strs but holds 2"),
    ("str list of more strs", [header(b"W" + U32(2) + b"s" + U32(5) + b"a\x00b\x00c")],
     "says 2 strs but holds 3"),
    ("str list of one str", [header(b"W" + U32(1) + b"s" + U32(1) + b"a")], "at least 2"),
    ("str list without its str", [header(b"W" + U32(2) + b"N")], "is not a str node"),
    ("str list cut short", [header(b"W" + U32(2))], "not a str node"),
    ("str list of bad utf-8", [header(b"W" + U32(2) + b"s" + U32(3) + b"\xff\x00a")],
     "not valid UTF-8"),
    ("str list buffer of bad utf-8", [header(b"W" + U32(2) + b"S"), b"\xff\x00a"],
     "not valid UTF-8"),
]


@pytest.mark.parametrize("case, buffers, message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_input_raises_codec_error(case, buffers, message):
    with pytest.raises(CodecError, match=message):
        codec.decode(buffers)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=12), min_size=2, max_size=40),
       st.integers(0, 2), st.sampled_from([list, tuple]))
def test_a_list_of_strs_goes_as_one_node_and_comes_back_equal(words, repeat, kind):
    """A list or tuple of plain strs (a batch's paths, as torch's collate gives them) is
    one ``W`` (``w``) node, inline or in a buffer of its own; one holding a NUL goes a node
    each. Both decode to the same list (tuple) of the same strs."""
    words = kind(words * (1 + 40 * repeat))  # (past CODEC_INLINE_MAX: the text in a buffer)
    buffers = codec.encode(words)
    one, each = (b"W", b"L") if kind is list else (b"w", b"U")
    assert buffers[0][4:5] == (each if any("\x00" in w for w in words) else one)
    decoded = codec.decode(buffers)
    assert type(decoded) is kind and decoded == words
    assert all(type(w) is str for w in decoded)


def test_a_list_of_strs_and_others_goes_a_node_each():
    for value in (["a", 1], ["a", b"b"], ["a"], [], ("a", 1)):
        buffers = codec.encode(value)
        assert buffers[0][4:5] in (b"L", b"U")
        assert same(codec.decode(buffers), value)


def test_every_truncation_of_a_valid_header_is_refused():
    buffers = codec.encode({"x": np.zeros((2, 3)), "name": "abc", "n": [1, 2.0, None],
                            "words": ["a", "bc", ""]})
    head = buffers[0]
    for cut in range(len(head)):
        with pytest.raises(CodecError):
            codec.decode([head[:cut], *buffers[1:]])


@settings(max_examples=250, deadline=None)
@given(elements, st.data())
def test_corrupted_headers_never_escape_as_other_errors(element, data):
    buffers = codec.encode(element)
    head = bytearray(buffers[0])
    if not head:
        return
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(head) - 1))
        head[position] = data.draw(st.integers(0, 255))
    with contextlib.suppress(CodecError):  # anything but CodecError fails the test
        codec.decode([bytes(head), *buffers[1:]])


def test_nan_and_signed_zero_survive():
    decoded = codec.decode(codec.encode([math.nan, -0.0, complex(math.inf, -0.0)]))
    assert math.isnan(decoded[0]) and math.copysign(1, decoded[1]) == -1
    assert decoded[2].real == math.inf and math.copysign(1, decoded[2].imag) == -1


@given(hnp.arrays(st.sampled_from(DTYPES), hnp.array_shapes(min_dims=0, max_dims=3,
                                                             min_side=0, max_side=4)),
       st.integers(1, 5))
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
def test_stacked_rows_encode_exactly_as_the_stacked_array(row, count):
    rows = [np.ascontiguousarray(row + i if row.dtype != bool else row) for i in range(count)]
    stacked = np.stack(rows)
    lazy = codec.encode({"x": codec.Stacked(rows)})
    eager = codec.encode({"x": stacked})
    assert lazy[0] == eager[0]  # the same header: receivers cannot tell them apart
    assert isinstance(lazy[1], codec.Gather) and len(lazy[1]) == count
    assert codec.nbytes(lazy[1]) == stacked.nbytes
    assert same(codec.decode(codec.joined(lazy))["x"], stacked)


def test_stacked_packs_into_a_record_as_the_stacked_array():
    from zloader.transport import records

    rows = [np.full((3, 5), i, dtype=np.float32) for i in range(7)]
    lazy, eager = codec.encode([codec.Stacked(rows), "tail"]), codec.encode([np.stack(rows),
                                                                              "tail"])
    assert records.packed_size(lazy) == records.packed_size(eager)
    blocks = []
    for buffers in (lazy, eager):
        block = bytearray(records.packed_size(buffers))
        records.pack_into(buffers, memoryview(block))
        blocks.append(bytes(block))
    assert blocks[0] == blocks[1]
    assert same(codec.decode(records.unpack(blocks[0]))[0], np.stack(rows))


@pytest.mark.parametrize("rows, message", [
    ([], "at least one row"),
    ([np.zeros(3), np.zeros(4)], "one dtype and shape"),
    ([np.zeros(3), np.zeros(3, np.float32)], "one dtype and shape"),
    ([np.zeros((4, 4))[:, 0]], "C-contiguous"),
    ([[1, 2]], "numpy arrays"),
])
def test_stacked_refuses_rows_that_do_not_stack(rows, message):
    with pytest.raises(ValueError, match=message):
        codec.Stacked(rows)


def test_stacked_rows_of_an_unsupported_dtype_raise_codec_error():
    with pytest.raises(CodecError, match=r"element\[0\].*dtype"):
        codec.encode([codec.Stacked([np.array(["a"]), np.array(["b"])])])


# --- the one pickle exception: objects=True at both ends (a Loader's own forked workers) ---

class _Custom:
    """A collate output the codec has no node for."""

    def __init__(self, values: list[int]) -> None:
        self.values = values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Custom) and other.values == self.values


def test_objects_true_carries_unknown_leaves_beside_plain_ones():
    element = {"custom": _Custom([1, 2]), "array": np.arange(4), "nested": [_Custom([3])]}
    out = codec.decode(codec.encode(element, objects=True), objects=True)
    assert out["custom"] == _Custom([1, 2]) and out["nested"] == [_Custom([3])]
    assert out["array"].tolist() == [0, 1, 2, 3]


def test_plain_elements_encode_the_same_with_or_without_objects():
    element = {"a": np.arange(3), "b": ("x", 1, 2.5, None)}
    assert [bytes(b) for b in codec.encode(element, objects=True)] == \
        [bytes(b) for b in codec.encode(element)]


def test_a_pickled_leaf_is_refused_unless_the_reader_allows_objects():
    buffers = codec.encode([_Custom([1])], objects=True)
    with pytest.raises(CodecError, match="pickled value"):
        codec.decode(buffers)


def test_without_objects_an_unknown_leaf_is_still_refused():
    with pytest.raises(CodecError, match=r"element\[0\].*not supported"):
        codec.encode([_Custom([1])])


def test_an_unpicklable_leaf_names_its_path():
    with pytest.raises(CodecError, match=r"element\['f'\].*cannot be pickled"):
        codec.encode({"f": lambda: None}, objects=True)


def test_a_corrupt_pickle_is_a_codec_error():
    header, data = codec.encode([_Custom([1])], objects=True)
    with pytest.raises(CodecError, match="cannot be unpickled"):
        codec.decode([header, bytes(data)[:5]], objects=True)


Point = namedtuple("Point", "x y")


def test_objects_true_keeps_a_named_tuples_type_and_plain_tuples_stay_plain():
    out = codec.decode(codec.encode([Point(1, np.arange(2)), (1, 2)], objects=True),
                       objects=True)
    assert type(out[0]).__name__ == "Point" and out[0].y.tolist() == [0, 1]
    assert type(out[1]) is tuple
