"""What a consumer receives from its workers: records (DATA, from a ring, a segment or
the frames themselves), each epoch's END, and failures; decoded, counted in the stats and
handed to the iterating thread (a coordinated job's records through its rounds)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from zloader import _native, codec
from zloader.client.epoch_end import EpochEnd
from zloader.client.items import Data, End, Failed, InputEnd, Item
from zloader.client.link import BrokerLink
from zloader.client.peers import Peer, Peers
from zloader.client.rounds import Rounds
from zloader.client.session import Session
from zloader.client.stats import Stats
from zloader.errors import CodecError
from zloader.lineage import Origins
from zloader.lineage import decode_origins as _pure_decode_origins
from zloader.transport import messages, records
from zloader.transport.protocol import Command, Message, ProtocolError, error_from_object
from zloader.transport.ring import RingError

__all__ = ["Receiver"]

log = logging.getLogger("zloader.loader")

FROM_WORKERS = frozenset({Command.DATA, Command.END, Command.FAIL, Command.ERROR})
"""What a worker sends a consumer on its data socket."""


class Receiver:
    """Handles the workers' messages to this consumer, in the consumer loop (stepped by
    whichever thread holds its turn, client/turn.py)."""

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
        """The session began a new epoch: records of the last one still held go (their
        ring places with them)."""
        self._skipped_by = {}
        self.stats.skipped = 0
        for peer in self.peers:
            peer.deferred.clear()

    def message(self, peer: Peer, msg: Message) -> None:
        """Handle one message from ``peer``'s worker.

        Raises:
            ProtocolError: it is malformed (the caller drops and counts it).
        """
        self.stats.last_progress = peer.heard = time.monotonic()
        if msg.command not in FROM_WORKERS:
            raise ProtocolError(f"{msg.command.name} is not a message from a worker")
        epoch = self.session.epoch
        try:
            record = messages.decode(msg)
        except ProtocolError:
            if msg.command is Command.DATA and messages.Data.epoch_of(msg.body) == epoch:
                self._count_message(peer)
                self.peers.credit(peer.worker, 1)  # a record of this epoch, unreadable
                self.release(peer, everything=False)
            raise
        if isinstance(record, messages.Data):
            if record.epoch != epoch:
                return  # an old epoch's record: its credit is not coming back, by design
            self._count_message(peer)
            try:
                self._data_message(peer, record, msg.payload)
            finally:  # (records noticed before it may have waited for it)
                self.release(peer, everything=False)
        elif isinstance(record, messages.End):
            if record.epoch == epoch:
                self.release(peer, everything=True)  # (none should be left: see release)
                self._end(peer, record, msg.payload)
        elif isinstance(record, messages.Fail):
            if record.epoch == self.session.epoch:
                self.put(Failed(error_from_object(record.error)))
        elif isinstance(record, messages.Error):
            log.warning("worker %s refused: %s", peer.endpoint, record.message)

    def _data_message(self, peer: Peer, data: messages.Data, payload: list[Any]) -> None:
        """A DATA message of the epoch under way: its record, wherever it lies."""
        try:
            buffers = self._buffers(peer, data, payload)
        except (ProtocolError, CodecError, RingError) as exc:
            peer.used(data.part)  # (the record's credit was used)
            raise self._dropped(peer, "DATA", exc) from None
        self._taken(peer, data, buffers, data.ring[1] if data.ring is not None else None)

    def notice(self, ring_id: int, length: int, position: int) -> None:
        """A record a co-located worker put in a ring, framed, announced on the notice
        pipe (transport/notice.py): taken as its DATA would be.

        Raises:
            ProtocolError: the notice, or the record it names, is malformed (the caller
                drops and counts it).
        """
        found = self.peers.ring_by_id(ring_id)
        if found is None:
            return  # a ring closed since (its worker left): nobody reads it any more
        peer, ring = found
        self.stats.last_progress = peer.heard = time.monotonic()
        try:
            block = self.peers.reading(peer, ring).claim(position, length)
            data, buffers = unframe(block)
        except (ProtocolError, RingError) as exc:
            peer.used(None)  # (the record's credit was used; of a part it does not say)
            raise self._dropped(peer, "record notice", exc) from None
        if peer.deferred or self._early(peer, data):
            # DATA messages its worker sent before it are still on their way: it waits
            # for them, behind any record already waiting
            peer.deferred.append((time.monotonic(), data, buffers, length))
            self.stats.held += 1
            return
        self._taken(peer, data, buffers, length)

    def _count_message(self, peer: Peer) -> None:
        """One more DATA message of the epoch under way came from ``peer``'s worker."""
        peer.messages = (self.session.epoch if self.session.epoch is not None else -1,
                         self._received(peer) + 1)

    def _received(self, peer: Peer) -> int:
        """The DATA messages of the epoch under way that came from ``peer``'s worker."""
        epoch, received = peer.messages
        return received if epoch == self.session.epoch else 0

    def _early(self, peer: Peer, data: messages.Data) -> bool:
        """Whether a framed record of ``peer``'s follows DATA messages not yet here."""
        return (data.after is not None and data.epoch == self.session.epoch
                and data.after > self._received(peer))

    def release(self, peer: Peer, everything: bool, older: float | None = None) -> None:
        """Take the records held back by :meth:`notice` whose DATA messages before them
        have all come; with ``everything`` (the worker's END came: nothing more will) or
        once the first was held since before ``older`` (a message lost on the way), all
        of them.

        Raises:
            ProtocolError: one of them could not be read (the others are taken).
        """
        held = peer.deferred
        if older is not None and held and held[0][0] < older:
            everything = True
        failed = None
        while held:
            _, data, buffers, length = held[0]
            if not everything and self._early(peer, data):
                break
            held.popleft()
            try:
                self._taken(peer, data, buffers, length)
            except ProtocolError as exc:
                failed = exc
        if failed is not None:
            raise failed

    def _taken(self, peer: Peer, data: messages.Data, buffers: list[Any],
               grow: int | None) -> None:
        """A record of ``peer``'s (``grow``: its size in a ring, which may need to grow)."""
        if data.epoch != self.session.epoch:
            return  # an old epoch's record: its credit is not coming back, by design
        peer.used(data.part)
        try:
            self._data(peer, data, buffers, grow)
        except (ProtocolError, CodecError, RingError) as exc:
            raise self._dropped(peer, "DATA", exc) from None

    def _dropped(self, peer: Peer, what: str, exc: Exception) -> ProtocolError:
        """A record of ``peer``'s that cannot be read (corrupt, in shared memory or on the
        wire): its credit is given back so that the worker goes on, and the error to raise
        (the caller drops and counts the record). In a shared job the worker's END no
        longer ends the epoch here: a record gone from shared memory is a dead worker's
        (swept), whose fence makes the rest again (zloader/sharing/handover.py)."""
        self.peers.credit(peer.worker, 1)
        if self.stats.share is not None:
            self.session.broken.add(peer.worker)
        return ProtocolError(f"{what} from worker pid {peer.pid} at {peer.endpoint}: {exc}")

    def _buffers(self, peer: Peer, data: messages.Data, payload: list[Any]) -> list[Any]:
        """A DATA's buffers: from its segment, its worker's ring or its frames."""
        if data.segment is not None:
            block = self.peers.map_segment(peer, data.segment, private=data.shared)
            buffers = unpack(memoryview(block))
            self.stats.segments += 1
            return buffers
        if data.ring is not None:
            position, length, name = data.ring
            reader = self.peers.ring_of(peer, name)
            block = reader.claim(position, length)
            if data.framed:  # (a notice that could not be written: its body is in front)
                return unframe(block)[1]
            return unpack(memoryview(block))
        self.stats.private += peer.ring is not None
        return [frame.buffer for frame in payload]

    def _data(self, peer: Peer, data: messages.Data, buffers: list[Any],
              grow: int | None) -> None:
        session, stats = self.session, self.stats
        count = data.count
        if peer.ring is not None and (data.full or grow is not None):
            # a full ring, or records large for it: grow it before it fills
            self.peers.grow_ring(peer, grow if grow is not None
                                 else records.packed_size(buffers))
        origins = None
        if data.origins:
            if len(buffers) < 2:
                raise ProtocolError("DATA with origins but no origin block")
            origins = _origins(buffers[-1], count)
            buffers = buffers[:-1]
        elements = codec.decode(buffers, objects=peer.own)
        if not isinstance(elements, list) or len(elements) != count:
            raise ProtocolError(f"DATA record holds {type(elements).__name__}, not {count} "
                                "elements")
        stats.records += 1
        size = sum(memoryview(b).nbytes for b in buffers)
        stats.bytes += size
        if size > self.peers.large:  # more than the memory budget holds in flight
            self.peers.fit(size)
        stats.per_worker[peer.pid] = stats.per_worker.get(peer.pid, 0) + count
        session.got(peer.worker, count, data.first)
        self._note_lagged(peer, data.lagged)
        item = Data(session.epoch if session.epoch is not None else -1, peer.worker,
                    peer.index, elements, origins, data.part)
        if origins is not None:
            origins.note(session.received)
        if self.rounds is None:
            self._note_skipped(peer, data.skipped)
            self.put(item)
            return
        number = data.round
        if number is None:
            raise ProtocolError("DATA: field 'round' is missing (a coordinated job's record "
                                "needs it)")
        if not session.done and self.rounds.hold(number, item):
            self.link.acks.append(number)
            self.end.release_rounds()
        else:  # a round this consumer skipped (lost, or before it joined)
            self.peers.credit(peer.worker, 1)

    def _end(self, peer: Peer, end: messages.End, payload: list[Any]) -> None:
        """END: ``peer``'s worker ended the epoch (or its rerun), or, with a ``part``, a
        mix input this consumer draws."""
        session, stats = self.session, self.stats
        if end.part is not None:
            peer.ended_parts.add(end.part)
            self.put(InputEnd(session.epoch if session.epoch is not None else -1,
                              peer.worker, peer.index, end.part))
            return
        self._note_skipped(peer, end.skipped)
        if end.dropped is not None:
            stats.dropped += end.dropped
        if self.rounds is not None and end.rerun is not None:
            self.rounds.ends[peer.worker] = max(end.rerun,
                                                self.rounds.ends.get(peer.worker, -1))
        self._note_lagged(peer, end.lagged, end.replayed)
        session.acked.update(end.fences)
        if end.handed is not None and not session.done:
            # (it handed its splits on before this OPEN came: the worker that makes them
            # again for this trainer names its task in an END; any of the job's may)
            session.awaiting.setdefault(end.handed, "")
        if peer.worker in session.broken:
            log.warning("worker pid %d at %s ended epoch %s after a record of it was lost: "
                        "waiting for the broker to make the rest again", peer.pid,
                        peer.endpoint, session.epoch)
            return
        session.ended.add(peer.worker)
        self.peers.left(peer)  # (a worker that had left the view: nothing more comes)
        origins = None
        if end.origins:
            if len(payload) != 1:
                raise ProtocolError("END with origins but no origin block")
            origins = _origins(getattr(payload[0], "buffer", payload[0]), 0)
            origins.note(session.received)
        epoch = session.epoch
        self.put(End(epoch if epoch is not None else -1, peer.worker, peer.index, origins))
        self.end.check()

    def _note_skipped(self, peer: Peer, skipped: int) -> None:
        """The elements ``peer``'s worker skipped so far in the epoch (``on_error="skip"``)."""
        if self._skipped_by.get(peer.worker, 0) != skipped:
            self._skipped_by[peer.worker] = skipped
            self.stats.skipped = sum(self._skipped_by.values())

    def _note_lagged(self, peer: Peer, lagged: int | None, replayed: int | None = None) -> None:
        """A shared job's elements this trainer lost to the lag policy, and those made
        again for it, as ``peer``'s worker counts them."""
        if replayed is not None:
            self.stats.replayed += replayed
        if lagged is not None:
            self._lagged_by[peer.worker] = lagged
            self.stats.lagged = sum(self._lagged_by.values())


decode_origins = _native.pick("decode_origins", _pure_decode_origins)
"""A record's origin block read and checked: compiled where built (zloader/_native.py)."""

unpack = _native.pick("unpack", records.unpack)
"""A record's buffers, as views of its block: compiled where built."""

unframe = _native.pick("unframe", messages.unframe)
"""A framed ring record's DATA body and buffers: compiled where built."""


def _origins(block: Any, count: int) -> Origins:
    """The origins a record of ``count`` elements (or an END: 0) carries.

    Raises:
        ProtocolError: its origin block is malformed.
    """
    try:
        return decode_origins(block, count)
    except ValueError as exc:
        raise ProtocolError(f"origins: {exc}") from None
