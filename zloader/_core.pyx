# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""zloader's compiled core: C twins of pure-Python kernels of the per-record path, and of the
packer's writer of a list in marshal format 2 (zloader/packed.py).

Each class or function here gives what its twin gives, byte for byte (tests/test_native.py
compares them over generated inputs); zloader/_native.py picks which one runs. Only the
hot loops are here: everything else stays in the modules that own it.
"""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_SIMPLE,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.number cimport PyNumber_Index
from cpython.object cimport PyObject
from cpython.unicode cimport PyUnicode_READ
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

cimport cython
cimport numpy as cnp

import sys

import numpy as np

from zloader import codec as _codec
from zloader._defaults import (
    CHUNK_ELEMENTS,
    MAX_BUFFERS,
    MAX_MIX_INPUTS,
    MERGE_BITMAP_FACTOR,
    MERGE_BITMAP_SLACK,
    SCATTER_SAMPLE,
    SHUFFLE_DRAW_CHUNK,
    SMALL_ORIGIN_BLOCK,
)
from zloader.chunks import Chunk
from zloader.errors import CodecError
from zloader.transport import messages as _messages
from zloader.transport import notice as _notice
from zloader.transport import records as _records
from zloader.lineage import tags as _tags
from zloader.lineage import wire as _wire

cnp.import_array()

__all__ = ["ShuffleBuffer", "decode_origins", "encode_origins", "marshal_into",
           "merge_indices", "pack_into", "unframe", "unpack"]

cdef long long INDEX_BITS = _tags.INDEX_BITS
cdef long long INDEX_MASK = _tags.INDEX_MASK
cdef long long MAX_PASS_ID = _tags.MAX_PASS_ID
cdef long long MAX_KEY_LENGTH = _tags.MAX_KEY_LENGTH
cdef Py_ssize_t HEAD = _wire._HEAD
cdef Py_ssize_t SMALL_BLOCK = SMALL_ORIGIN_BLOCK
cdef Py_ssize_t SCATTER = SCATTER_SAMPLE
cdef Py_ssize_t ALIGN = _records.ALIGN
# The pure functions write little-endian int64s (struct's "<q"); a C copy of this host's
# is the same bytes only here. Elsewhere every block goes to them.
cdef bint LITTLE = sys.byteorder == "little"
cdef Py_ssize_t BITMAP_FACTOR = MERGE_BITMAP_FACTOR
cdef Py_ssize_t BITMAP_SLACK = MERGE_BITMAP_SLACK


cdef inline cnp.ndarray _empty(Py_ssize_t n):
    """A new int64 array of ``n`` (numpy's C API: a fraction of ``np.empty``'s cost)."""
    cdef cnp.npy_intp dims[1]
    dims[0] = n
    return cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)


cdef inline long long* _data(cnp.ndarray array):
    return <long long*> cnp.PyArray_DATA(array)


cdef inline bint _plain_codes(object origins):
    """Whether ``origins`` is a C-contiguous, aligned int64 array in this host's byte order
    (codes as a reading makes them)."""
    return cnp.PyArray_Check(origins) \
        and cnp.PyArray_TYPE(<cnp.ndarray> origins) == cnp.NPY_INT64 \
        and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray> origins) \
        and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray> origins) \
        and cnp.PyArray_ISALIGNED(<cnp.ndarray> origins)


cdef inline long long _int(object value) except? -1:
    """``value`` as an int64, taken as ``struct`` takes it (``__index__``: a float is a
    TypeError, not truncated; past int64, an OverflowError)."""
    return PyNumber_Index(value)


cdef class ShuffleBuffer:
    """The twin of ``zloader.chunks.ShuffleBuffer`` (its docstring says what it does): the
    buffer and the slots drawn are C arrays, and while the origins come as codes (an int64
    array per chunk, as a split's reading gives them) the pool's origins are one too."""

    cdef Py_ssize_t size, nheld, cursor, ndraws, ncodes
    cdef object rng
    cdef cnp.ndarray held_array, draws_array, codes_array, out_array
    cdef list pool
    cdef list items  # the pool's origins once one came that is not a codes array
    cdef bint track

    def __init__(self, Py_ssize_t size, rng, bint track):
        if size < 1:
            raise ValueError(f"a shuffle's buffer holds at least 1 element, got {size}")
        self.size, self.rng, self.track = size, rng, track
        self.pool = []
        self.held_array = _empty(size)
        self.nheld = 0
        self.draws_array = _empty(0)
        self.cursor = self.ndraws = 0
        self.codes_array = _empty(CHUNK_ELEMENTS)
        self.ncodes = 0
        self.out_array = _empty(CHUNK_ELEMENTS)  # (scratch: the numbers leaving, per push)
        self.items = None

    cdef void _add_origins(self, origins) except *:
        cdef Py_ssize_t end, count
        if self.items is None and isinstance(origins, np.ndarray):
            count = len(origins)
            end = self.ncodes + count
            if end > cnp.PyArray_DIM(self.codes_array, 0):
                grown = _empty(max(2 * end, CHUNK_ELEMENTS))
                memcpy(_data(grown), _data(self.codes_array), 8 * self.ncodes)
                self.codes_array = grown
            if _plain_codes(origins):  # (a plain copy)
                if count:
                    memcpy(_data(self.codes_array) + self.ncodes,
                           cnp.PyArray_DATA(<cnp.ndarray> origins), 8 * count)
            else:
                self.codes_array[self.ncodes:end] = origins
            self.ncodes = end
            return
        if self.items is None:  # (origins of another form: every one kept as a list)
            self.items = [(code,) for code in self.codes_array[:self.ncodes].tolist()]
        if isinstance(origins, np.ndarray):
            self.items += [(code,) for code in origins.tolist()]
        else:
            self.items += origins

    cdef object _pick_origins(self, long long* out, Py_ssize_t n):
        cdef Py_ssize_t k
        cdef long long* picked
        cdef long long* codes
        if not self.track:
            return None
        if self.items is None:
            array = _empty(n)
            picked, codes = _data(array), _data(self.codes_array)
            for k in range(n):
                picked[k] = codes[out[k]]
            return array
        return [self.items[out[k]] for k in range(n)]

    cdef list _pick_values(self, long long* out, Py_ssize_t n, bint release):
        cdef Py_ssize_t k
        cdef list pool = self.pool
        cdef list values = [pool[out[k]] for k in range(n)]
        if release:  # (what left is not kept alive until the compaction)
            for k in range(n):
                pool[out[k]] = None
        return values

    def push(self, list values, origins):
        """Take a chunk in; the chunk of the elements it displaced (None while the buffer
        fills)."""
        cdef Py_ssize_t first = len(self.pool), total, arrival, slot, n = 0, room
        cdef long long* held = _data(self.held_array)
        cdef long long* draws
        cdef long long* out
        self.pool += values
        total = len(self.pool)
        if self.track:
            self._add_origins(origins)
        arrival = first
        room = self.size - self.nheld
        while room > 0 and arrival < total:
            held[self.nheld] = arrival
            self.nheld += 1
            arrival += 1
            room -= 1
        chunk = None
        if arrival < total:
            if total - arrival > cnp.PyArray_DIM(self.out_array, 0):
                self.out_array = _empty(total - arrival)
            out = _data(self.out_array)
            draws = _data(self.draws_array)
            while arrival < total:
                if self.cursor == self.ndraws:
                    self.draws_array = np.ascontiguousarray(
                        self.rng.integers(0, self.size, SHUFFLE_DRAW_CHUNK), np.int64)
                    self.ndraws = cnp.PyArray_DIM(self.draws_array, 0)
                    draws = _data(self.draws_array)
                    self.cursor = 0
                slot = draws[self.cursor]
                self.cursor += 1
                out[n] = held[slot]
                held[slot] = arrival
                n += 1
                arrival += 1
            chunk = Chunk(self._pick_values(out, n, True), self._pick_origins(out, n))
        if total - self.nheld >= max(4 * self.size, CHUNK_ELEMENTS):
            self._compact()
        return chunk

    cdef void _compact(self) except *:
        cdef Py_ssize_t k, n = self.nheld
        cdef long long* held = _data(self.held_array)
        cdef long long* codes
        self.pool = self._pick_values(held, n, False)
        if self.track:
            if self.items is None:
                codes = _data(self.codes_array)
                kept = _empty(n)
                for k in range(n):
                    _data(kept)[k] = codes[held[k]]
                memcpy(codes, _data(kept), 8 * n)
                self.ncodes = n
            else:
                self.items = [self.items[held[k]] for k in range(n)]
        for k in range(n):
            held[k] = k

    def drain(self):
        """The elements still held, in random order (None: none)."""
        cdef Py_ssize_t k, n = self.nheld
        cdef long long* held = _data(self.held_array)
        cdef long long* order
        cdef long long* out
        if n == 0:
            return None
        order_array = np.ascontiguousarray(self.rng.permutation(n), np.int64)
        order = _data(order_array)
        out_array = _empty(n)
        out = _data(out_array)
        for k in range(n):
            out[k] = held[order[k]]
        self.nheld = 0
        return Chunk(self._pick_values(out, n, False), self._pick_origins(out, n))


cdef inline long long _at(const unsigned char* raw, Py_ssize_t index):
    """The ``index``-th int64 of ``raw``, in this host's byte order (as the pure function's
    ``memoryview.cast("q")`` reads it), wherever it lies (records are not 8-aligned)."""
    cdef long long value
    memcpy(&value, raw + 8 * index, 8)
    return value


def decode_origins(block, Py_ssize_t elements):
    """The twin of ``zloader.lineage.wire.decode_origins`` (its docstring says what it
    does): the head, pass keys, split ends and runs or codes read and checked in C. A block
    with per-element counts or groups (rare: batches of batches, a map that changes the
    number of elements) goes to the pure function."""
    view = memoryview(block).cast("B")
    cdef Py_ssize_t nbytes = view.nbytes
    if nbytes % 8 or nbytes < 8 * HEAD:
        raise ValueError(f"an origin block is a whole number of int64s, at least {HEAD}")
    cdef Py_buffer buffer
    PyObject_GetBuffer(view, &buffer, PyBUF_SIMPLE)
    try:
        return _decode(<const unsigned char*> buffer.buf, nbytes // 8, block, elements)
    finally:
        PyBuffer_Release(&buffer)


cdef object _decode(const unsigned char* raw, Py_ssize_t size, object block,
                    Py_ssize_t elements):
    cdef long long n = _at(raw, 0), uniform = _at(raw, 1), loose = _at(raw, 2)
    cdef long long nkeys = _at(raw, 3), nends = _at(raw, 4), nruns = _at(raw, 5)
    cdef long long nreads = _at(raw, 6), ngrouped = _at(raw, 7)
    if n != elements or uniform < -1 or loose < 0 \
            or min(nkeys, nends, nruns, nreads, ngrouped) < 0 \
            or max(nkeys, ngrouped) > size or (nruns and nreads):
        head = [_at(raw, k) for k in range(HEAD)]
        raise ValueError(f"origin block head {head} does not fit a record of {elements} "
                         "elements")
    if uniform == -1 or ngrouped:
        return _wire.decode_origins(block, elements)
    # (Python ints where a hostile head could overflow int64, as in the pure function)
    total = loose + (<object>uniform) * n
    # (the front: at most this many int64s after the head, as the pure function takes)
    cdef Py_ssize_t front = min(size - HEAD, (<object>nkeys) * (2 + MAX_KEY_LENGTH)
                                + 4 * (<object>nends) + 3 * (<object>nreads))
    cdef dict keys = {}
    cdef Py_ssize_t at = 0, k
    cdef long long pass_id, length
    cdef bint ok
    for _ in range(nkeys):
        if at + 2 <= front:
            pass_id, length = _at(raw, HEAD + at), _at(raw, HEAD + at + 1)
        else:
            pass_id, length = -1, 0
        ok = 0 <= pass_id < MAX_PASS_ID and 0 < length <= MAX_KEY_LENGTH \
            and at + 2 + length <= front and pass_id not in keys
        if ok:
            for k in range(length):
                if _at(raw, HEAD + at + 2 + k) < 0:
                    ok = False
                    break
        if not ok:
            raise ValueError("origin pass keys must be (pass id, length, key >= 0...)")
        keys[pass_id] = tuple([_at(raw, HEAD + at + 2 + k) for k in range(length)])
        at += 2 + length
    cdef long long origins_at = size - (at + HEAD)
    if origins_at != 4 * (<object>nends) + (4 * (<object>nruns) if not nreads
                                            else 3 * (<object>nreads) + total):
        raise ValueError("origin block is not as long as its head says")
    cdef list ends = []
    cdef long long split, count, crc
    cdef Py_ssize_t base = HEAD + at
    for k in range(nends):
        pass_id, split = _at(raw, base + 4 * k), _at(raw, base + 4 * k + 1)
        count, crc = _at(raw, base + 4 * k + 2), _at(raw, base + 4 * k + 3)
        ends.append((keys.get(pass_id, ()), split, count, crc))
    for end in ends:
        if not end[0] or min(end[1], end[2], end[3]) < 0 or end[1] > INDEX_MASK:
            raise ValueError("a split end names a pass the block does not, or is < 0")
    base += 4 * nends
    if nreads:
        return _with_codes(raw, base, nreads, total, keys, uniform, loose, ends)
    cdef cnp.npy_intp dims[2]
    dims[0], dims[1] = nruns, 4
    runs = cnp.PyArray_EMPTY(2, dims, cnp.NPY_INT64, 0)
    cdef long long* table = <long long*> cnp.PyArray_DATA(runs)
    cdef long long start, found = 0
    for k in range(nruns):
        pass_id, split = _at(raw, base + 4 * k), _at(raw, base + 4 * k + 1)
        start, length = _at(raw, base + 4 * k + 2), _at(raw, base + 4 * k + 3)
        if pass_id not in keys or not 0 <= split <= INDEX_MASK or start < 0 \
                or length < 1 or start > INDEX_MASK + 1 - length:
            raise ValueError("an origin run names a pass the block does not, or indices "
                             "outside [0, 2**32)")
        table[4 * k], table[4 * k + 1], table[4 * k + 2], table[4 * k + 3] = \
            pass_id, split, start, length
        found += length
    if found != total:
        raise ValueError("origin counts do not match the runs")
    return _wire.Origins(keys, uniform, None, loose, runs, ends, groups=None)


cdef object _with_codes(const unsigned char* raw, Py_ssize_t base, long long nreads,
                        Py_ssize_t total, dict keys, long long uniform, long long loose,
                        list ends):
    """The rest of :func:`decode_origins` for a block of codes: the table of reads, then
    the codes, checked as ``zloader.lineage.wire._check_codes`` checks them (the least
    and greatest code found here)."""
    cdef list reads = [_at(raw, base + k) for k in range(3 * nreads)]
    _wire._check_reads(reads, keys)
    codes = _empty(total)
    cdef long long* out = _data(codes)
    cdef long long low, high
    cdef Py_ssize_t k
    if total:
        memcpy(out, raw + 8 * (base + 3 * nreads), 8 * total)
        low = high = out[0]
        for k in range(1, total):
            if out[k] < low:
                low = out[k]
            elif out[k] > high:
                high = out[k]
        _wire._check_code_reads(reads[0::3], codes, low, high)
    return _wire.Origins(keys, uniform, None, loose, _wire._NO_RUNS, ends, reads, codes,
                         None)


# --- the worker's side: the origin block, and the record packed into a ring slot ---------

def encode_origins(origins, loose, reads, pass_keys, ends, groups=(), keys=None):
    """The twin of ``zloader.lineage.wire.encode_origins`` (its docstring says what it
    does): the blocks of a few origins (a lone record's, a batch of large elements) and of
    batches' scattered codes (a shuffle's) written in C. Any other (groups, sorted rows
    of many codes, runs of many) and any input the C path does not take as it is (an int
    past int64, a code naming no reading) go to the pure function, which gives the block
    or raises its error."""
    cdef object block = None
    if LITTLE and type(groups) in (tuple, list) and not groups and type(loose) is list \
            and type(reads) is list and type(ends) is list \
            and (keys is None or type(keys) is list):
        try:
            block = _encode(origins, <list> loose, <list> reads, pass_keys, <list> ends, keys)
        except (OverflowError, TypeError, ValueError, IndexError):
            block = None
    if block is None:
        return _wire.encode_origins(origins, loose, reads, pass_keys, ends, groups, keys)
    return block


@cython.boundscheck(True)
@cython.wraparound(True)
cdef object _encode(object origins, list loose, list reads, object pass_keys, list ends,
                    object keys):
    """The block, or None where the pure function must write it."""
    cdef Py_ssize_t n = len(origins), nloose = len(loose), total = nloose, k, count
    cdef list counts = []
    cdef long long uniform = -1
    for origin in origins:
        count = len(origin)
        counts.append(count)
        total += count
    if n and counts.count(counts[0]) == n:
        uniform = counts[0]
    if total <= SMALL_BLOCK:
        return _few(origins, loose, reads, pass_keys, ends, keys, counts, uniform, total)
    if nloose:
        return None
    for origin in origins:  # (batches' codes, as a shuffle's batches hold them)
        if type(origin) is not np.ndarray or not _plain_codes(origin) \
                or cnp.PyArray_NDIM(<cnp.ndarray> origin) != 1:
            return None
    return _scattered_codes(origins, counts, uniform, total, reads, pass_keys, ends, keys)


cdef inline void _sort(long long* values, Py_ssize_t n):
    """Insertion sort (a few values: an element's origins)."""
    cdef Py_ssize_t i, j
    cdef long long value
    for i in range(1, n):
        value = values[i]
        j = i - 1
        while j >= 0 and values[j] > value:
            values[j + 1] = values[j]
            j -= 1
        values[j + 1] = value


@cython.boundscheck(True)
@cython.wraparound(True)
cdef object _few(object origins, list loose, list reads, object pass_keys, list ends,
                 object keys, list counts, long long uniform, Py_ssize_t total):
    """A block of at most SMALL_ORIGIN_BLOCK origins, as runs (the pure function's list
    path: ``runs_of_list`` over the codes, each element's sorted when it holds several)."""
    cdef long long flat[64]  # (SMALL_ORIGIN_BLOCK is at most 64: checked at import)
    cdef long long runs[4 * 64]
    cdef Py_ssize_t nloose = len(loose), at = nloose, k, count, nruns = 0
    cdef Py_ssize_t nreads = len(reads)
    cdef bint ordered = total > 1 and (uniform != 1 or nloose > 0)
    cdef long long code, last = -2, read
    for k in range(nloose):
        flat[k] = _int(loose[k])
    if ordered:
        _sort(flat, nloose)
    for origin in origins:
        if type(origin) is np.ndarray and _plain_codes(origin) \
                and cnp.PyArray_NDIM(<cnp.ndarray> origin) == 1:
            count = cnp.PyArray_DIM(<cnp.ndarray> origin, 0)
            if at + count > total:
                return None
            if count:
                memcpy(flat + at, cnp.PyArray_DATA(<cnp.ndarray> origin), 8 * count)
        else:
            count = 0
            for item in (origin.tolist() if isinstance(origin, np.ndarray) else origin):
                if at + count >= total:
                    return None
                flat[at + count] = _int(item)
                count += 1
        if ordered:
            _sort(flat + at, count)
        at += count
    if at != total:
        return None
    for k in range(total):
        code = flat[k]
        if code < 0:
            return None
        if code == last + 1:
            runs[4 * nruns - 1] += 1
        else:
            read = code >> INDEX_BITS
            if read >= nreads:
                return None
            entry = reads[read]
            if len(entry) != 2:
                return None
            runs[4 * nruns], runs[4 * nruns + 1] = _int(entry[0]), _int(entry[1])
            runs[4 * nruns + 2], runs[4 * nruns + 3] = code & INDEX_MASK, 1
            nruns += 1
        last = code
    used = {runs[4 * k] for k in range(nruns)}
    return _block(uniform, nloose, counts, used, ends, pass_keys, keys, runs, nruns, None,
                  None, 0)


@cython.boundscheck(True)
@cython.wraparound(True)
cdef object _scattered_codes(object origins, list counts, long long uniform,
                             Py_ssize_t total, list reads, object pass_keys, list ends,
                             object keys):
    """The codes of ``origins`` (int64 arrays) as they are, with the table of the readings
    they come from (the pure function's scattered path), when they are scattered (judged
    by their first SCATTER_SAMPLE) and the readings from the oldest they name to the
    latest are few; else None."""
    cdef Py_ssize_t sample = min(total, SCATTER), seen = 0, ones = 0, k, m
    cdef const long long* data
    cdef long long low = 0x7FFFFFFFFFFFFFFF, previous = 0
    for origin in origins:
        m = cnp.PyArray_DIM(<cnp.ndarray> origin, 0)
        data = <const long long*> cnp.PyArray_DATA(<cnp.ndarray> origin)
        for k in range(m):
            if seen < sample:
                if seen and previous < 0x7FFFFFFFFFFFFFFF and data[k] == previous + 1:
                    ones += 1
                previous = data[k]
                seen += 1
            if data[k] < low:
                low = data[k]
    if 4 * (sample - 1 - ones) < sample:
        return None  # (runs: the pure function sorts and cuts them)
    if low < 0:
        return None
    cdef long long first = low >> INDEX_BITS, high = len(reads) - 1
    if first > high or high - first >= max(64, 2 * total):
        return None
    cdef list table = []
    for read in range(first, high + 1):
        entry = reads[read]
        if len(entry) != 2:
            return None
        table += [read, _int(entry[0]), _int(entry[1])]
    used = set(table[1::3])
    return _block(uniform, 0, counts, used, ends, pass_keys, keys, NULL, 0, table, origins,
                  total)


@cython.boundscheck(True)
@cython.wraparound(True)
cdef object _block(long long uniform, Py_ssize_t nloose, list counts, set used, list ends,
                   object pass_keys, object keys, long long* runs, Py_ssize_t nruns,
                   list table, object arrays, Py_ssize_t ncodes):
    """The block's bytes: the head, the counts (when not uniform), the pass keys of the
    passes ``used`` (and the ends'), the ends, then the ``nruns`` runs, or the table
    (read, pass id, split: flat) and the ``ncodes`` codes of ``arrays`` in order."""
    for end in ends:
        used.add(end[0])
    cdef list entries
    if keys is not None:
        entries = [(pass_id, keys[pass_id]) for pass_id in sorted(used)]
        for pass_id, _ in entries:
            if pass_id < 0:  # (a negative index would wrap in the pure function's too)
                raise IndexError("a pass id < 0")
    else:
        entries = [(pass_id, key) for key, pass_id in pass_keys.items() if pass_id in used]
    cdef list front = [len(counts), uniform, nloose, len(entries), len(ends), nruns,
                       len(table) // 3 if table is not None else 0, 0]
    if uniform == -1:
        front += counts
    for pass_id, key in entries:
        front.append(pass_id)
        front.append(len(key))
        front += key
    for end in ends:
        front += end
    if table is not None:
        front += table
    cdef Py_ssize_t nfront = len(front), k, at, m
    block = PyBytes_FromStringAndSize(NULL, 8 * (nfront + 4 * nruns + ncodes))
    cdef long long* out = <long long*> PyBytes_AS_STRING(block)
    for k in range(nfront):
        out[k] = _int(front[k])
    if nruns:
        memcpy(out + nfront, runs, 32 * nruns)
    if ncodes:
        at = nfront
        for array in arrays:
            m = cnp.PyArray_DIM(<cnp.ndarray> array, 0)
            if m:
                memcpy(out + at, cnp.PyArray_DATA(<cnp.ndarray> array), 8 * m)
            at += m
    return block


if SMALL_ORIGIN_BLOCK > 64:
    raise ImportError("SMALL_ORIGIN_BLOCK is past the compiled encoder's 64 codes")


def pack_into(buffers, block, sizes=None):
    """The twin of ``zloader.transport.records.pack_into`` (its docstring says what it
    does): the header and the copies in C, into a bytearray or a one-dimensional byte
    view. Anything else (another block, a gathered buffer, a size that is not an int or
    not its buffer's, a block too small) goes to the pure function, which packs it or
    raises its error."""
    if sizes is None:
        sizes = _records.sizes_of(buffers)
    if not LITTLE or type(buffers) not in (list, tuple) or type(sizes) not in (list, tuple) \
            or not (type(block) is bytearray or (
                type(block) is memoryview and block.format == "B" and block.ndim == 1)):
        return _records.pack_into(buffers, block, sizes)  # (an iterator: not consumed here)
    cdef list held, lengths
    try:  # (each read once: what is checked is what is copied)
        held, lengths = list(buffers), [_int(size) for size in sizes]
    except (TypeError, OverflowError, ValueError):
        return _records.pack_into(buffers, block, sizes)
    cdef Py_ssize_t count = len(lengths), k, offset, size, need
    if len(held) != count:
        return _records.pack_into(buffers, block, sizes)
    offset = (8 + 8 * count + ALIGN - 1) & ~(ALIGN - 1)
    need = offset
    for k in range(count):
        if not 0 <= lengths[k] < (1 << 48) or type(held[k]) is _codec.Gather:
            return _records.pack_into(buffers, block, sizes)
        need += (<Py_ssize_t> lengths[k] + ALIGN - 1) & ~(ALIGN - 1)
    cdef Py_buffer target, source
    try:
        PyObject_GetBuffer(block, &target, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
    except (TypeError, BufferError, ValueError):  # (read-only, not contiguous: its error)
        return _records.pack_into(buffers, block, sizes)
    cdef char* out = <char*> target.buf
    cdef unsigned int head[2]
    cdef bint pure = target.len < need  # (then, and below: once the block is let go of)
    try:
        if not pure:
            head[0], head[1] = count, 0
            memcpy(out, head, 8)
            for k in range(count):
                (<unsigned long long*> (out + 8))[k] = <Py_ssize_t> lengths[k]
        for k in range(count if not pure else 0):
            size = lengths[k]
            if size:
                try:
                    PyObject_GetBuffer(held[k], &source, PyBUF_C_CONTIGUOUS)
                except (TypeError, BufferError, ValueError):
                    pure = True
                    break
                try:
                    if source.len != size or offset + size > target.len:
                        pure = True
                        break
                    memcpy(out + offset, source.buf, size)
                finally:
                    PyBuffer_Release(&source)
            offset += (size + ALIGN - 1) & ~(ALIGN - 1)
    finally:
        PyBuffer_Release(&target)
    if pure:  # (a bytearray block may be resized by it: not while this held its buffer)
        return _records.pack_into(buffers, block, sizes)
    return offset


# --- the consumer's side: a record's buffers ----------------------------------------------

def unpack(block):
    """The twin of ``zloader.transport.records.unpack`` (its docstring says what it does):
    the header read and every size checked in C, the buffers the same views of ``block``.
    A view of another format than bytes goes to the pure function."""
    view = block if isinstance(block, memoryview) else memoryview(block).cast("B")
    if not LITTLE or view.format != "B" or view.ndim != 1 or not view.c_contiguous:
        return _records.unpack(block)
    cdef Py_buffer buffer
    PyObject_GetBuffer(view, &buffer, PyBUF_SIMPLE)
    cdef Py_ssize_t nbytes = buffer.len, k, offset
    cdef const unsigned char* raw = <const unsigned char*> buffer.buf
    cdef unsigned int count
    cdef unsigned long long size
    cdef list out = []
    try:
        if nbytes < 8:
            raise CodecError(f"record of {nbytes} bytes is shorter than its header")
        memcpy(&count, raw, 4)
        if count > MAX_BUFFERS or 8 + 8 * <Py_ssize_t> count > nbytes:
            raise CodecError(f"record claims {count} buffers, more than its {nbytes} "
                             "bytes hold")
        offset = (8 + 8 * count + ALIGN - 1) & ~(ALIGN - 1)
        for k in range(count):
            memcpy(&size, raw + 8 + 8 * k, 8)
            if offset > nbytes or size > <unsigned long long> (nbytes - offset):
                raise CodecError(f"record buffer of {size} bytes at {offset} runs past its "
                                 f"{nbytes} bytes")
            out.append(view[offset:offset + <Py_ssize_t> size])
            offset += (<Py_ssize_t> size + ALIGN - 1) & ~(ALIGN - 1)
    finally:
        PyBuffer_Release(&buffer)
    return out


cdef extern from *:
    """
    static inline void zl_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    """
    void zl_fence() nogil


def fence():
    """A full memory barrier (sequentially consistent), between a write to shared memory
    and a read of another process's word there: the pure twin is
    ``zloader._native._fence``."""
    zl_fence()


cdef extern from *:
    """
    static inline int zl_ctz(unsigned long long x) { return __builtin_ctzll(x); }
    """
    int zl_ctz(unsigned long long x) nogil


cdef inline Py_ssize_t _next(const unsigned long long* bits, Py_ssize_t nbits,
                             Py_ssize_t at, unsigned long long flip) noexcept nogil:
    """The first bit at or after ``at`` that is set (``flip`` 0) or clear (``flip`` all
    ones); ``nbits`` if none."""
    cdef Py_ssize_t word = at >> 6
    cdef Py_ssize_t words = (nbits + 63) >> 6
    cdef unsigned long long x
    if at >= nbits:
        return nbits
    x = (bits[word] ^ flip) & (~0ULL << (at & 63))
    while x == 0:
        word += 1
        if word >= words:
            return nbits
        x = bits[word] ^ flip
    at = (word << 6) + zl_ctz(x)
    return at if at < nbits else nbits


def merge_indices(list starts, list ends, list arrays):
    """The ranges ``starts``/``ends`` (sorted, disjoint, not touching) with the indices
    of ``arrays`` added (int64 codes of one split reading, in any order, repeats allowed:
    their low INDEX_BITS bits are the indices): the new ``(starts, ends, count)``, lists
    and the number of indices held; None where the indices spread over more than
    MERGE_BITMAP_FACTOR times their number (the pure twin then sorts them). The indices are
    marked in a bitmap of their span, whose runs are merged with the ranges held."""
    cdef Py_ssize_t n = 0, nbits, i, k, held = len(starts), at = 0, stop = 0
    cdef unsigned long long lo = INDEX_MASK, hi = 0, v
    cdef unsigned long long* bits
    cdef const long long* codes
    cdef object array
    cdef long long s = 0, e = 0, cur_s = 0, cur_e = 0, count = 0
    cdef bint open_run = False, held_first
    cdef list out_s = [], out_e = []
    if INDEX_BITS != 32 or len(ends) != held:
        return None
    for array in arrays:
        if not _plain_codes(array):
            return None
        codes = _data(<cnp.ndarray> array)
        k = cnp.PyArray_SIZE(<cnp.ndarray> array)
        n += k
        for i in range(k):
            v = <unsigned long long> codes[i] & <unsigned long long> INDEX_MASK
            if v < lo:
                lo = v
            if v > hi:
                hi = v
    if n == 0:
        return None
    nbits = <Py_ssize_t> (hi - lo) + 1
    if nbits > BITMAP_FACTOR * n + BITMAP_SLACK:
        return None
    bits = <unsigned long long*> calloc((nbits + 63) >> 6, 8)
    if bits == NULL:
        raise MemoryError()
    try:
        for array in arrays:
            codes = _data(<cnp.ndarray> array)
            for i in range(cnp.PyArray_SIZE(<cnp.ndarray> array)):
                v = (<unsigned long long> codes[i] & <unsigned long long> INDEX_MASK) - lo
                bits[v >> 6] |= 1ULL << (v & 63)
        i = 0
        at = _next(bits, nbits, 0, 0)
        if at < nbits:
            stop = _next(bits, nbits, at, ~0ULL)
        while at < nbits or i < held:
            # the next range by its start: the bitmap's next run, or the next one held
            if i < held:
                s, e = starts[i], ends[i]
            held_first = i < held and (at >= nbits or s < <long long> (at + lo))
            if held_first:
                i += 1
            else:
                s, e = <long long> (at + lo), <long long> (stop + lo)
                at = _next(bits, nbits, stop, 0)
                if at < nbits:
                    stop = _next(bits, nbits, at, ~0ULL)
            if open_run and s <= cur_e:
                if e > cur_e:
                    cur_e = e
                continue
            if open_run:
                out_s.append(cur_s)
                out_e.append(cur_e)
                count += cur_e - cur_s
            cur_s, cur_e, open_run = s, e, True
        out_s.append(cur_s)
        out_e.append(cur_e)
        count += cur_e - cur_s
    finally:
        free(bits)
    return out_s, out_e, count


cdef object _Data = _messages.Data
cdef unsigned int _PLAIN_FLAGS = (_messages._FULL | _messages._SHARED | _messages._LAGGED
                                  | _messages._ROUND | _messages._ORIGINS | _messages._AFTER
                                  | _messages._PART | _messages._FIRST)
cdef unsigned int _OPTIONAL[5]
_OPTIONAL[:] = [_messages._LAGGED, _messages._ROUND, _messages._AFTER, _messages._PART,
                _messages._FIRST]
cdef Py_ssize_t FRAME = _notice.FRAME_HEAD.size
cdef Py_ssize_t FRAME_ALIGN = _notice.FRAME_ALIGN
cdef Py_ssize_t DATA_HEAD = _messages._DATA_HEAD.size
cdef unsigned long long MAX_PARTS = MAX_MIX_INPUTS


def unframe(block):
    """The DATA body and the buffers of a framed ring record, as
    ``zloader.transport.messages.unframe`` gives them: the body read here when it names
    no place of its own (no ring, segment or frame) and is whole, the buffers by
    :func:`unpack`; any other block goes to the pure function, which reads it or raises
    its error."""
    cdef Py_buffer view
    cdef const unsigned char* raw
    cdef const unsigned char* body
    cdef Py_ssize_t size, start, at, k
    cdef unsigned int size32, flags
    cdef unsigned short flags16
    cdef unsigned long long epoch, count, skipped, value
    cdef list found = [None] * 5
    if not LITTLE:
        return _messages.unframe(block)
    try:
        PyObject_GetBuffer(block, &view, PyBUF_SIMPLE)
    except (TypeError, ValueError, BufferError):  # (not one contiguous block of bytes)
        return _messages.unframe(block)
    try:
        raw = <const unsigned char*> view.buf
        if view.len < FRAME:
            return _messages.unframe(block)
        memcpy(&size32, raw, 4)
        size = size32
        start = (FRAME + size + FRAME_ALIGN - 1) // FRAME_ALIGN * FRAME_ALIGN
        if start > view.len or size < DATA_HEAD:
            return _messages.unframe(block)
        body = raw + FRAME
        memcpy(&epoch, body, 8)
        memcpy(&count, body + 8, 8)
        memcpy(&skipped, body + 16, 8)
        memcpy(&flags16, body + 24, 2)
        flags = flags16
        if flags & ~_PLAIN_FLAGS:
            return _messages.unframe(block)
        at = DATA_HEAD
        for k in range(5):
            if flags & _OPTIONAL[k]:
                if at + 8 > size:
                    return _messages.unframe(block)
                memcpy(&value, body + at, 8)
                found[k] = value
                at += 8
        if at != size or (found[3] is not None and found[3] >= MAX_PARTS):
            return _messages.unframe(block)
    finally:
        PyBuffer_Release(&view)
    data = _Data.checked({
        "epoch": epoch, "count": count, "skipped": skipped, "ring": None, "segment": None,
        "full": bool(flags & _messages._FULL), "shared": bool(flags & _messages._SHARED),
        "lagged": found[0], "round": found[1], "origins": bool(flags & _messages._ORIGINS),
        "framed": False, "after": found[2], "part": found[3], "first": found[4]})
    return data, unpack(memoryview(block[start:]))


# --- the packer's writer of a list's elements in marshal format 2 (zloader/packed.py) -----
# Borrowed pointers throughout: a reference taken writes the object's count, and in a forked
# packer each such write copies the object's page (the dataset's pages, one by one).

cdef extern from "Python.h":
    ctypedef struct PyTypeObject:
        pass
    PyTypeObject _INT "PyLong_Type"
    PyTypeObject _FLOAT "PyFloat_Type"
    PyTypeObject _COMPLEX "PyComplex_Type"
    PyTypeObject _TEXT "PyUnicode_Type"
    PyTypeObject _TUPLE "PyTuple_Type"
    PyTypeObject _DICT "PyDict_Type"
    PyObject* _NONE "Py_None"
    PyObject* _TRUE "Py_True"
    PyObject* _FALSE "Py_False"
    PyTypeObject* _type "Py_TYPE"(PyObject* value)
    Py_ssize_t _length "Py_SIZE"(PyObject* value)
    long long _as_long "PyLong_AsLongLongAndOverflow"(PyObject* value, int* overflow) except? -1
    double _as_double "PyFloat_AS_DOUBLE"(PyObject* value)
    double _real "PyComplex_RealAsDouble"(PyObject* value)
    double _imag "PyComplex_ImagAsDouble"(PyObject* value)
    Py_ssize_t _tuple_size "PyTuple_GET_SIZE"(PyObject* value)
    PyObject* _tuple_item "PyTuple_GET_ITEM"(PyObject* value, Py_ssize_t k)
    PyObject* _list_item "PyList_GET_ITEM"(PyObject* value, Py_ssize_t k)
    bint _dict_next "PyDict_Next"(PyObject* value, Py_ssize_t* at, PyObject** key,
                                  PyObject** item)
    Py_ssize_t _text_length "PyUnicode_GetLength"(PyObject* text)  # (readies a legacy one)
    void PyErr_Clear()
    int _text_kind "PyUnicode_KIND"(PyObject* text)
    void* _text_data "PyUnicode_DATA"(PyObject* text)
    bint _text_ascii "PyUnicode_IS_ASCII"(PyObject* text)


cdef object _dumps = None  # marshal.dumps: an int past int64 is written as it writes it


cdef Py_ssize_t _utf8_size(PyObject* text) noexcept:
    """The bytes of ``text`` (an exact str) in UTF-8, lone surrogates as three bytes each
    (``surrogatepass``, as marshal writes them); -1 past a 4-byte length, or for a
    legacy string that could not be made ready."""
    cdef Py_ssize_t n = _text_length(text), size = n, k
    cdef int kind
    cdef void* data
    cdef unsigned int c
    if n < 0:
        PyErr_Clear()
        return -1
    kind, data = _text_kind(text), _text_data(text)
    if not _text_ascii(text):
        size = 0
        for k in range(n):
            c = PyUnicode_READ(kind, data, k)
            size += 1 if c < 0x80 else 2 if c < 0x800 else 3 if c < 0x10000 else 4
    return size if size <= 0x7FFFFFFF else -1


cdef inline Py_ssize_t _digits(unsigned long long magnitude) noexcept:
    """How many 15-bit digits marshal writes for an int of this magnitude (not 0)."""
    cdef Py_ssize_t count = 0
    while magnitude:
        magnitude >>= 15
        count += 1
    return count


cdef inline unsigned long long _magnitude(long long value) noexcept:
    return <unsigned long long> value if value >= 0 else \
        (<unsigned long long> (-(value + 1))) + 1


cdef Py_ssize_t _size(PyObject* value, int depth, int limit, int* deepest,
                      bint* dicts) except -2:
    """The bytes marshal format 2 writes for ``value``, or -1 where ``marshal_into``
    refuses it (see its twin)."""
    cdef int overflow = 0
    cdef long long number
    cdef Py_ssize_t size, part, k
    cdef PyObject* key
    cdef PyObject* item
    cdef PyTypeObject* kind = _type(value)
    if value == _NONE or value == _TRUE or value == _FALSE:
        return 1
    if kind == &_INT:
        number = _as_long(value, &overflow)
        if overflow:
            return len(_dumps(<object> value, 2))
        if -0x80000000 <= number <= 0x7FFFFFFF:
            return 5
        return 5 + 2 * _digits(_magnitude(number))
    if kind == &_FLOAT:
        return 9
    if kind == &_COMPLEX:
        return 17
    if kind == &_TEXT:
        size = _utf8_size(value)
        return 5 + size if size >= 0 else -1
    if kind != &_TUPLE and kind != &_DICT:
        return -1  # (bytes too: marshal writes any buffer so, and the checks by type decide)
    if depth >= limit:
        return -1
    if depth + 1 > deepest[0]:
        deepest[0] = depth + 1
    if kind == &_TUPLE:
        size = 5
        for k in range(_tuple_size(value)):
            part = _size(_tuple_item(value, k), depth + 1, limit, deepest, dicts)
            if part < 0:
                return -1
            size += part
        return size
    dicts[0] = True
    size = 2  # (its code, and the null code that ends it)
    k = 0
    while _dict_next(value, &k, &key, &item):
        part = _utf8_size(key) if _type(key) == &_TEXT else -1
        if part < 0:
            return -1
        size += 5 + part
        part = _size(item, depth + 1, limit, deepest, dicts)
        if part < 0:
            return -1
        size += part
    return size


cdef inline Py_ssize_t _code(char* out, Py_ssize_t at, Py_ssize_t end, char code,
                             Py_ssize_t size, bint sized) noexcept:
    """Write a type code (and, ``sized``, a 4-byte little-endian ``size``) at ``at``: where
    they end, or -1 past ``end`` (or for ``at`` -1)."""
    cdef int word = <int> size
    if at < 0 or at + 1 + 4 * sized > end:
        return -1
    out[at] = code
    if sized:
        memcpy(out + at + 1, &word, 4)
    return at + 1 + 4 * sized


cdef Py_ssize_t _write_text(PyObject* text, char* out, Py_ssize_t at,
                            Py_ssize_t end) noexcept:
    """``text`` (an exact str) as marshal format 2 writes it: ``u``, its UTF-8 length, its
    UTF-8 (see :func:`_utf8_size`)."""
    cdef Py_ssize_t size = _utf8_size(text), n = _text_length(text) if size >= 0 else 0, k
    cdef int kind = _text_kind(text)
    cdef void* data = _text_data(text)
    cdef unsigned int c
    cdef unsigned char* to
    at = _code(out, at, end, b'u', size, True)
    if size < 0 or at < 0 or at + size > end:
        return -1
    if _text_ascii(text):
        memcpy(out + at, data, n)
        return at + n
    to = <unsigned char*> out + at
    for k in range(n):
        c = PyUnicode_READ(kind, data, k)
        if c < 0x80:
            to[0] = c
            to += 1
        elif c < 0x800:
            to[0] = 0xC0 | (c >> 6)
            to[1] = 0x80 | (c & 0x3F)
            to += 2
        elif c < 0x10000:
            to[0] = 0xE0 | (c >> 12)
            to[1] = 0x80 | ((c >> 6) & 0x3F)
            to[2] = 0x80 | (c & 0x3F)
            to += 3
        else:
            to[0] = 0xF0 | (c >> 18)
            to[1] = 0x80 | ((c >> 12) & 0x3F)
            to[2] = 0x80 | ((c >> 6) & 0x3F)
            to[3] = 0x80 | (c & 0x3F)
            to += 4
    return at + size


cdef Py_ssize_t _write_int(PyObject* value, char* out, Py_ssize_t at,
                           Py_ssize_t end) except -2:
    """An exact int as marshal format 2 writes it: ``i`` and 4 bytes within int32, else
    ``l``, its count of 15-bit digits (negative for a negative int) and the digits."""
    cdef int overflow = 0, word
    cdef long long number = _as_long(value, &overflow)
    cdef unsigned long long magnitude
    cdef unsigned short digit
    cdef Py_ssize_t count, k
    if overflow:
        written = _dumps(<object> value, 2)
        count = len(written)
        if at + count > end:
            return -1
        memcpy(out + at, PyBytes_AS_STRING(written), count)
        return at + count
    if -0x80000000 <= number <= 0x7FFFFFFF:
        at = _code(out, at, end, b'i', 0, False)
        if at < 0 or at + 4 > end:
            return -1
        word = <int> number
        memcpy(out + at, &word, 4)
        return at + 4
    magnitude = _magnitude(number)
    count = _digits(magnitude)
    at = _code(out, at, end, b'l', count if number > 0 else -count, True)
    if at < 0 or at + 2 * count > end:
        return -1
    for k in range(count):
        digit = magnitude & 0x7FFF
        memcpy(out + at + 2 * k, &digit, 2)
        magnitude >>= 15
    return at + 2 * count


cdef Py_ssize_t _write(PyObject* value, char* out, Py_ssize_t at, Py_ssize_t end,
                       int depth, int limit, int* deepest, bint* dicts) except -2:
    """Write ``value`` at ``at`` as marshal format 2 does: where it ends, or -1 where it
    no longer fits what :func:`_size` found (the list changed in between). ``deepest`` and
    ``dicts`` as :func:`_size` finds them, for what is written."""
    cdef double number
    cdef Py_ssize_t k, n
    cdef PyObject* key
    cdef PyObject* item
    cdef PyTypeObject* kind = _type(value)
    if value == _NONE or value == _TRUE or value == _FALSE:
        return _code(out, at, end, b'N' if value == _NONE else b'T' if value == _TRUE
                     else b'F', 0, False)
    if kind == &_INT:
        return _write_int(value, out, at, end)
    if kind == &_FLOAT or kind == &_COMPLEX:
        n = 8 if kind == &_FLOAT else 16
        at = _code(out, at, end, b'g' if n == 8 else b'y', 0, False)
        if at < 0 or at + n > end:
            return -1
        number = _as_double(value) if n == 8 else _real(value)
        memcpy(out + at, &number, 8)
        if n == 16:
            number = _imag(value)
            memcpy(out + at + 8, &number, 8)
        return at + n
    if kind == &_TEXT:
        return _write_text(value, out, at, end)
    if depth >= limit or (kind != &_TUPLE and kind != &_DICT):
        return -1
    if depth + 1 > deepest[0]:
        deepest[0] = depth + 1
    if kind == &_TUPLE:
        n = _tuple_size(value)
        at = _code(out, at, end, b'(', n, True)
        for k in range(n):
            at = _write(_tuple_item(value, k), out, at, end, depth + 1, limit, deepest,
                        dicts) if at >= 0 else -1
        return at
    dicts[0] = True
    at = _code(out, at, end, b'{', 0, False)
    k = 0
    while at >= 0 and _dict_next(value, &k, &key, &item):
        at = _write_text(key, out, at, end) if _type(key) == &_TEXT else -1
        at = _write(item, out, at, end, depth + 1, limit, deepest, dicts) if at >= 0 else -1
    return _code(out, at, end, b'0', 0, False)


cdef inline PyObject* _element(PyObject* values, bint is_list, Py_ssize_t k) noexcept:
    return _list_item(values, k) if is_list else _tuple_item(values, k)


def marshal_into(values, allocate, int limit):
    """The twin of ``zloader.packed.marshal_into`` (its docstring says what it does): the
    sizes found, then the elements written into the memory, in C (no bytes of the whole
    list made, no str encoded into a new object, and no reference taken to an element)."""
    global _dumps
    if not LITTLE:
        from zloader import packed  # (it imports this module's picker: not at import)

        return packed.marshal_into(values, allocate, limit)
    if _dumps is None:
        import marshal

        _dumps = marshal.dumps
    cdef PyObject* items = <PyObject*> values
    cdef bint is_list = type(values) is list
    if not is_list and type(values) is not tuple:
        return None
    cdef Py_ssize_t count = len(values), k, at = 0, size, table = 8 * (count + 1), end
    cdef int deepest = 0
    cdef bint dicts = False
    cdef cnp.ndarray offsets = _empty(count + 1)
    cdef long long* out = _data(offsets)
    for k in range(count):
        if _length(items) != count:  # (an int past int64 calls marshal: a finalizer may run)
            return None
        out[k] = at
        size = _size(_element(items, is_list, k), 0, limit, &deepest, &dicts)
        if size < 0:
            return None
        at += size
    out[count] = at
    memory = allocate(table + at)
    cdef Py_buffer buffer
    PyObject_GetBuffer(memory, &buffer, PyBUF_WRITABLE)
    cdef char* raw = <char*> buffer.buf
    end = buffer.len
    try:
        if end < table + out[count] or len(values) != count:
            return None  # (the list changed while the memory was made)
        memcpy(raw, out, table)
        at = table
        deepest, dicts = 0, False  # (of what is written: allocate ran Python code)
        for k in range(count):
            if at != table + out[k] or _length(items) != count:
                return None
            at = _write(_element(items, is_list, k), raw, at, end, 0, limit, &deepest, &dicts)
            if at < 0:
                return None
        if at != table + out[count]:
            return None
    finally:
        PyBuffer_Release(&buffer)
    return memory, offsets, deepest, dicts
