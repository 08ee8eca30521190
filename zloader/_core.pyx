# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""zloader's compiled core: C twins of pure-Python kernels of the per-record path.

Each class or function here gives what its twin gives, byte for byte (tests/test_native.py
compares them over generated inputs); zloader/_native.py picks which one runs. Only the
hot loops are here: everything else stays in the modules that own it.
"""

import numpy as np

from zloader._defaults import CHUNK_ELEMENTS, SHUFFLE_DRAW_CHUNK
from zloader.chunks import Chunk

__all__ = ["ShuffleBuffer"]


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
