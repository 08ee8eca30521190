"""The broker: the control plane. One ROUTER loop (``loop.py``) drives a state machine
without sockets (``state.py``: plain records in ``records.py``, transitions in one module
per concern, each calling only the ones below it; the journal's events in ``events.py``,
replayed by ``history.py``) that hands workers their tasks and splits and tells consumers
where to read. What it sends is a record of zloader/transport/messages.py.

Run it with ``zloader-broker`` (or ``python -m zloader.broker``), or embedded in a
Loader's process (:meth:`Broker.start`).
"""

from __future__ import annotations

from zloader.broker.loop import Broker

__all__ = ["Broker"]
