"""What a consumer receives from its workers: records (DATA, from a ring, a segment or
the frames themselves), each epoch's END, and failures; decoded, counted in the stats and
handed to the iterating thread (a coordinated job's records through its rounds)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from zloader import codec
from zloader.client.epoch_end import EpochEnd
from zloader.client.items import Item, Origins
from zloader.client.link import BrokerLink
from zloader.client.peers import Peer, Peers
from zloader.client.rounds import Rounds
from zloader.client.session import Session
from zloader.client.stats import Stats
from zloader.errors import CodecError
from zloader.transport import records
from zloader.transport.protocol import Command, Message, ProtocolError, error_from_object
from zloader.transport.ring import RingError

__all__ = ["Receiver"]

log = logging.getLogger("zloader.loader")


class Receiver:
    """Handles the workers' messages to this consumer, in the I/O thread."""

    def __init__(self, session: Session, stats: Stats, peers: Peers, link: BrokerLink,
                 end: EpochEnd, rounds: Rounds | None, put: Callable[[Item], None]) -> None:
        self.session = session
        self.stats = stats
        self.peers = peers
        self.link = link
        self.end = end
        self.rounds = rounds
        self.put = put
        self._skipped_by: dict[str, int] = {}  # worker -> elements skipped this epoch
        self._lagged_by: dict[str, int] = {}  # worker -> a shared job's elements lost

    def start(self) -> None:
        """The session began a new epoch."""
        self._skipped_by = {}

    def message(self, peer: Peer, msg: Message) -> None:
        """Handle one message from ``peer``'s worker.

        Raises:
            ProtocolError: it is malformed (the caller drops and counts it).
        """
        self.stats.last_progress = peer.heard = time.monotonic()
        epoch = msg.body.get("epoch")
        if not isinstance(epoch, int) and msg.command in (Command.DATA, Command.END,
                                                          Command.FAIL):
            raise ProtocolError(f"{msg.command.name} without an epoch")
        if msg.command is Command.DATA:
            if epoch != self.session.epoch:
                return  # an old epoch's record: its credit is not coming back, by design
            peer.owed -= 1
            try:
                self._data(peer, msg)
            except (ProtocolError, CodecError, RingError) as exc:
                # Dropped (a corrupt record, in shared memory or on the wire), counted by
                # the caller, and its credit given back so that the worker goes on.
                self.peers.credit(peer.worker, 1)
                raise ProtocolError(f"DATA from worker pid {peer.pid} at {peer.endpoint}: "
                                    f"{exc}") from None
        elif msg.command is Command.END:
            if epoch == self.session.epoch:
                self._end(peer, msg)
        elif msg.command is Command.FAIL:
            if epoch == self.session.epoch:
                self.put(Item("error", error=error_from_object(msg.body.get("error"))))
        elif msg.command is Command.ERROR:
            log.warning("worker %s refused: %s", peer.endpoint, msg.body.get("message"))

    def _buffers(self, peer: Peer, msg: Message) -> list[Any]:
        """A DATA's buffers: from its segment, its worker's ring or its frames."""
        ring = msg.body.get("ring")
        segment = msg.body.get("segment")
        if segment is not None:
            block = self.peers.map_segment(peer, segment, private=bool(msg.body.get("shared")))
            buffers = records.unpack(memoryview(block))
            self.stats.segments += 1
            return buffers
        if ring is not None:
            reader = self.peers.ring_of(peer, ring)
            block = reader.claim(int(ring[0]), int(ring[1]))
            return records.unpack(memoryview(block))
        self.stats.private += peer.ring is not None
        return [frame.buffer for frame in msg.payload]

    def _data(self, peer: Peer, msg: Message) -> None:
        session, stats = self.session, self.stats
        count = msg.field("count", int)
        buffers = self._buffers(peer, msg)
        if msg.body.get("full") and peer.ring is not None:
            self.peers.grow_ring(peer, records.packed_size(buffers))
        origins = None
        if "origins" in msg.body:
            if len(buffers) < 3:
                raise ProtocolError("DATA with origins but fewer than 3 buffers")
            origins = Origins.decode(msg.body["origins"], buffers[-2:], count)
            buffers = buffers[:-2]
        elements = codec.decode(buffers)
        if not isinstance(elements, list) or len(elements) != count:
            raise ProtocolError(f"DATA record holds {type(elements).__name__}, not {count} "
                                "elements")
        stats.records += 1
        stats.bytes += sum(memoryview(b).nbytes for b in buffers)
        stats.per_worker[peer.pid] = stats.per_worker.get(peer.pid, 0) + count
        self._note_lagged(peer, msg)
        item = Item("data", session.epoch if session.epoch is not None else -1, peer.worker,
                    peer.index, elements, origins=origins)
        if origins is not None:
            origins.note(session.received)
        if self.rounds is None:
            self._note_skipped(peer, msg)
            self.put(item)
            return
        number = msg.field("round", int)
        if not session.done and self.rounds.hold(number, item):
            self.link.acks.append(number)
            self.end.release_rounds()
        else:  # a round this consumer skipped (lost, or before it joined)
            self.peers.credit(peer.worker, 1)

    def _end(self, peer: Peer, msg: Message) -> None:
        """END: ``peer``'s worker ended the epoch (or its rerun)."""
        session, stats = self.session, self.stats
        self._note_skipped(peer, msg)
        dropped = msg.body.get("dropped")
        if isinstance(dropped, int) and not isinstance(dropped, bool):
            stats.dropped += dropped
        rerun = msg.body.get("rerun")
        if self.rounds is not None and isinstance(rerun, int):
            self.rounds.ends[peer.worker] = max(rerun, self.rounds.ends.get(peer.worker, -1))
        self._note_lagged(peer, msg)
        session.ended.add(peer.worker)
        origins = None
        if "origins" in msg.body:
            origins = Origins.loose(msg.body["origins"])
            origins.note(session.received)
        epoch = session.epoch
        self.put(Item("end", epoch if epoch is not None else -1, peer.worker, peer.index,
                      origins=origins))
        self.end.check()

    def _note_skipped(self, peer: Peer, msg: Message) -> None:
        self._skipped_by[peer.worker] = int(msg.body.get("skipped", 0))
        self.stats.skipped = sum(self._skipped_by.values())

    def _note_lagged(self, peer: Peer, msg: Message) -> None:
        """A shared job's elements this trainer lost to the lag policy, and those made
        again for it, as ``peer``'s worker counts them."""
        replayed = msg.body.get("replayed")
        if isinstance(replayed, int) and not isinstance(replayed, bool):
            self.stats.replayed += replayed
        lagged = msg.body.get("lagged")
        if isinstance(lagged, int) and not isinstance(lagged, bool):
            self._lagged_by[peer.worker] = lagged
            self.stats.lagged = sum(self._lagged_by.values())
