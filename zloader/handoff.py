"""A Loader's large lists packed after its workers were forked, and handed to them.

Packing a million-element list takes a few hundred milliseconds (zloader/packed.py);
done before the fork, it would delay every first batch by as much, and done on a thread
of the trainer it would hold the interpreter's lock against the thread that receives the
batches. Instead the Loader forks its workers at once, with the lists as they are, and
one more process, the packer (:meth:`Handoff.fork_packer`), packs the lists while the
workers start and exits. The trainer's thread does not copy its page tables a further
time: the forker forks the packer after the first worker (zloader/_process.py), and a
Loader that forks its one or two workers itself has the first of them fork it (that
worker waits for its Loader to fork the other anyway). Each list goes into a ``memfd``
made before the forks (so each worker holds it already, and ``/dev/shm``'s size does not
limit it), which the packer sizes and fills; a small table in anonymous shared memory,
also made before the forks, says when each is ready (or was left unpacked). The compiled
core's writer (``_core.marshal_into``) reads the elements without taking a reference to
any, so the packer copies none of their pages; the pure path's checks by type take
references, and for the second or so it runs that packer holds its own copy of the pages
of the lists' objects (their reference counts), freed when it exits.

A worker looks at the table before each split and each batch it is handed (:func:`poll`:
one attribute read once nothing is pending) and puts the packed view in place of each
list that is ready, as ``packed.install`` does at the fork. Its first
``HANDOFF_UNPACKED_READS`` splits or batches read the inherited lists, copying the pages
of the elements they touch (their reference counts: the first batches' worth); after
them it waits for the packer, so that a fast pipeline does not copy the dataset while
the packer runs. A packer that died, or takes longer than ``HANDOFF_WAIT_SECONDS``,
leaves the workers on the lists (with a warning).

A list the worker wrote into before its packed copy was ready (a memo cache) is kept as
it is: the worker compares a digest of the list's item pointers with the one made before
the fork (:func:`_digest`: read without touching the elements, and without a copy of the
pointers on the trainer's path), on CPython builds whose list layout :func:`available`
recognizes (on others the Loader packs before the fork).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from typing import Any

import numpy as np

from zloader import packed
from zloader._defaults import HANDOFF_UNPACKED_READS, HANDOFF_WAIT_SECONDS, PACKER_NICE
from zloader.transport.shm import alive

__all__ = ["FDS_LOCK", "Handoff", "available", "forked", "poll", "reap"]

log = logging.getLogger("zloader.packed")

_PENDING, _READY, _LEFT = 0, 1, 2
_FIELDS = 5  # per list: status, nbytes, count, kind (0: marshal, else a dtype char), flags
_TUPLE, _FLAT = 1, 2  # flags

_OPEN: set[int] = set()
"""This process's memfds of handoffs whose packer is not forked yet: a worker forked for
one Loader closes the others' (it would otherwise keep their packed lists alive)."""

FDS_LOCK = threading.Lock()
"""Held while :data:`_OPEN` changes and across a fork, so that a worker never closes a
descriptor number that was closed and reused in between."""

_MINE: Handoff | None = None
"""In a forked worker: the handoff of the Loader that forked it, until every list is in
place."""

_PACKER: int | None = None
"""In the worker that forked the packer: its pid, until it is reaped (:func:`reap`)."""


class Handoff:
    """The lists ``found`` (``packed.found``) of a Loader's forked workers, packed after
    the fork. Made before the forks. In the Loader's process, :meth:`workers_forked` then
    lets go of the memfds; :func:`forked` (in each worker, at its start) makes it the
    worker's, which :func:`poll` then completes; the first worker forks the packer
    (:meth:`fork_packer`), which runs :meth:`pack_all`."""

    def __init__(self, found: list[packed.Found], writer: packed.Writer | None = None) -> None:
        self.found = found
        self.writer = writer  # (the packer's: see packed.pack)
        # One row (and memfd) per list: an attribute that holds a list another holds
        # (torchvision's ``imgs`` is ``samples``) gets the same view, as at the fork.
        rows: dict[int, int] = {}
        self.row_of = [rows.setdefault(id(each.values), len(rows)) for each in found]
        self.lists = list({id(each.values): each.values for each in found}.values())
        self._memory = mmap.mmap(-1, 8 * _FIELDS * (len(self.lists) + 1),
                                 flags=mmap.MAP_SHARED)
        table = np.frombuffer(self._memory, np.int64).reshape(-1, _FIELDS)
        # head: the packer's pid, and 1 once the Loader closes (the packer stops)
        self.head, self.table = table[0], table[1:]
        with FDS_LOCK:
            self.fds = [os.memfd_create("zloader-packed", os.MFD_CLOEXEC)
                        for _ in self.lists]
            _OPEN.update(self.fds)
        # Each list's item pointers now, as a digest (tuples cannot be written): a worker
        # that finds others when its packed copy is ready wrote into it, and keeps it.
        self.digests = [_digest(values) if type(values) is list else None
                        for values in self.lists]
        self._left: list[int] = []  # (in a worker) the rows not yet taken or let go
        self._reads = 0  # (in a worker) polls while some row was pending

    def where(self, row: int) -> str:
        """The attributes that hold the list of ``row``."""
        return ", ".join(each.where for each, at in zip(self.found, self.row_of, strict=True)
                         if at == row)

    # --- in the Loader's process and in the packer -------------------------------------

    def workers_forked(self) -> None:
        """In the Loader's process, once its workers are forked: close the memfds here
        (the workers, and the packer the first of them forks, hold their own) and drop the
        digests."""
        self.digests = []
        with FDS_LOCK:
            for fd in self.fds:
                _OPEN.discard(fd)
                os.close(fd)
        self.fds = []

    def fork_packer(self) -> None:
        """In the worker forked first, at its start: fork the packer, which packs the lists
        and exits (its page tables are copied here, not on the trainer's thread), and note
        its pid in the table; :func:`reap` takes it back."""
        global _PACKER
        pid = os.fork()
        if pid == 0:
            code = 1
            try:  # the packer: never back into the worker's code
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # (a forker's)
                # (the CPU goes to the workers' first batches first: they wait for the
                # packed lists only after HANDOFF_UNPACKED_READS of them)
                os.nice(PACKER_NICE)
                self.pack_all(os.getppid())
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        self.head[0] = pid
        _PACKER = pid

    def closing(self) -> None:
        """The Loader closes: the packer packs no further list (its worker kills it as it
        leaves); the workers wait for it no more."""
        self.head[1] = 1

    def pack_all(self, parent: int) -> None:
        """In the packer: pack each list into its memfd and say so in the table (a list
        packing refuses or fails on is left); stop if ``parent`` (its worker) is gone or
        the Loader closes."""
        try:
            for row, (values, fd) in enumerate(zip(self.lists, self.fds, strict=True)):
                if os.getppid() != parent or self.head[1]:
                    return
                view = packed.pack(values, _allocator(fd), self.writer)
                packed.log_packed(view, values, self.where(row))
                self._publish(row, view)
        finally:
            for fields in self.table:  # (what was not packed is read as it is)
                if fields[0] == _PENDING:
                    fields[0] = _LEFT

    def _publish(self, row: int, view: packed.PackedSequence | None) -> None:
        fields = self.table[row]
        if view is None:
            fields[0] = _LEFT
            return
        count, kind, type_ = view.layout
        fields[1:] = (view.nbytes, count, 0 if kind == "marshal" else ord(kind),
                      (_TUPLE if type_ is tuple else 0) | (_FLAT if view.flat else 0))
        _fence()
        fields[0] = _READY

    # --- in a worker ---------------------------------------------------------------------

    def _poll(self) -> None:
        self._take_ready()
        if not self._left:
            return
        self._reads += 1
        if self._reads <= HANDOFF_UNPACKED_READS:
            return
        # The lists as they are no further: wait for the packer, unless the Loader closes
        # (it kills the packer) or this thread is asked to stop (a producer's ``stop``).
        stop = getattr(threading.current_thread(), "stop", None)
        deadline = time.monotonic() + HANDOFF_WAIT_SECONDS
        while self._left:
            if self.head[1] or (isinstance(stop, threading.Event) and stop.is_set()):
                return
            time.sleep(0.002)
            self._take_ready()
            pid = int(self.head[0])
            if self._left and not self.head[1] and (
                    time.monotonic() > deadline or (pid and not alive(pid))):
                log.warning("the packed copy of %s did not come (its packer %s): this worker "
                            "reads them as they are, copying what it reads",
                            ", ".join(self.where(row) for row in self._left),
                            "died" if pid and not alive(pid) else
                            f"took over {HANDOFF_WAIT_SECONDS:.0f} s")
                self._left = []
        self._done()

    def _take_ready(self) -> None:
        for row in list(self._left):
            status = int(self.table[row][0])
            if status == _PENDING:
                continue
            _fence()
            self._left.remove(row)
            if status != _READY:
                continue
            if not self._unwritten(row):
                log.debug("kept %s as it is: this worker wrote into it before its packed "
                          "copy was ready", self.where(row))
                continue
            view = self._view(row)
            if view is not None:
                packed.install([packed.Swap(each.owner, each.name, each.values, view,
                                            each.where)
                                for each, at in zip(self.found, self.row_of, strict=True)
                                if at == row])
        if not self._left:
            self._done()

    def _done(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds, self.digests = [], []

    def _unwritten(self, row: int) -> bool:
        """Whether the list of ``row`` holds what it held at the fork (the same object
        at every place)."""
        before = self.digests[row]
        if before is None:
            return type(self.lists[row]) is tuple
        return _digest(self.lists[row]) == before

    def _view(self, row: int) -> packed.PackedSequence | None:
        _, nbytes, count, kind, flags = (int(v) for v in self.table[row])
        try:
            memory = mmap.mmap(self.fds[row], max(1, nbytes), flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ)
        except OSError:
            log.warning("the packed %s could not be mapped: read as it is",
                        self.where(row), exc_info=True)
            return None
        view = packed.PackedSequence(memory, count, "marshal" if kind == 0 else chr(kind),
                                     tuple if flags & _TUPLE else list)
        view.flat = bool(flags & _FLAT)
        return view


def reap(stop: bool = False) -> None:
    """In the worker that forked the packer: take it back once it exited (``stop``: kill
    it first and wait, as the worker leaves). Cheap when there is none."""
    global _PACKER
    pid = _PACKER
    if pid is None:
        return
    if stop:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        done, _ = os.waitpid(pid, 0 if stop else os.WNOHANG)
    except ChildProcessError:  # (not ours, or reaped already)
        done = pid
    if done:
        _PACKER = None


def forked(mine: Handoff | None) -> None:
    """In a worker just forked (with ``mine``, its Loader's handoff, or None): close the
    memfds of every other handoff, and take ``mine``'s lists as they come (:func:`poll`).
    A packer the forking process forked before this worker is not the worker's to reap
    or kill."""
    global _MINE, _PACKER
    _PACKER = None
    for fd in _OPEN - set(mine.fds if mine is not None else ()):
        os.close(fd)
    _OPEN.clear()
    _MINE = mine
    if mine is not None:
        mine._left = list(range(len(mine.lists)))
        mine._take_ready()
        if not mine._left:
            _MINE = None


def poll() -> None:
    """In a forked worker, before a split or a batch: put in place its Loader's lists
    packed since the last call, or wait for them once enough was read without them (see
    the module). Cheap once none is pending."""
    global _MINE
    mine = _MINE
    if mine is None:
        return
    mine._poll()
    if not mine._left:
        _MINE = None


@functools.cache
def available() -> bool:
    """Whether lists can be packed after the fork here: memfds exist, and this Python's
    lists are laid out as :func:`_pointers` reads them (checked on a list made for it)."""
    if not hasattr(os, "memfd_create") or sys.implementation.name != "cpython" \
            or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return False
    first, second = object(), object()
    values = [first, second]
    found = _pointers(values)
    return found is not None and found.tolist() == [id(first), id(second)]


def _pointers(values: list[Any]) -> np.ndarray | None:
    """The item pointers of the list ``values`` (CPython's ``ob_item``: a view, valid
    while the list lives unchanged), read without touching the items (whose reference
    counts a read would write)."""
    count = len(values)
    if count == 0:
        return np.zeros(0, np.uint64)
    address = ctypes.c_void_p.from_address(id(values) + _OB_ITEM).value
    if not address:
        return None
    return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(address))


def _digest(values: list[Any]) -> tuple[int, int] | None:
    """The length of the list ``values`` and a 64-bit digest of its item pointers (None:
    unreadable). Each chunk's pointers are summed with odd weights (mod 2**64), the chunks
    chained: another object at one place always gives another digest, at several places
    but for a chance of 2**-64. 5-12 ms for 3 M items, where a copy of the pointers took
    8-65 ms (by how warm the allocator is) and 24 MB, before the fork."""
    view = _pointers(values)
    if view is None:
        return None
    weights = _weights()
    total = 0
    for at in range(0, len(view), len(weights)):
        part = view[at:at + len(weights)]
        total = (total * 0x9E3779B97F4A7C15 + int(np.dot(part, weights[:len(part)]))) \
            & 0xFFFFFFFFFFFFFFFF
    return len(view), total


@functools.cache
def _weights() -> np.ndarray:
    """:func:`_digest`'s weights: odd (so that one pointer changed changes the sum), fixed
    (a worker's digest compares with the trainer's) and a chunk's worth (small
    temporaries)."""
    mixed = np.arange(1, 1 + (1 << 16), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):  # splitmix64
        mixed = (mixed ^ (mixed >> np.uint64(shift))) * np.uint64(factor)
    return (mixed ^ (mixed >> np.uint64(31))) | np.uint64(1)


_OB_ITEM = 3 * ctypes.sizeof(ctypes.c_void_p)  # after the refcount, the type and the size


def _allocator(fd: int) -> Any:
    def allocate(size: int) -> mmap.mmap:
        os.ftruncate(fd, max(1, size))
        return mmap.mmap(fd, max(1, size), flags=mmap.MAP_SHARED)
    return allocate


_FENCE = threading.Lock()


def _fence() -> None:
    """A memory barrier (a lock taken and let go): a list's fields are written before its
    status, and read after it, in whichever order the CPU would otherwise make them
    visible to another process."""
    with _FENCE:
        pass
