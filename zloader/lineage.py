"""Where each element came from: the bookkeeping behind exactly-once epochs.

With dynamic sharding (no sharing, coordination or balancing) a worker tags every source
element with its *origin*: (pass, split, index), the index counting the elements the
source yields for that split. Stages carry the tags (docs/reliability.md):

- a map keeps its input's tag; a shuffle moves tags with their elements;
- a batch holds the tags of its rows; an unbatch gives each row its own back;
- an element dropped on the way (a filter, ``on_error="skip"``, a dropped remainder) is
  still *accounted for*: its tag rides with the next record as a loose origin.

The consumer keeps a :class:`Ledger` of what it received and of what it yielded. When a
worker dies, the broker asks the consumers which elements of its splits they hold and hands
the splits out again with those indices to skip; ``Loader.state_dict()`` is the yielded
ledger. Re-reading a split this way needs the source to yield the same elements for it each
time: a worker re-reading a split checks the count and a digest of what it read against the
first reading and reports a difference as a :class:`~zloader.errors.PipelineError`.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from zloader.errors import PipelineError

__all__ = ["Assigned", "Ledger", "Tagged", "decode_origins", "digest", "encode_origins",
           "exactly_once", "merge_info", "pack", "read_split", "unpack"]

Key = tuple[int, ...]
DIGEST_BYTES = 4096
"""Bytes of each buffer of a source element that the reproducibility digest covers."""


def exactly_once(requested: bool, sharding: str, shared: bool, deterministic: bool,
                 coordinated: bool, balanced: int) -> bool:
    """Whether a job runs exactly-once (its elements carry their origins, and a worker that
    leaves loses and repeats nothing, docs/reliability.md).

    Args:
        requested: the Loader asked for it (``REGISTER.options.exactly_once``).
        sharding: the job's sharding mode; only ``"dynamic"`` can re-hand splits.
        shared: the job is shared by trainers (``share``).
        deterministic: its elements come in a fixed order.
        coordinated: its consumers read round by round (``num_consumers``).
        balanced: ``balanced`` batches per consumer (0: not balanced).

    Returns:
        True when requested and the job is dynamic, neither shared, balanced, coordinated
        nor deterministic. The one rule: the broker applies it to REGISTER
        (zloader/broker/jobs.py) and the Loader to its own arguments.
    """
    return (requested and sharding == "dynamic" and not shared and not deterministic
            and not coordinated and not balanced)



Tagged = tuple[Any, tuple[int, ...]]
"""An element on its way through the worker part: ``(value, origin)``, the origin being the
flat (pass id, split, index) triples it holds (pass ids number the producer's passes). A
plain tuple: made once per source element, it must be cheap."""


@dataclass(frozen=True)
class Assigned:
    """A split handed to a worker: ``pass_key`` names the pass it belongs to (a re-queued
    split may be read in a later pass), ``skip`` the indices already delivered, ``expect``
    the (count, digest) of an earlier reading when one is known."""

    split: int
    pass_key: Key
    skip: frozenset[int] = frozenset()
    expect: tuple[int, int] | None = None


def read_split(source: Any, assigned: Assigned, pass_id: int, ctx: Any) -> Iterator[Tagged]:
    """Tagged elements of one split, less ``assigned.skip``; records (count, digest) in
    ``ctx.ends`` once the split is read.

    Raises:
        PipelineError: the split read differently from its earlier reading.
    """
    split, skip = assigned.split, assigned.skip
    crc = count = 0
    for index, element in enumerate(source.read(split, ctx)):
        if type(element) is int:  # digest()'s first case, without the call
            crc = (crc * 1_000_003 ^ hash(element)) & 0xFFFFFFFF
        else:
            crc = digest(element, crc)
        count = index + 1
        if not skip or index not in skip:
            yield (element, (pass_id, split, index))
    if assigned.expect is not None and tuple(assigned.expect) != (count, crc):
        raise PipelineError.create(
            "source", "RuntimeError",
            f"split {split} read differently the second time ({count} elements, digest "
            f"{crc:#x}; first {assigned.expect[0]}, {assigned.expect[1]:#x}): exactly-once "
            "needs each split of an epoch to yield the same elements every time it is read "
            "(seed randomness per split and epoch; no reading of data that changes); pass "
            "exactly_once=False to accept repeats instead", context=f"split {split}",
            builtin="RuntimeError")
    ctx.ends.append([pass_id, split, count, crc])


def digest(element: Any, crc: int, depth: int = 0) -> int:
    """A cheap running checksum of a source element (types, lengths, leading bytes), the
    same in every process (numbers mix in their hash, which Python does not randomize)."""
    kind = type(element)
    if kind is int or kind is float or kind is bool:
        return (crc * 1_000_003 ^ hash(element)) & 0xFFFFFFFF
    if element is None:
        return (crc * 1_000_003 ^ 0x5EED) & 0xFFFFFFFF
    if isinstance(element, np.ndarray):
        crc = zlib.crc32(f"{element.dtype}{element.shape}".encode(), crc)
        flat = element.reshape(-1)
        return zlib.crc32(np.ascontiguousarray(flat[:DIGEST_BYTES // max(1, flat.itemsize)])
                          .tobytes(), crc)
    if isinstance(element, (bytes, bytearray, memoryview)):
        data = bytes(element[:DIGEST_BYTES])
        return zlib.crc32(data, zlib.crc32(len(element).to_bytes(8, "little"), crc))
    if isinstance(element, str):
        return zlib.crc32(element[:DIGEST_BYTES].encode("utf-8", "replace"), crc)
    if isinstance(element, (int, float, complex, np.generic)):
        return zlib.crc32(repr(element).encode(), crc)
    if depth < 4 and isinstance(element, (tuple, list)):
        for item in element[:16]:
            crc = digest(item, crc, depth + 1)
        return zlib.crc32(len(element).to_bytes(8, "little"), crc)
    if depth < 4 and isinstance(element, dict):
        for name, item in list(element.items())[:16]:
            crc = digest(item, digest(name, crc, depth + 1), depth + 1)
        return crc
    return zlib.crc32(type(element).__name__.encode(), crc)


# --- origins on the wire: two buffers after a record's codec buffers ----------------------


def encode_origins(elements: list[Tagged], loose: list[int]) -> list[bytes]:
    """``[counts, triples]``: counts (int32) holds the loose triples, then each element's;
    triples (int64) are (pass id, split, index) rows in that order."""
    counts = np.empty(len(elements) + 1, np.int32)
    counts[0] = len(loose) // 3
    flat = list(loose)
    for position, element in enumerate(elements, 1):
        counts[position] = len(element[1]) // 3
        flat.extend(element[1])
    return [counts.tobytes(), np.array(flat, np.int64).tobytes()]


def decode_origins(counts: Any, triples: Any, elements: int) -> tuple[np.ndarray, np.ndarray]:
    """Copy and check the two origin buffers of a record of ``elements`` elements (a
    copy: they may lie in a ring that another process could still write, and they are read
    long after this check, when their elements are yielded).

    Raises:
        ValueError: they do not fit together.
    """
    counts_view = memoryview(counts).cast("B")
    triples_view = memoryview(triples).cast("B")
    if counts_view.nbytes != 4 * (elements + 1) or triples_view.nbytes % 24:
        raise ValueError("origin buffers of the wrong size")
    counted = np.frombuffer(counts_view, np.int32).copy()
    rows = np.frombuffer(triples_view, np.int64).reshape(-1, 3).copy()
    if (counted < 0).any() or int(counted.sum()) != len(rows) or (rows < 0).any() \
            or (len(rows) and int(rows[:, 1].max()) >= 1 << 32):
        raise ValueError("origin counts do not match the origins")
    return counted, rows


# --- sets of small ints as short strings ---------------------------------------------------


def pack(values: Iterable[int]) -> str:
    """A set of ints >= 0 as base64 of a compressed bitmap."""
    array = np.fromiter(values, np.int64)
    if not len(array):
        return ""
    mask = np.zeros(int(array.max()) + 1, bool)
    mask[array] = True
    return base64.b64encode(zlib.compress(np.packbits(mask).tobytes())).decode()


def unpack(text: Any, limit: int = 1 << 32) -> set[int]:
    """The set :func:`pack` made.

    Raises:
        ValueError: ``text`` is not one (or holds more than ``limit`` bits).
    """
    if text == "":
        return set()
    if not isinstance(text, str):
        raise ValueError(f"a packed set must be a string, not {type(text).__name__}")
    try:
        raw = zlib.decompressobj().decompress(base64.b64decode(text, validate=True),
                                              limit // 8 + 1)
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"not a packed set: {exc}") from None
    return set(np.flatnonzero(np.unpackbits(np.frombuffer(raw, np.uint8))).tolist())


def merge_info(held: dict[str, Any] | None, info: Any) -> dict[str, Any]:
    """Add one consumer's :meth:`Ledger.info` for a split to what others said (``all``, or
    the union of the indices held, as a set, and the first reading's ``expect``).

    Raises:
        ValueError: ``info`` is malformed.
    """
    if not isinstance(info, dict):
        raise ValueError("a split's info must be an object")
    if (held or {}).get("all") or info.get("all") is True:
        return {"all": True}
    expect = info.get("expect")
    if expect is not None and not (isinstance(expect, list) and len(expect) == 2
                                   and all(isinstance(v, int) for v in expect)):
        raise ValueError("expect must be [count, digest]")
    merged = dict(held or {"have": set()})
    merged["have"] = merged["have"] | unpack(info.get("have", ""))
    if expect is not None:
        merged["expect"] = expect
    return merged


# --- the consumer's ledger -------------------------------------------------------------------


class Ledger:
    """Origins of one epoch received (or yielded) by a consumer: per pass, the splits
    accounted for whole, and the indices of the others; with each split's (count, digest)
    once its worker finished reading it."""

    def __init__(self) -> None:
        self.done: dict[Key, set[int]] = {}
        self.open: dict[tuple[Key, int], set[int]] = {}
        self.lengths: dict[tuple[Key, int], tuple[int, int]] = {}
        self.elements = 0

    def add(self, keys: list[Key], rows: np.ndarray) -> None:
        """Note the origins ``rows`` ((pass id, split, index) triples; ``keys[id]`` is the
        pass)."""
        if not len(rows):
            return
        self.elements += len(rows)
        combined = rows[:, 0] * (1 << 32) + rows[:, 1]
        if (combined == combined[0]).all():
            groups: Iterable[tuple[Any, Any]] = [(combined[0], rows[:, 2])]
        else:
            order = np.argsort(combined, kind="stable")
            ordered = combined[order]
            cuts = np.flatnonzero(np.diff(ordered)) + 1
            groups = zip(ordered[np.r_[0, cuts]].tolist(), np.split(rows[order, 2], cuts),
                         strict=True)
        for code, indices in groups:
            key, split = keys[int(code) >> 32], int(code) & 0xFFFFFFFF
            if split in self.done.get(key, ()):
                continue
            self.open.setdefault((key, split), set()).update(indices.tolist())
            self._close(key, split)

    def end(self, key: Key, split: int, count: int, crc: int) -> None:
        """The split's worker read ``count`` elements from it (with digest ``crc``)."""
        if split not in self.done.get(key, ()):
            self.lengths[(key, split)] = (count, crc)
            self._close(key, split)

    def missing(self, epoch: int, handed: Any) -> set[tuple[Key, int]]:
        """The splits of ``epoch`` not accounted for whole: begun here and not finished
        (fewer elements than their count), or handed out by the broker (``handed``: its
        ``JOB.read``, ``[[pass, packed splits], ...]``) and never finished here. Malformed
        entries of ``handed`` are ignored."""
        missing = {at for at in self.open if at[0][0] == epoch}
        for entry in handed if isinstance(handed, list) else ():
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                    and entry[0] and entry[0][0] == epoch):
                continue
            key = tuple(entry[0])
            try:
                missing |= {(key, split) for split in unpack(entry[1])
                            - self.done.get(key, set())}
            except ValueError:
                continue
        return missing

    def _close(self, key: Key, split: int) -> None:
        length = self.lengths.get((key, split))
        if length is not None and len(self.open.get((key, split), ())) >= length[0]:
            self.done.setdefault(key, set()).add(split)
            self.open.pop((key, split), None)
            self.lengths.pop((key, split), None)

    def info(self, key: Key, split: int) -> dict[str, Any]:
        """What the broker needs to hand ``split`` out again: ``all`` when it is accounted
        for, else the indices held (``have``) and the first reading's ``expect``."""
        if split in self.done.get(key, ()):
            return {"all": True}
        info: dict[str, Any] = {"have": pack(self.open.get((key, split), ()))}
        if (key, split) in self.lengths:
            info["expect"] = list(self.lengths[(key, split)])
        return info

    def to_json(self) -> list[Any]:
        """Per pass: ``[pass, done splits, [[split, held indices, count, digest], ...]]``
        (count and digest -1 while unknown)."""
        keys = set(self.done) | {key for key, _ in self.open}
        out = []
        for key in sorted(keys):
            opened = [[split, pack(indices), *self.lengths.get((k, split), (-1, -1))]
                      for (k, split), indices in sorted(self.open.items()) if k == key]
            out.append([list(key), pack(self.done.get(key, ())), opened])
        return out

    def merge_json(self, passes: Any) -> None:
        """Add what :meth:`to_json` returned (of this ledger or another's).

        Raises:
            ValueError: ``passes`` is not such a value.
        """
        if not isinstance(passes, list):
            raise ValueError("the delivered origins must be a list of passes")
        for entry in passes:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], list)
                    and all(_natural(k) for k in entry[0]) and isinstance(entry[2], list)):
                raise ValueError(f"bad pass entry in the delivered origins: {entry!r:.80}")
            key = tuple(entry[0])
            for split in unpack(entry[1]):
                self.done.setdefault(key, set()).add(split)
                self.open.pop((key, split), None)
                self.lengths.pop((key, split), None)
            for item in entry[2]:
                if not (isinstance(item, list) and len(item) == 4 and _natural(item[0])
                        and all(isinstance(v, int) for v in item[2:])):
                    raise ValueError(f"bad split entry in the delivered origins: {item!r:.80}")
                split = item[0]
                if split in self.done.get(key, ()):
                    continue
                self.open.setdefault((key, split), set()).update(unpack(item[1]))
                if item[2] >= 0:
                    self.lengths[(key, split)] = (item[2], item[3])
                self._close(key, split)


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
