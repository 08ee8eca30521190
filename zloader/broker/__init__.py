"""The broker: the control plane. One ROUTER loop (``loop.py``) drives a state machine
without sockets (``state.py``: plain records in ``records.py``, transitions in one module
per concern) that hands workers their tasks and splits and tells consumers where to read.

Run it with ``zloader-broker`` (or ``python -m zloader.broker``), or embedded in a
Loader's process (:meth:`Broker.start`).
"""

from __future__ import annotations

from zloader.broker.loop import Broker

__all__ = ["Broker"]
