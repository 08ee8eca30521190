"""The socket thread's ends of its producers' links: one inproc PAIR per producer thread,
polled by the worker's loop (see :mod:`zloader.worker.producer` for what travels on them;
records do not: a producer delivers them itself, under the worker's lock, see
:class:`~zloader.worker.producer.Hand`).
"""

from __future__ import annotations

from typing import Any

import zmq

from zloader._defaults import STAGES, STOP_SECONDS
from zloader.transport.sockets import make_socket
from zloader.worker.producer import Hand, Producer, ProducerSpec

__all__ = ["STOP_SECONDS", "Links"]


class Links:
    """Starts producer threads, each with a PAIR the worker's poller watches, and drops
    their links when they are done or abandoned.

    Args:
        context: the worker's ZeroMQ context.
        poller: the worker loop's poller.
        name: part of the inproc addresses (the worker's id: unique in the process).
    """

    def __init__(self, context: zmq.Context[Any], poller: zmq.Poller, name: str,
                 hand: Hand | None = None) -> None:
        self.hand = hand  # how producers deliver their records themselves (or None)
        self.context = context
        self.poller = poller
        self.name = name
        self.count = 0
        self.producers: dict[Any, Producer] = {}  # by our end of its pair
        # Dropped producers that may still be in user code: the next producer waits for
        # them to leave before it runs any (one epoch's code at a time per process, as
        # in torch's workers: user code shares the process's global random states).
        self.leaving: list[Producer] = []
        # Where the producers' time goes, by stage (the heartbeat's stats).
        self.timing: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    def start(self, spec: ProducerSpec, epoch: int, inline: bool = False,
              **options: Any) -> Producer:
        """Start a producer of ``epoch`` (``options``: the rest of :class:`Producer`'s
        arguments) on a new link; ``inline``: it delivers its records itself (the
        task's delivery mode allows it, see ``Delivery.inline``)."""
        self.count += 1
        address = f"inproc://producer-{self.name}-{self.count}"
        link = make_socket(self.context, zmq.PAIR)
        link.bind(address)
        self.poller.register(link, zmq.POLLIN)
        self.leaving = [p for p in self.leaving if p.is_alive()]
        producer = Producer(self.context, address, spec, epoch, timing=self.timing,
                            after=tuple(self.leaving), **options)
        producer.link = link
        producer.hand = self.hand if inline else None
        self.producers[link] = producer
        producer.start()
        return producer

    def drop(self, producer: Producer) -> None:
        """Stop listening to ``producer`` (it may still run until it notices its stop)."""
        link, producer.link = producer.link, None
        if producer.is_alive() and producer not in self.leaving:
            self.leaving.append(producer)
        if link is not None:
            self.producers.pop(link, None)
            self.poller.unregister(link)
            link.close(0)

    def stop(self, producer: Producer) -> str | None:
        """Stop ``producer`` and drop its link. Returns None, or what it was doing when it
        had not stopped within STOP_SECONDS (stuck in user code)."""
        producer.halt()
        producer.join(STOP_SECONDS)
        self.drop(producer)
        if not producer.is_alive():
            return None
        doing = producer.doing()
        return (f"producer did not stop within {STOP_SECONDS:.0f} s (stage {doing['stage']}, "
                f"split {doing['split']}, epoch {doing['epoch']}): its user code has not "
                "returned (blocked, or slower than that per element)")

    def drop_all(self) -> None:
        for producer in list(self.producers.values()):
            self.drop(producer)
