"""The worker: a process that registers with the broker, runs one task at a time and
serves its elements to consumers (see docs/protocol.md).

- :mod:`~zloader.worker.process`: the process (:class:`WorkerProcess`): its sockets and
  loop, the broker's messages, reconnecting, draining, forwarding user output;
- :mod:`~zloader.worker.broker_link`: its connection to the broker;
- :mod:`~zloader.worker.task`: the task (the checked TASK, and its life cycle);
- :mod:`~zloader.worker.producer` and :mod:`~zloader.worker.links`: the producer thread
  that runs the pipeline, and the socket thread's ends of the producers' links;
- :mod:`~zloader.worker.streams`: the consumers served and how a record reaches one;
- :mod:`~zloader.worker.memory`: the process's C allocator, set so that records made
  afresh reuse warm memory;
- :mod:`~zloader.worker.delivery`: the delivery modes' protocol, with one class per mode:
  :mod:`~zloader.worker.credit` (plain, balanced), :mod:`~zloader.worker.rounds`
  (coordinated reads) and :mod:`zloader.sharing.delivery` (shared jobs).

The process module is imported on first use of its names, so that the modules it is made
of (and :mod:`zloader.sharing.delivery`, which builds on them) import in any order.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zloader._defaults import DRAIN_SECONDS

if TYPE_CHECKING:
    from zloader.worker.broker_link import BrokerRefused
    from zloader.worker.process import WorkerProcess

__all__ = ["DRAIN_SECONDS", "BrokerRefused", "WorkerProcess"]

_LAZY = {"BrokerRefused": "zloader.worker.broker_link",
         "WorkerProcess": "zloader.worker.process"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
