"""The compiled core against its pure-Python twins (zloader/_native.py): the same inputs give
the same outputs, byte for byte, over generated inputs; and ``ZLOADER_PURE`` picks the twins.

The compiled module is imported directly, so these tests compare both kernels under
``ZLOADER_PURE=1`` too, and fail where it was not built (``make test`` builds it)."""

from __future__ import annotations

import ctypes
import json
import marshal
import mmap
import os
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zloader import _core, chunks, codec, runs  # type: ignore[attr-defined]
from zloader.lineage import (
    INDEX_BITS,
    Ledger,
    Ranges,
    decode_origins,
    encode_origins,
    ledger,
    ranges,
    wire,
)
from zloader.runs import RunTally
from zloader.transport import messages, records
from zloader.transport.notice import FRAME_HEAD, frame_size
from zloader.worker import streams

# A chunk as a split's reading gives it (values, int64 codes), or as later stages do (values,
# a list of origins: tuples of codes; a batch's rows' origins as an int64 array each).
_codes = st.lists(st.integers(0, 2**40), min_size=1, max_size=40)
_listed = st.lists(st.one_of(st.tuples(st.integers(0, 2**40)),
                             st.lists(st.integers(0, 99), min_size=1, max_size=3)
                             .map(lambda c: np.array(c, np.int64))),
                   min_size=1, max_size=40)


@st.composite
def _chunks(draw: st.DrawFn) -> list[tuple[list[object], object]]:
    out = []
    for n in range(draw(st.integers(0, 12))):
        if draw(st.integers(0, 9)) == 0:  # (now and then origins of another form)
            origins: object = draw(_listed)
        else:
            origins = np.array(draw(_codes), np.int64)
        values = [(n, k) if k % 3 else f"v{n}.{k}" for k in range(len(origins))]  # type: ignore[arg-type]
        out.append((values, origins))
    return out


def _run(kind: type, size: int, seed: int, track: bool,
         pushed: list[tuple[list[object], object]]) -> tuple[list[object], dict[str, object]]:
    rng = np.random.default_rng(seed)
    buffer = kind(size, rng, track)
    out = [buffer.push(list(values), origins if track else None) for values, origins in pushed]
    out.append(buffer.drain())
    out.append(buffer.drain())  # (nothing left)
    return out, rng.bit_generator.state


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (type(a) is type(b) and a.dtype == b.dtype  # type: ignore[union-attr]
                and a.tobytes() == b.tobytes())  # type: ignore[union-attr]
    if isinstance(a, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
                and all(map(_same, a, b)))  # type: ignore[arg-type]
    return a == b and type(a) is type(b)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 70), seed=st.integers(0, 2**32), track=st.booleans(),
       pushed=_chunks())
def test_the_shuffle_buffers_give_the_same_chunks(size: int, seed: int, track: bool,
                                                  pushed: list) -> None:
    pure, pure_state = _run(chunks.ShuffleBuffer, size, seed, track, pushed)
    compiled, compiled_state = _run(_core.ShuffleBuffer, size, seed, track, pushed)
    assert _same(pure, compiled)
    assert pure_state == compiled_state  # (as many draws taken: the run goes on alike)


def test_a_long_run_compacts_alike() -> None:
    """Many chunks through a small buffer: both compact the pool many times."""
    pushed = [([f"e{n}.{k}" for k in range(256)],
               np.arange(n * 256, (n + 1) * 256, dtype=np.int64)) for n in range(60)]
    for size in (1, 7, 1024):
        pure, _ = _run(chunks.ShuffleBuffer, size, 5, True, pushed)
        compiled, _ = _run(_core.ShuffleBuffer, size, 5, True, pushed)
        assert _same(pure, compiled)
        got = [v for chunk in pure if chunk is not None for v in chunk.values]
        assert sorted(got) == sorted(v for values, _ in pushed for v in values)


# Origin blocks as workers write them (zloader/lineage/wire.py): reads of splits of two
# passes, elements of one code each or several (a batch's rows, as a tuple or an array),
# loose codes, split ends; then, now and then, one int64 of the block changed to a value
# that breaks a rule, or the block cut or lengthened (a hostile or corrupted record).
_PASS_KEYS = {(0,): 0, (0, 7): 1}
_EDGES = [-1, 0, 1, 2, 3, 7, 64, (1 << 31), (1 << 32) - 1, 1 << 32, (1 << 62), (1 << 63) - 1,
          -(1 << 63)]
_ENDS = st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(0, 5), st.integers(0, 300),
                           st.integers(0, 2**33)).map(list), max_size=3)


def _reads(most: int) -> st.SearchStrategy:
    """The (pass id, split) of each split reading of a worker's run."""
    return st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(0, 5)), min_size=1,
                    max_size=most)


def _origin_forms(reads: list) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """A code of one of ``reads``, and an element's origin made of such codes (one code,
    several as a tuple, or as an int64 array)."""
    code = st.builds(lambda r, i: r << INDEX_BITS | i, st.integers(0, len(reads) - 1),
                     st.integers(0, 300))
    element = st.one_of(st.tuples(code), st.lists(code, min_size=1, max_size=5).map(tuple),
                        st.lists(code, min_size=1, max_size=5)
                        .map(lambda c: np.array(c, np.int64)))
    return code, element


@st.composite
def _blocks(draw: st.DrawFn) -> tuple[bytes, int]:
    reads = draw(_reads(4))
    code, element = _origin_forms(reads)
    if draw(st.booleans()):  # (a batch's rows; past SMALL_ORIGIN_BLOCK, a shuffle's go as codes)
        origins: list = [np.array(draw(st.lists(code, min_size=20, max_size=120)), np.int64)]
    else:
        origins = draw(st.lists(element, min_size=0, max_size=40))
    loose = draw(st.lists(code, max_size=3))
    ends = draw(_ENDS)
    block = np.frombuffer(encode_origins(origins, loose, reads, _PASS_KEYS, ends),
                          np.int64).copy()
    change = draw(st.integers(0, 3))
    if change == 1:
        block[draw(st.integers(0, len(block) - 1))] = draw(st.sampled_from(_EDGES))
    raw = block.tobytes()
    if change == 2:
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif change == 3:
        raw += bytes(8 * draw(st.integers(1, 3)))
    return raw, len(origins)


def _decoded(decode: object, raw: bytes, elements: int) -> object:
    try:
        return decode(raw, elements)  # type: ignore[operator]
    except ValueError as exc:
        return ("ValueError", str(exc))


@settings(max_examples=600, deadline=None)
@given(case=_blocks(), other_count=st.booleans())
def test_the_origin_block_decoders_agree(case: tuple[bytes, int], other_count: bool) -> None:
    raw, elements = case
    elements += other_count  # (a block read for another number of elements)
    pure = _decoded(decode_origins, raw, elements)
    compiled = _decoded(_core.decode_origins, raw, elements)
    if isinstance(pure, tuple):
        assert compiled == pure
        return
    assert not isinstance(compiled, tuple), compiled
    for field in ("keys", "uniform", "counts", "loose", "runs", "ends", "reads", "codes",
                  "groups"):
        assert _same(getattr(pure, field), getattr(compiled, field)), field


# What a worker's tally hands the encoder (zloader/runs.py RunTally.block): origins of each
# form a record holds (one code, an element's several as a tuple or an array, one batch's
# codes in order or shuffled), loose codes, split ends, groups now and then, the pass keys
# as a list or only the dict; and inputs the C path does not take as they are (a code
# naming no reading, an int past int64, a reading of three ints), which both must refuse
# alike or the compiled one hand to the pure one.
_ODD = [-1, 1 << 63, 2**70, -(1 << 63)]


@st.composite
def _encoder_inputs(draw: st.DrawFn) -> tuple:
    reads = draw(_reads(6))
    code, element = _origin_forms(reads)
    element = st.one_of(element, st.lists(code, min_size=1, max_size=3)
                        .map(lambda c: np.array(c, np.uint64)))
    form = draw(st.integers(0, 3))
    if form == 0:  # (batches' rows: in order, or shuffled, an array per batch)
        origins: list = []
        for _ in range(draw(st.integers(1, 4))):
            rows = draw(st.lists(code, min_size=1 if origins else 20, max_size=120))
            if draw(st.booleans()):
                rows = sorted(rows)
            origins.append(np.array(rows, np.int64))
    elif form == 1:  # (a lone element's)
        origins = [draw(element)]
    else:
        origins = draw(st.lists(element, min_size=0, max_size=40))
    loose = draw(st.lists(code, max_size=3))
    ends = draw(_ENDS)
    groups = draw(st.sampled_from([(), (), (), ([0, 1, 2, 0, 4, 1, 0, 1, 0, 4],)]))
    keys = [(0,), (0, 7)] if draw(st.booleans()) else None
    odd = draw(st.integers(0, 9))
    if odd == 1 and loose:
        loose[0] = draw(st.sampled_from(_ODD))
    elif odd == 2:
        reads = reads[:1]  # (codes that name readings past the first name none)
    elif odd == 3:
        reads = [(*read, 0) for read in reads]
    elif odd == 4 and ends:
        ends[0][3] = draw(st.sampled_from(_ODD))
    elif odd == 5:  # (an end cut short: the compiled one read past it once)
        ends.append(draw(st.sampled_from([[], [0], ()])))
    elif odd == 6:  # (floats, which struct refuses: not truncated)
        origins.append(draw(st.sampled_from([(1.5,), (2.0,), np.array([1.0, 2.0])])))
    elif odd == 7:  # (codes in the other byte order)
        origins.append(np.array([1, 2], np.int64).astype(">i8"))
    elif odd == 8 and keys is not None:  # (keys by a mapping, not a list)
        keys = dict(enumerate(keys))
    return origins, loose, reads, dict(_PASS_KEYS), ends, groups, keys


def _encoded(encode: object, args: tuple) -> object:
    try:
        return encode(*args)  # type: ignore[operator]
    except Exception as exc:  # (the same error, whichever it is)
        return (type(exc).__name__, str(exc))


@settings(max_examples=800, deadline=None)
@given(args=_encoder_inputs())
def test_the_origin_block_encoders_agree(args: tuple) -> None:
    assert _encoded(_core.encode_origins, args) == _encoded(encode_origins, args)


def test_the_blocks_of_a_lone_record_and_of_shuffled_batches_are_written_in_c(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks the compiled encoder is for (the generated cases hold them too) are
    written without the pure function (made to fail here), and are its bytes."""
    reads, keys = [(0, 3), (0, 4)], [(0,)]
    lone = ([(5,)], [], reads, {(0,): 0}, [[0, 3, 9, 77]], [], keys)
    shuffled = np.random.default_rng(1).permutation(256).astype(np.int64) | (1 << INDEX_BITS)
    batch = ([shuffled], [], reads, {(0,): 0}, [], [], keys)
    batches = ([shuffled[:100], shuffled[100:]], [], reads, {(0,): 0}, [[0, 3, 9, 7]], [],
               keys)
    expected = [encode_origins(*args) for args in (lone, batch, batches)]
    monkeypatch.setattr(wire, "encode_origins", None)  # (a call to it raises TypeError)
    assert [_core.encode_origins(*args) for args in (lone, batch, batches)] == expected
    assert len(expected[1]) == 8 * (8 + 3 + 3 + 256)  # (head, pass key, one reading, codes)
    buffers = [b"head", np.arange(600, dtype=np.int64), memoryview(b"x" * 70)]
    block, pure = bytearray(8192), bytearray(8192)
    used = records.pack_into(buffers, memoryview(pure))
    monkeypatch.setattr(records, "pack_into", None)
    assert _core.pack_into(buffers, memoryview(block)) == used and block == pure


def _buffers() -> st.SearchStrategy:
    one = st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=200).map(bytearray),
        st.binary(max_size=200).map(memoryview),
        st.lists(st.integers(-2**63, 2**63 - 1), max_size=40).map(lambda v: np.array(v, np.int64)),
        st.integers(0, 40).map(lambda n: np.arange(2 * n, dtype=np.float32)[::2]),  # (strided)
        st.lists(st.binary(max_size=60), max_size=3)
        .map(lambda parts: codec.Gather(memoryview(p) for p in parts)),
        st.just(np.zeros(5000, np.uint8)))  # (past SMALL_COPY)
    return st.lists(one, max_size=5)


_BLOCKS = ["view", "view", "bytearray", "bytes", "strided", "int64 view", "int64 array",
           "2-D view"]
_SIZES = [None, "right", "one more", "a float", "2**63", "2**64", "a generator's"]


def _block_of(kind: str, size: int) -> tuple[bytearray, object]:
    """A block of ``size`` bytes (rounded to 8) of ``kind``, and its bytes to compare."""
    raw = bytearray(-(-size // 16) * 16 * (2 if kind == "strided" else 1))
    if kind == "2-D view" and not raw:
        kind = "view"  # (no 2-D view of nothing)
    given = {"view": lambda: memoryview(raw), "bytearray": lambda: raw,
             "bytes": lambda: bytes(raw),  # (read-only)
             "strided": lambda: memoryview(raw)[::2],
             "int64 view": lambda: memoryview(raw).cast("q"),
             "int64 array": lambda: np.frombuffer(raw, np.int64),
             "2-D view": lambda: memoryview(raw).cast("B", (len(raw) // 16, 16))}[kind]()
    return raw, given


@settings(max_examples=800, deadline=None)
@given(buffers=_buffers(), slack=st.integers(-300, 300), sizes_kind=st.sampled_from(_SIZES),
       block_kind=st.sampled_from(_BLOCKS))
def test_the_record_packers_agree(buffers: list, slack: int, sizes_kind: str | None,
                                  block_kind: str) -> None:
    sizes: object = None if sizes_kind is None else records.sizes_of(buffers)
    if sizes and sizes_kind != "right":  # (sizes that are not the buffers', or not ints)
        odd = {"one more": sizes[0] + 1, "a float": float(sizes[0]), "2**63": 2**63,  # type: ignore[index]
               "2**64": 2**64, "a generator's": sizes[0]}[sizes_kind]  # type: ignore[index]
        sizes[0] = odd  # type: ignore[index]
    try:
        need = records.packed_size(buffers)
    except ValueError:
        need = 0
    outs = []
    for pack in (records.pack_into, _core.pack_into):
        raw, block = _block_of(block_kind, max(0, need + slack))
        given = (iter(buffers) if sizes_kind == "a generator's" else buffers)
        outs.append((_encoded(pack, (given, block, sizes)), bytes(raw)))
    assert outs[0] == outs[1]


@st.composite
def _packed_blocks(draw: st.DrawFn) -> bytes:
    """Records as workers pack them, then now and then one header field set to an edge
    value, or the block cut short or lengthened (a hostile or corrupted record)."""
    buffers = draw(st.lists(st.binary(max_size=150), max_size=5))
    block = bytearray(records.packed_size(buffers))
    records.pack_into(buffers, memoryview(block))
    change = draw(st.integers(0, 3))
    if change == 1:
        field = draw(st.integers(0, len(buffers)))
        value = draw(st.sampled_from([0, 1, 63, 64, 2**20, 2**20 + 1, 2**32 - 1, 2**63,
                                      2**64 - 1]))
        if field == 0:
            block[0:4] = (value % 2**32).to_bytes(4, "little")
        else:
            block[8 * field:8 * field + 8] = value.to_bytes(8, "little")
    elif change == 2:
        block = block[:draw(st.integers(0, len(block)))]
    elif change == 3:
        block += bytes(draw(st.integers(1, 100)))
    return bytes(block)


def _unpacked(unpack: object, block: bytes) -> object:
    try:
        views = unpack(block)  # type: ignore[operator]
    except Exception as exc:  # (the same error, whichever it is)
        return (type(exc).__name__, str(exc))
    return [(type(view).__name__, view.format, bytes(view)) for view in views]


@settings(max_examples=500, deadline=None)
@given(block=_packed_blocks(), as_array=st.booleans())
def test_the_record_unpackers_agree(block: bytes, as_array: bool) -> None:
    given = np.frombuffer(block, np.uint8) if as_array else memoryview(block)
    assert _unpacked(_core.unpack, given) == _unpacked(records.unpack, given)


_DATA_FIELDS = st.fixed_dictionaries({
    "epoch": st.integers(0, 2**64 - 1), "count": st.integers(0, 2**64 - 1),
    "skipped": st.integers(0, 3),
    "ring": st.one_of(st.none(), st.just((64, 128, "zloader-1-2-ring-ab"))),
    "segment": st.one_of(st.none(), st.just(("zloader-1-2-seg-cd", 4096))),
    "full": st.booleans(), "shared": st.booleans(),
    "lagged": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "round": st.one_of(st.none(), st.integers(0, 9)),
    "origins": st.booleans(), "framed": st.booleans(),
    "after": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "part": st.one_of(st.none(), st.integers(0, 70)),
    "first": st.one_of(st.none(), st.integers(0, 2**40))})


@st.composite
def _framed_blocks(draw: st.DrawFn) -> bytes:
    """Framed ring records as workers write them (transport/notice.py: the DATA body,
    then the packed buffers at the next 64 bytes), most of them plain; then now and then
    the body's length, its flags or its size changed, or the block cut or lengthened."""
    fields = draw(_DATA_FIELDS)
    if draw(st.integers(0, 3)):  # (mostly what a framed record's body names)
        fields.update(ring=None, segment=None, framed=False)
    body = messages.Data.checked(fields).to_body()
    change = draw(st.integers(0, 6))
    if change == 1:  # unknown flag bits
        flags = int.from_bytes(body[24:26], "little") | draw(st.sampled_from([1 << 11,
                                                                              1 << 15]))
        body = body[:24] + flags.to_bytes(2, "little") + body[26:]
    elif change == 2:  # a body cut inside its fields, or with bytes after them
        body = body[:draw(st.integers(0, len(body)))] if draw(st.booleans()) \
            else body + bytes(draw(st.integers(1, 9)))
    buffers = draw(st.lists(st.binary(max_size=100), max_size=4))
    start, length = frame_size(len(body), records.packed_size(buffers))
    block = bytearray(length)
    FRAME_HEAD.pack_into(block, 0, len(body), 0)
    block[FRAME_HEAD.size:FRAME_HEAD.size + len(body)] = body
    records.pack_into(buffers, memoryview(block)[start:])
    if change == 3:  # the body's length wrong
        size = draw(st.sampled_from([0, 1, len(body) - 1, len(body) + 1, len(block),
                                     2**32 - 1]))
        block[0:4] = (max(0, size) % 2**32).to_bytes(4, "little")
    elif change == 4:
        block = block[:draw(st.integers(0, len(block)))]
    elif change == 5:
        block += bytes(draw(st.integers(1, 70)))
    elif change == 6:  # a buffer's size wrong
        at = start + 8 * draw(st.integers(0, len(buffers)))
        if at + 8 <= len(block):
            block[at:at + 8] = draw(st.sampled_from([0, 2**20, 2**63])).to_bytes(8, "little")
    return bytes(block)


def _unframed(unframe: object, block: object) -> object:
    try:
        data, views = unframe(block)  # type: ignore[operator]
    except Exception as exc:  # (the same error, whichever it is)
        return (type(exc).__name__, str(exc))
    return (type(data).__name__, dict(vars(data)),
            [(type(view).__name__, view.format, bytes(view)) for view in views])


@settings(max_examples=800, deadline=None)
@given(block=_framed_blocks(), form=st.sampled_from(["array", "bytes", "view", "strided"]))
def test_the_framed_record_readers_agree(block: bytes, form: str) -> None:
    """A framed ring record read by the compiled twin gives the pure reader's body (each
    field, each type) and buffers, or the same error."""
    given: object = {"array": np.frombuffer(block, np.uint8), "bytes": block,
                     "view": memoryview(block),
                     "strided": np.repeat(np.frombuffer(block, np.uint8), 2)[::2]}[form]
    assert _unframed(_core.unframe, given) == _unframed(messages.unframe, given)


def test_a_plain_framed_record_is_read_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """The framed records workers write (no place of their own) are read without the pure
    function (made to fail here), and give its body and buffers."""
    for fields in ({}, {"lagged": 3, "round": 2, "after": 7, "part": 1, "first": 5,
                        "full": True, "shared": True, "origins": True}):
        body = messages.Data.checked({
            "epoch": 2, "count": 1, "skipped": 0, "ring": None, "segment": None,
            "full": False, "shared": False, "lagged": None, "round": None,
            "origins": False, "framed": False, "after": None, "part": None,
            "first": None, **fields}).to_body()
        buffers = [b"head", np.arange(9, dtype=np.int64)]
        start, length = frame_size(len(body), records.packed_size(buffers))
        block = np.zeros(length, np.uint8)
        FRAME_HEAD.pack_into(block, 0, len(body), 0)
        block[FRAME_HEAD.size:FRAME_HEAD.size + len(body)] = np.frombuffer(body, np.uint8)
        records.pack_into(buffers, memoryview(block)[start:])
        expected = _unframed(messages.unframe, block)
        with monkeypatch.context() as patched:
            patched.setattr(messages, "unframe", None)  # (a call to it raises TypeError)
            assert _unframed(_core.unframe, block) == expected


@st.composite
def _records_made(draw: st.DrawFn) -> list:
    """A worker's records in a row: each a few elements (ints, strings, arrays) with the
    origin codes of a split's reading, some split ends and loose codes between them."""
    made = []
    for _ in range(draw(st.integers(1, 6))):
        count = draw(st.integers(1, 40))
        values = draw(st.lists(st.one_of(st.integers(-2**40, 2**40), st.text(max_size=8),
                                         st.lists(st.integers(0, 255), max_size=9)
                                         .map(lambda v: np.array(v, np.uint8))),
                               min_size=count, max_size=count))
        codes = draw(st.permutations(range(count)) if draw(st.booleans())
                     else st.just(list(range(count))))
        made.append((values, [(c,) for c in codes] if draw(st.booleans())
                     else [np.array(codes, np.int64)], draw(st.booleans())))
    return made


def _worker_records(made: list) -> list[bytes]:
    """``made`` encoded and packed as a worker does (zloader/worker/producer.py
    ``_encode``; zloader/worker/streams.py ``Outlet.record``), with the kernels that
    runs.py and streams.py hold."""
    tally = RunTally()
    tally.reads.append((tally.pass_id((0,)), 7))
    out = []
    for values, origins, ended in made:
        if ended:
            tally.ends.append([0, 7, len(values), 12345])
            tally.loose.append(1 << 20)
        buffers = codec.encode(values, False)
        buffers.append(tally.block(origins))
        block = bytearray(records.packed_size(buffers))
        used = streams.pack_into(buffers, memoryview(block))
        out.append(bytes(block[:used]))
    return out


@settings(max_examples=300, deadline=None)
@given(made=_records_made())
def test_a_workers_records_are_the_same_bytes_with_either_kernels(made: list) -> None:
    made_by = []
    for encode, pack in ((_core.encode_origins, _core.pack_into),
                         (encode_origins, records.pack_into)):
        with pytest.MonkeyPatch.context() as patch:  # (what runs.py and streams.py pick)
            patch.setattr(runs, "encode_origins", encode)
            patch.setattr(streams, "pack_into", pack)
            made_by.append(_worker_records(made))
    assert made_by[0] == made_by[1]


@st.composite
def _held_and_codes(draw: st.DrawFn) -> tuple[list[int], list[int], list[np.ndarray]]:
    """Ranges a split holds (as a ledger makes them) and arrays of codes of one reading to
    add: dense or sparse, in order or not, repeats, indices held already, other readings'
    high bits, and now and then an array the bitmap does not take (too thin, another
    dtype, strided, empty)."""
    span = draw(st.sampled_from([8, 300, 5000, 1 << 20, 1 << 32]))
    held = Ranges()
    for _ in range(draw(st.integers(0, 4))):
        indices = draw(st.lists(st.integers(0, span - 1), min_size=1, max_size=60))
        held.add_indices([np.array(indices, np.int64)])
    read = draw(st.integers(0, 5)) << INDEX_BITS
    arrays = []
    for _ in range(draw(st.integers(0, 4))):
        low = draw(st.integers(0, span - 1))
        indices = draw(st.lists(st.integers(low, min(span - 1, low + draw(st.sampled_from(
            [0, 3, 200, 70_000, span])))), min_size=0, max_size=80))
        array = np.array(indices, np.int64) | read
        form = draw(st.sampled_from(["plain"] * 6 + ["strided", "int32", "list"]))
        if form == "list":  # (not an array: the compiled fold leaves it to the pure one)
            arrays.append(array.tolist())
            continue
        if form == "strided":
            array = np.repeat(array, 2)[::2]
        elif form == "int32" and len(indices) and max(indices) < 2**31:
            array = array.astype(np.int32) if not read else array
        arrays.append(array)
    return held.starts, held.ends, arrays


@settings(max_examples=600, deadline=None)
@given(case=_held_and_codes())
def test_the_ledger_folds_agree(case: tuple[list[int], list[int], list[np.ndarray]]) -> None:
    """The compiled fold gives the pure one's ranges and count, or None (the caller then
    uses the pure one), and changes neither the lists nor the arrays given."""
    starts, ends, arrays = case
    before = (list(starts), list(ends), [np.array(a, copy=True) for a in arrays])
    pure = ranges.merge_indices(starts, ends, arrays)
    compiled = _core.merge_indices(starts, ends, arrays)
    assert (starts, ends) == before[:2]
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before[2], strict=True))
    if compiled is not None:
        assert compiled == pure
    indices = set()
    for a, b in zip(starts, ends, strict=True):
        indices.update(range(a, b)) if b - a < 10**6 else None
    if all(b - a < 10**6 for a, b in zip(starts, ends, strict=True)):
        for array in arrays:
            indices.update((np.asarray(array, np.int64).reshape(-1)
                            & ((1 << INDEX_BITS) - 1)).tolist())
        got = set()
        for a, b in zip(pure[0], pure[1], strict=True):
            got.update(range(a, b))
        assert got == indices and pure[2] == len(indices)


def test_a_shuffles_codes_are_folded_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer's ledger folds a shuffle's records with the compiled twin (the pure one
    made to fail here), and holds what the pure one holds."""
    rng = np.random.default_rng(5)
    records = [rng.permutation(np.arange(k * 256, (k + 1) * 256)) for k in range(300)]
    expected = Ledger()
    for codes in records:
        expected.add_codes({0: (0,)}, [0, 0, 3], codes.astype(np.int64))
    monkeypatch.setattr(Ranges, "merge", staticmethod(_core.merge_indices))
    for module in (ledger, ranges):  # (a call to it raises TypeError)
        monkeypatch.setattr(module, "index_runs", None)
    got = Ledger()
    for codes in records:
        got.add_codes({0: (0,)}, [0, 0, 3], codes.astype(np.int64))
    assert got.open[((0,), 3)].starts == [0] and got.open[((0,), 3)].count == 300 * 256
    assert got.to_json() == expected.to_json()


def test_zloader_pure_selects_the_pure_twins() -> None:
    script = ("import zloader._native as n, zloader.stages as s, zloader.client.receive as r, "
              "zloader.runs as t, zloader.worker.streams as w, zloader.lineage as l; "
              "print(n.ACTIVE, s.shuffle_buffer.__module__, r.decode_origins.__module__, "
              "t.encode_origins.__module__, w.pack_into.__module__, r.unpack.__module__, "
              "l.Ranges.merge.__module__, r.unframe.__module__)")
    env = {**os.environ, "ZLOADER_PURE": "1"}
    pure = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.split()
    env.pop("ZLOADER_PURE")
    used = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout.split()
    assert pure == ["False", "zloader.chunks", "zloader.lineage.wire", "zloader.lineage.wire",
                    "zloader.transport.records", "zloader.transport.records",
                    "zloader.lineage.ranges", "zloader.transport.messages"]
    assert used == ["True", *["zloader._core"] * 7]
    version = subprocess.run([sys.executable, "-m", "zloader.cli", "--version"], env=env,
                             capture_output=True, text=True, check=True, timeout=60).stdout
    assert version.strip().endswith("(compiled core)")


_E2E = """
import hashlib, json, zloader, zloader._native as native
pipeline = zloader.Pipeline.range(20000).shuffle(300, seed=3).batch(64)
digest = hashlib.sha256()
with zloader.Loader(pipeline, num_workers=2, deterministic=True) as loader:
    for batch in loader:
        digest.update(batch.tobytes())
    state = loader.state_dict()
print(json.dumps([native.ACTIVE, digest.hexdigest(), state["epoch"]]))
"""


def test_a_loader_gives_the_same_batches_with_either_kernels() -> None:
    """End to end: a deterministic Loader's shuffled batches, made by forked workers with
    the compiled core and with ZLOADER_PURE=1, are the same bytes."""
    outputs = []
    for pure in ("0", "1"):
        env = {**os.environ, "ZLOADER_PURE": pure}
        done = subprocess.run([sys.executable, "-c", _E2E], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (compiled, *made), (pure, *made_pure) = outputs
    assert (compiled, pure) == (True, False)
    assert made == made_pure


# --- the packer's writer of a list in marshal format 2 --------------------------------------

_MARSHAL_EDGES = [2**31 - 1, -2**31, 2**31, -2**31 - 1, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**45,
          -2**30, 0, -0.0, float("nan"), "\ud800", "a\udfff", "\U0001f600", "\xe9", "\u07ff",
          "\u0800", "\uffff", "\x7f", "\x80", "", (), {}]
"""Where marshal's format changes (an int's code, a str's UTF-8 length per character)."""

_atoms = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                   st.integers(-2**63, 2**63 - 1), st.floats(), st.complex_numbers(),
                   st.text(max_size=6), st.binary(max_size=4),
                   st.sampled_from(_MARSHAL_EDGES))
_nested = st.recursive(
    _atoms, lambda inner: st.one_of(
        st.tuples(inner, inner), st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
        st.lists(inner, max_size=2),  # (a list: neither writer takes it)
        st.dictionaries(st.integers(0, 3), inner, min_size=1, max_size=2)),  # (keys not str)
    max_leaves=12)


def _anonymous(size: int) -> mmap.mmap:
    return mmap.mmap(-1, max(1, size))


@settings(max_examples=300, deadline=None)
@given(st.lists(_nested, max_size=12), st.sampled_from([list, tuple]), st.integers(0, 5))
def test_the_marshal_writers_agree(values: list, kind: type, limit: int) -> None:
    """The packer's writer of a list's elements (zloader/packed.py): the same memory (the
    offsets' table, then each element as marshal format 2 writes it), the same offsets,
    how deep they nest and whether a dict is among them, in C and in Python; and it takes
    exactly what ``packed.packable`` takes, bytes aside (marshal writes any buffer as
    bytes)."""
    from zloader import packed

    values = kind(values)
    compiled = _core.marshal_into(values, _anonymous, limit)
    pure = packed.marshal_into(values, _anonymous, limit)
    assert (compiled is None) == (pure is None)
    depth, packed.PACK_MAX_DEPTH = packed.PACK_MAX_DEPTH, limit
    try:
        levels = packed._levels(values, set(map(type, values)), 0, set())
    finally:
        packed.PACK_MAX_DEPTH = depth
    if pure is None:  # (what packable refuses, or bytes: refused)
        assert levels is None or any(type(x) is bytes for x in _walked_values(values))
        return
    assert bytes(compiled[0]) == bytes(pure[0])
    assert np.array_equal(compiled[1], pure[1]) and compiled[2:] == pure[2:]
    memory, offsets, deepest, dicts = pure
    table = 8 * (len(values) + 1)
    assert np.frombuffer(memory, "<i8", len(values) + 1).tolist() == offsets.tolist()
    assert deepest == levels and len(memory) == max(1, table + int(offsets[-1]))
    for at, value in enumerate(values):
        element = memory[table + offsets[at]:table + offsets[at + 1]]
        assert element == marshal.dumps(value, 2)
    assert dicts == any(type(x) is dict for x in _walked_values(values))


@pytest.mark.parametrize("kind", [list, tuple])
def test_the_writers_agree_where_marshal_s_format_changes(kind: type) -> None:
    from zloader import packed

    values = kind([*_MARSHAL_EDGES, tuple(_MARSHAL_EDGES), {"k": tuple(_MARSHAL_EDGES)}])
    compiled = _core.marshal_into(values, _anonymous, 4)
    pure = packed.marshal_into(values, _anonymous, 4)
    assert compiled is not None and pure is not None
    assert bytes(compiled[0]) == bytes(pure[0])


def _walked_values(values: Any) -> Any:
    for value in values:
        yield value
        if type(value) is tuple:
            yield from _walked_values(value)
        elif type(value) is dict:
            yield from _walked_values(list(value.values()))


def test_the_compiled_writer_takes_no_reference_to_an_element() -> None:
    """(In a forked packer each reference taken would copy the element's page.)"""
    element = ("/data/0.jpg", 7, {"k": 2**40})
    counts = [sys.getrefcount(part) for part in (element, *element, element[2]["k"])]
    assert _core.marshal_into([element] * 10, _anonymous, 4) is not None
    assert [sys.getrefcount(part) for part in (element, *element,
                                               element[2]["k"])] == counts


def test_a_list_changed_while_its_memory_is_made_is_not_written() -> None:
    values = [("a", k) for k in range(100)]

    def allocate(size: int) -> mmap.mmap:
        values[50] = ("a much longer string than before", 50)  # (another thread, say)
        return _anonymous(size)

    assert _core.marshal_into(values, allocate, 4) is None
    shorter = [("a", k) for k in range(100)]
    assert _core.marshal_into(shorter, lambda size: (shorter.pop(), _anonymous(size))[1],
                              4) is None


def test_the_shape_written_is_the_shape_said_when_allocate_swaps_an_element() -> None:
    values: list[Any] = [(None, None)]

    def allocate(size: int) -> mmap.mmap:
        values[0] = ({},)  # (the same size, another shape: a dict, two levels)
        return _anonymous(size)

    written = _core.marshal_into(values, allocate, 4)
    assert written is not None and written[2:] == (2, True)
    assert written[0][16:] == marshal.dumps(({},), 2)


@pytest.mark.skipif(not hasattr(ctypes.pythonapi, "PyUnicode_FromUnicode"),
                    reason="this Python makes no legacy (not ready) str")
def test_a_legacy_str_not_ready_is_written_as_marshal_writes_it() -> None:
    make = ctypes.pythonapi.PyUnicode_FromUnicode
    make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
    at = ctypes.pythonapi.PyUnicode_AsUnicode
    at.restype, at.argtypes = ctypes.c_void_p, [ctypes.py_object]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        text = make(None, 3)
    ctypes.memmove(at(text), "\xe9\U0001f600x".encode("utf-32-le"), 12)
    written = _core.marshal_into([text], _anonymous, 4)
    assert written is not None and written[0][16:] == marshal.dumps(text, 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(_nested, min_size=1, max_size=6))
def test_a_list_packed_by_the_writer_is_the_same_bytes(elements: list) -> None:
    """``packed.pack`` of a large list, written by the compiled writer or sized by the
    checks by type (the pure path): the same memory, the same flatness, or both None."""
    from zloader import packed

    values = [elements[k % len(elements)] for k in range(packed.PACK_MIN_ITEMS)]
    written = packed.pack(values, writer=_core.marshal_into)
    checked = packed.pack(values)
    assert (written is None) == (checked is None)
    if written is not None and checked is not None:
        assert bytes(written._memory) == bytes(checked._memory)
        assert written.flat == checked.flat
        assert [marshal.dumps(x, 2) for x in written] == [marshal.dumps(x, 2) for x in values]


def test_a_dataset_s_paths_are_packed_by_the_writer() -> None:
    """A dataset's (path, label) pairs, some paths not ASCII, are packed by the compiled
    writer as the pure path packs them."""
    from zloader import packed

    values = [(f"/data/{'é' if k % 7 == 0 else ''}{k}.jpg", k % 1000) for k in range(100_000)]
    assert _core.marshal_into(values, _anonymous, packed.PACK_MAX_DEPTH) is not None
    view = packed.pack(values, writer=_core.marshal_into)
    assert view is not None and view.flat and view[12345] == values[12345]
    assert bytes(view._memory) == bytes(packed.pack(values)._memory)
