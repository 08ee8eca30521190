"""The worker: a process that registers with the broker, runs one task at a time and
serves its elements to consumers (see docs/protocol.md).

- :mod:`~zloader.worker.process`: the process (:class:`WorkerProcess`): its sockets and
  loop, the broker's messages, reconnecting, draining, forwarding user output;
- :mod:`~zloader.worker.broker_link`: its connection to the broker;
- :mod:`~zloader.worker.task`: the task (the checked TASK, and its life cycle);
- :mod:`~zloader.worker.producer` and :mod:`~zloader.worker.links`: the producer thread
  that runs the pipeline, and the socket thread's ends of the producers' links;
  :mod:`~zloader.worker.dispatched`: the work items a consumer dispatches to it;
- :mod:`~zloader.worker.streams`: the consumers served and how a record reaches one;
- :mod:`~zloader.worker.memory`: the process's C allocator, set so that records made
  afresh reuse warm memory;
- :mod:`~zloader.worker.delivery`: the delivery modes' protocol, with one class per mode:
  :mod:`~zloader.worker.credit` (plain, balanced), :mod:`~zloader.worker.rounds`
  (coordinated reads) and :mod:`~zloader.worker.shared` (shared jobs).
"""

from __future__ import annotations

from zloader._defaults import DRAIN_SECONDS
from zloader.worker.broker_link import BrokerRefused
from zloader.worker.process import WorkerProcess

__all__ = ["DRAIN_SECONDS", "BrokerRefused", "WorkerProcess"]
