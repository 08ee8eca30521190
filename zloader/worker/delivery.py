"""How a task's records reach its consumers: one :class:`Delivery` per mode.

The worker picks the mode once, when a task starts
(:func:`zloader.worker.process.delivery_for`); from then on the task and the process speak
only to this interface:

- :class:`zloader.worker.credit.CreditDelivery`: each record to a consumer with credit
  (plain), or dealt round-robin to the N consumers of a ``balanced`` job;
- :class:`zloader.worker.rounds.RoundsDelivery`: coordinated reads, N records at a time,
  each group numbered by the broker;
- :class:`zloader.worker.shared.SharedDelivery`: a shared job's sliding window, every
  trainer sent every record.

A delivery owns its queue of records from the producer (``pending``) and the pool of
permits the task's producer takes one of per record (``pool``): consumers' credits
(plain and balanced) or what the mode lets the producer make ahead (rounds, window).
"""

from __future__ import annotations

import abc
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from zloader.sharing.branches import Branch
from zloader.worker.outgoing import EndOut, Outgoing
from zloader.worker.permits import Permits, Pool
from zloader.worker.producer import Producer, ProducerSpec
from zloader.worker.streams import Outlet, Stream

if TYPE_CHECKING:
    from zloader.transport.messages import Open

__all__ = ["Delivery", "EndOut", "Pending", "TaskPort", "discard"]

log = logging.getLogger("zloader.worker")

Pending = Outgoing | EndOut
"""What waits in a delivery's queue: a record from the producer, or an epoch's end."""


class TaskPort(Protocol):
    """What a delivery mode sees of its task (the worker's ``Task`` is one) and all it
    may do with it: the consumers' streams, the epochs finished, the outlet records go
    out through, the epoch being produced and its producer, the reruns asked; open and
    finish epochs, drop a stream, start the next epoch's producer, start or drop a
    producer of the mode's own, and ask the broker to number a round."""

    @property
    def streams(self) -> dict[bytes, Stream]: ...

    @property
    def finished(self) -> set[int]: ...

    @property
    def outlet(self) -> Outlet: ...

    @property
    def producing(self) -> int | None: ...

    @property
    def producer(self) -> Producer | None: ...

    @property
    def reruns(self) -> dict[int, int]: ...

    @property
    def spec(self) -> ProducerSpec: ...

    @property
    def id(self) -> str: ...

    @property
    def branches(self) -> dict[int, Branch]: ...

    def open_epoch(self, stream: Stream, opened: Open) -> None: ...

    def remove_stream(self, stream: Stream) -> None: ...

    def finish_epoch(self, epoch: int) -> None: ...

    def abandon_stale(self) -> None: ...

    def maybe_produce(self) -> None: ...

    def start_producer(self, epoch: int, pool: Pool, index: int | None = None,
                       branch: int | None = None, **options: Any) -> Producer: ...

    def drop_producer(self, producer: Producer) -> None: ...

    def ask_round(self, epoch: int, members: tuple[str, ...]) -> None: ...


class Delivery(abc.ABC):
    """The protocol every delivery mode follows (see the module's docstring).

    Args:
        port: what it sees of the task whose records it delivers (:class:`TaskPort`).
    """

    permits: Permits | None = None
    """Its producers' permits per mix input, when its consumers draw the mix (credit
    delivery's, zloader/worker/permits.py); None: ``pool``."""

    inline = False
    """Whether its producers deliver their records on their own thread (producer.py
    ``Hand``): only a mode whose delivery of a record never ends an epoch, starts or stops
    a producer (whose links the worker's loop polls) may say so."""

    @property
    def counts(self) -> bool:
        """Whether its consumers may give their credits back in their rings' headers
        (``OPEN.counter``): its producers deliver their records themselves, which is
        where those credits are taken when they run short, and by no part."""
        return self.inline and self.permits is None

    def __init__(self, port: TaskPort) -> None:
        self.port = port
        self.pool = Pool()  # one permit per record the producer may make
        self.pending: deque[Pending] = deque()
        self.outstanding = 0  # permits given to the producer and not used yet

    # --- consumers ------------------------------------------------------------------------

    def open(self, stream: Stream, opened: Open) -> None:
        """A consumer opens (or re-opens) an epoch with the OPEN ``opened``.

        Raises:
            ProtocolError: the OPEN is malformed for this mode.
        """
        self.port.open_epoch(stream, opened)

    @abc.abstractmethod
    def credit(self, stream: Stream, credits: int, part: int | None = None) -> None:
        """``stream``'s consumer granted ``credits`` more records (checked here), of mix
        input ``part`` when its consumers draw the mix (None: of each input)."""

    @abc.abstractmethod
    def withdraw(self, stream: Stream) -> None:
        """Forget the credits ``stream`` holds (it re-opens, or leaves)."""

    def leave(self, stream: Stream) -> None:
        """``stream``'s consumer leaves the task."""
        self.withdraw(stream)

    def mapped(self, stream: Stream, names: list[Any]) -> None:
        """The consumer mapped these segments (CREDIT's ``mapped``, unchecked)."""
        return None

    def branches_for(self, epoch: int) -> set[int]:
        """The branches of a shared job the producer of ``epoch`` makes (those read)."""
        return set()

    def branch_failed(self, index: int, error: dict[str, Any]) -> None:
        """A shared job's branch ``index`` could not be loaded here (``error``)."""
        return None

    def branch_added(self, index: int) -> None:
        """A shared job's branch ``index`` is known now (BRANCH)."""
        return None

    def consumer_gone(self, consumer: str, replaced: bool) -> None:
        """The broker says ``consumer`` left (``replaced``: another took its place)."""
        return None

    # --- records --------------------------------------------------------------------------

    @abc.abstractmethod
    def deliver(self) -> None:
        """Send what the consumers may take now."""

    def on_record(self, producer: Producer, outgoing: Outgoing) -> None:
        """``producer`` made one record."""
        self.outstanding = max(0, self.outstanding - 1)
        self.pending.append(outgoing)
        self.deliver()

    def left_over(self, item: Pending) -> bool:
        """Whether ``item`` belongs to an epoch already finished here (abandoned): its
        record, if any, is let go of."""
        if item.epoch not in self.port.finished:
            return False
        if isinstance(item, Outgoing):
            item.mark_taken()
        return True

    def on_end(self, producer: Producer, end: EndOut) -> None:
        """``producer`` finished its epoch (or, with a ``part``, a mix input)."""
        self.pending.append(end)
        self.deliver()

    def on_round(self, epoch: int, number: int | None) -> None:
        """The broker numbered a round (ROUND): only coordinated reads ask for that."""
        log.warning("a round number for epoch %d came with no group waiting", epoch)

    # --- production -----------------------------------------------------------------------

    def new_epoch(self, epoch: int) -> dict[str, Any]:
        """Before the task's producer of ``epoch`` starts: what it should record, as
        options of :class:`~zloader.worker.producer.Producer` (``splits``, ``switches``;
        none: nothing)."""
        return {}

    def permit(self) -> None:
        """Let the producers make as many records as the consumers can take now (modes
        whose permits are not simply the consumers' credits)."""
        return None

    def overdraw(self) -> None:
        """The task drains to move (``RELEASE.drain``): let its producer finish and send
        what it makes without waiting for credits (its consumers may not be reading: a
        training loop paused while validation takes this worker). Modes whose records
        must wait for something else (a trainer's window, a round) keep waiting."""
        return None

    def side_producers(self) -> list[Producer]:
        """Producers of its own the mode runs besides the task's (a shared job's replay)."""
        return []

    def start_side(self) -> None:
        """Start a producer of its own, if one waits (before the task starts an epoch)."""
        return None

    def handover(self) -> list[dict[str, Any]]:
        """The task drained to move: what it hands on to another worker of its job
        (``HEARTBEAT.handover``: a shared job's splits, zloader/sharing/handover.py)."""
        return []

    def handed(self) -> set[int] | None:
        """The epochs of what the task handed on (None: it handed nothing on), which an
        OPEN that comes after the task ended is answered for (``END.handed``)."""
        return None

    def adopt(self, entries: tuple[dict[str, Any], ...], held: tuple[int, ...] = (),
              fence: str | None = None) -> None:
        """``HANDOVER``: entries of another worker's handover, and the epochs whose end
        waits for one (a shared job's)."""
        log.warning("a handover for a job that is not shared: ignored")

    def breaks(self, epoch: int) -> bool:
        """Whether a consumer left ``epoch`` in a way that ends it for every consumer."""
        return False

    # --- the worker's loop ----------------------------------------------------------------

    def poll(self) -> None:
        """Called on every turn of the worker's loop."""
        return None

    def reconnected(self) -> None:
        """The broker connection was replaced: answers on the old one are lost."""
        return None

    def busy(self) -> bool:
        """Whether it holds records not sent yet (a draining worker waits for them)."""
        return bool(self.pending)

    def stats(self) -> dict[str, Any]:
        """What it adds to the heartbeat's stats."""
        return {}

    def close(self) -> None:
        """The task is over: free what the mode holds."""
        return None


def discard(records: list[Outgoing]) -> None:
    """Let the producers of ``records`` go on (their buffers are not needed)."""
    for record in records:
        record.mark_taken()
    records.clear()
