# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""zloader's compiled core: C twins of pure-Python kernels of the per-record path.

Each class or function here gives what its twin gives, byte for byte (tests/test_native.py
compares them over generated inputs); zloader/_native.py picks which one runs. Only the
hot loops are here: everything else stays in the modules that own it.
"""

from libc.string cimport memcpy

import numpy as np

from zloader._defaults import CHUNK_ELEMENTS, SHUFFLE_DRAW_CHUNK
from zloader.chunks import Chunk
from zloader.lineage import tags as _tags
from zloader.lineage import wire as _wire

__all__ = ["ShuffleBuffer", "decode_origins"]

cdef long long INDEX_BITS = _tags.INDEX_BITS
cdef long long INDEX_MASK = _tags.INDEX_MASK
cdef long long MAX_PASS_ID = _tags.MAX_PASS_ID
cdef long long MAX_KEY_LENGTH = _tags.MAX_KEY_LENGTH
cdef Py_ssize_t HEAD = _wire._HEAD


cdef class ShuffleBuffer:
    """The twin of ``zloader.chunks.ShuffleBuffer`` (its docstring says what it does): the
    buffer and the slots drawn are C arrays, and while the origins come as codes (an int64
    array per chunk, as a split's reading gives them) the pool's origins are one too."""

    cdef Py_ssize_t size, nheld, cursor
    cdef object rng, held_array, draws_array, codes_array
    cdef long long[::1] held
    cdef long long[::1] draws
    cdef long long[::1] codes
    cdef Py_ssize_t ncodes
    cdef list pool
    cdef list items  # the pool's origins once one came that is not a codes array
    cdef bint track

    def __init__(self, Py_ssize_t size, rng, bint track):
        if size < 1:
            raise ValueError(f"a shuffle's buffer holds at least 1 element, got {size}")
        self.size, self.rng, self.track = size, rng, track
        self.pool = []
        self.held_array = np.empty(size, np.int64)
        self.held = self.held_array
        self.nheld = 0
        self.draws_array = np.empty(0, np.int64)
        self.draws = self.draws_array
        self.cursor = 0
        self.codes_array = np.empty(CHUNK_ELEMENTS, np.int64)
        self.codes = self.codes_array
        self.ncodes = 0
        self.items = None

    cdef void _add_origins(self, origins) except *:
        cdef Py_ssize_t end
        if self.items is None and type(origins) is np.ndarray:
            end = self.ncodes + len(origins)
            if end > self.codes.shape[0]:
                grown = np.empty(max(2 * end, CHUNK_ELEMENTS), np.int64)
                grown[:self.ncodes] = self.codes_array[:self.ncodes]
                self.codes_array = grown
                self.codes = grown
            self.codes_array[self.ncodes:end] = origins
            self.ncodes = end
            return
        if self.items is None:  # (origins of another form: every one kept as a list)
            self.items = [(code,) for code in self.codes_array[:self.ncodes].tolist()]
        if type(origins) is np.ndarray:
            self.items += [(code,) for code in origins.tolist()]
        else:
            self.items += origins

    cdef object _pick_origins(self, long long[::1] out, Py_ssize_t n):
        cdef Py_ssize_t k
        cdef long long[::1] picked_codes
        if not self.track:
            return None
        if self.items is None:
            array = np.empty(n, np.int64)
            picked_codes = array
            for k in range(n):
                picked_codes[k] = self.codes[out[k]]
            return array
        return [self.items[out[k]] for k in range(n)]

    cdef list _pick_values(self, long long[::1] out, Py_ssize_t n, bint release):
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
        cdef Py_ssize_t first = len(self.pool), total, arrival, slot, n = 0, room, k
        cdef long long[::1] out
        self.pool += values
        total = len(self.pool)
        if self.track:
            self._add_origins(origins)
        arrival = first
        room = self.size - self.nheld
        while room > 0 and arrival < total:
            self.held[self.nheld] = arrival
            self.nheld += 1
            arrival += 1
            room -= 1
        chunk = None
        if arrival < total:
            out_array = np.empty(total - arrival, np.int64)
            out = out_array
            while arrival < total:
                if self.cursor == self.draws.shape[0]:
                    self.draws_array = self.rng.integers(0, self.size, SHUFFLE_DRAW_CHUNK)
                    self.draws = self.draws_array
                    self.cursor = 0
                slot = self.draws[self.cursor]
                self.cursor += 1
                out[n] = self.held[slot]
                self.held[slot] = arrival
                n += 1
                arrival += 1
            chunk = Chunk(self._pick_values(out, n, True), self._pick_origins(out, n))
        if total - self.nheld >= max(4 * self.size, CHUNK_ELEMENTS):
            self._compact()
        return chunk

    cdef void _compact(self) except *:
        cdef Py_ssize_t k, n = self.nheld
        self.pool = self._pick_values(self.held, n, False)
        if self.track:
            if self.items is None:
                self.codes_array[:n] = self.codes_array[self.held_array[:n]]
                self.ncodes = n
            else:
                self.items = [self.items[self.held[k]] for k in range(n)]
        for k in range(n):
            self.held[k] = k

    def drain(self):
        """The elements still held, in random order (None: none)."""
        cdef Py_ssize_t k, n = self.nheld
        cdef long long[::1] order, out
        if n == 0:
            return None
        order_array = np.ascontiguousarray(self.rng.permutation(n), np.int64)
        order = order_array
        out_array = np.empty(n, np.int64)
        out = out_array
        for k in range(n):
            out[k] = self.held[order[k]]
        self.nheld = 0
        return Chunk(self._pick_values(out, n, False), self._pick_origins(out, n))


cdef inline long long _at(const unsigned char[::1] raw, Py_ssize_t index):
    """The ``index``-th little-endian int64 of ``raw`` (this module is built for
    little-endian hosts only: x86-64 and aarch64)."""
    cdef long long value
    memcpy(&value, &raw[8 * index], 8)
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
    cdef const unsigned char[::1] raw = view
    cdef Py_ssize_t size = nbytes // 8
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
    cdef long long pass_id, length, value
    cdef bint ok
    for _ in range(nkeys):
        if at + 2 <= front:
            pass_id, length = _at(raw, HEAD + at), _at(raw, HEAD + at + 2 - 1)
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
    runs = np.empty((nruns, 4), np.int64)
    cdef long long[:, ::1] table = runs
    cdef long long start, found = 0
    for k in range(nruns):
        pass_id, split = _at(raw, base + 4 * k), _at(raw, base + 4 * k + 1)
        start, length = _at(raw, base + 4 * k + 2), _at(raw, base + 4 * k + 3)
        if pass_id not in keys or not 0 <= split <= INDEX_MASK or start < 0 \
                or length < 1 or start > INDEX_MASK + 1 - length:
            raise ValueError("an origin run names a pass the block does not, or indices "
                             "outside [0, 2**32)")
        table[k, 0], table[k, 1], table[k, 2], table[k, 3] = pass_id, split, start, length
        found += length
    if found != total:
        raise ValueError("origin counts do not match the runs")
    return _wire.Origins(keys, uniform, None, loose, runs, ends, groups=None)


cdef object _with_codes(const unsigned char[::1] raw, Py_ssize_t base, long long nreads,
                        Py_ssize_t total, dict keys, long long uniform, long long loose,
                        list ends):
    """The rest of :func:`decode_origins` for a block of codes: the table of reads, then
    the codes, checked as ``zloader.lineage.wire._check_codes`` checks them."""
    cdef list reads = [_at(raw, base + k) for k in range(3 * nreads)]
    codes = np.empty(total, np.int64)
    cdef long long[::1] out = codes
    cdef Py_ssize_t k
    if total:
        memcpy(&out[0], &raw[8 * (base + 3 * nreads)], 8 * total)
    ids = reads[0::3]
    if len(ids) == 1:
        bad = not _wire._read_ok(reads[0], reads[1], reads[2], keys)
    else:
        bad = len(set(ids)) != len(ids) or not all(
            map(_wire._read_ok, ids, reads[1::3], reads[2::3], [keys] * len(ids)))
    if bad:
        raise ValueError("an origin read must be (read, pass id, split), distinct reads "
                         "< 2**31 of passes the block names")
    cdef long long low, high, first = min(ids), last = max(ids)
    if total:
        low = high = out[0]
        for k in range(1, total):
            if out[k] < low:
                low = out[k]
            elif out[k] > high:
                high = out[k]
        if low < 0 or not (low >> INDEX_BITS >= first and high >> INDEX_BITS <= last) or (
                last - first + 1 != len(ids)
                and not np.isin(codes >> INDEX_BITS, ids).all()):
            raise ValueError("an origin code names a read the block's table does not")
    return _wire.Origins(keys, uniform, None, loose, _wire._NO_RUNS, ends, reads, codes,
                         None)
