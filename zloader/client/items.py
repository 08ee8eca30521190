"""What the I/O thread hands the iterating thread: :class:`Item` s, and the origins an
exactly-once job's records carry (:class:`Origins`, decoded and validated here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zloader.lineage import Ledger, decode_origins
from zloader.transport.protocol import ProtocolError

__all__ = ["Item", "Origins"]


@dataclass
class Item:
    """What the I/O thread hands the iterating thread."""

    kind: str  # "data", "end" (one worker finished the epoch), "done" (all did), "error"
    epoch: int = -1
    worker: str = ""
    index: int = 0
    elements: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    # Exactly-once jobs: the pass keys by pass id, the origin triples per element (loose
    # ones first: ``counts[0]``) and the rows, and the split ends, see zloader/lineage.py.
    origins: Origins | None = None


@dataclass
class Origins:
    """The origins one record (or an epoch's END) carries."""

    keys: list[tuple[int, ...]]
    counts: Any  # int32: loose, then one per element
    rows: Any  # int64 (n, 3): (pass id, split, index)
    ends: list[tuple[tuple[int, ...], int, int, int]]

    def note(self, ledger: Ledger, elements: int | None = None) -> None:
        """Add the loose origins and those of the first ``elements`` elements (all when
        None), and the split ends, to ``ledger``."""
        rows = self.rows
        if elements is not None:
            rows = rows[:int(self.counts[:elements + 1].sum())]
        ledger.add(self.keys, rows)
        for key, split, count, crc in self.ends:
            ledger.end(key, split, count, crc)

    @classmethod
    def decode(cls, head: Any, buffers: list[Any], count: int) -> Origins:
        """The origins of a record of ``count`` elements (``head``: its pass table and split
        ends; ``buffers``: its two origin buffers).

        Raises:
            ProtocolError: they are malformed.
        """
        if not isinstance(head, dict) or not isinstance(head.get("passes"), dict) \
                or not isinstance(head.get("ends"), list):
            raise ProtocolError("origins must be {passes, ends}")
        keys: dict[int, tuple[int, ...]] = {}
        for pass_id, key in head["passes"].items():
            if not (pass_id.isdigit() and int(pass_id) < 1 << 20 and isinstance(key, list)
                    and key and all(isinstance(k, int) and k >= 0 for k in key)):
                raise ProtocolError("origins.passes must map pass ids to pass keys")
            keys[int(pass_id)] = tuple(key)
        try:
            counts, rows = decode_origins(buffers[0], buffers[1], count)
        except ValueError as exc:
            raise ProtocolError(f"DATA: {exc}") from None
        table = [keys.get(i, ()) for i in range(max(keys, default=-1) + 1)]
        if len(rows) and (int(rows[:, 0].max()) >= len(table)
                          or not all(table[i] for i in np.unique(rows[:, 0]).tolist())):
            raise ProtocolError("DATA: an origin names a pass the record does not")
        ends = []
        for end in head["ends"]:
            if not (isinstance(end, list) and len(end) == 4
                    and all(isinstance(v, int) and v >= 0 for v in end) and end[0] in keys):
                raise ProtocolError("origins.ends must be [pass id, split, count, digest]")
            ends.append((keys[end[0]], end[1], end[2], end[3]))
        return cls(table, counts, rows, ends)

    @classmethod
    def loose(cls, head: Any) -> Origins:
        """The origins an END carries: its loose triples (``head["loose"]``: origins of
        elements the worker dropped, such as a filter's) and split ends.

        Raises:
            ProtocolError: they are malformed.
        """
        loose = head.get("loose") if isinstance(head, dict) else None
        if not isinstance(loose, list) or len(loose) % 3 \
                or not all(isinstance(v, int) and v >= 0 for v in loose):
            raise ProtocolError("END.origins.loose must be a list of triples")
        triples = np.array(loose, np.int64).tobytes()
        counts = np.array([len(loose) // 3], np.int32).tobytes()
        return cls.decode(head, [counts, triples], 0)
