"""The consumer side of the service: what a :class:`zloader.Loader` runs.

One consumer loop per Loader owns every socket (``loop.py``), stepped by whichever thread
holds its turn (``turn.py``): the Loader's I/O thread (``thread.py``) while the trainer is
away, the iterating thread itself while it waits for data. The loop is split by concern:

- ``link.py``: the broker (REGISTER, heartbeats, the job's views, registering again)
- ``peers.py``: the job's workers (a socket each, shared-memory rings, credits)
- ``receive.py``: records and ends of epochs from the workers, decoded and counted
- ``epoch_end.py``: when an epoch is over (fences, reruns, rereads, stuck workers)
- ``rounds.py``: coordinated reads (rounds held until the broker commits them)

The iterating thread takes the loop's items in ``merging.py`` and reads ``Stats``
(``stats.py``), the one record both threads share; ``exactly_once.py`` holds the
consumer's side of exactly-once epochs (the rule, ``state_dict``, resuming). The Loader
checks its arguments with ``arguments.py`` and ships its pipeline with ``shipment.py``.
"""

from zloader.client.exactly_once import STATE_VERSION, Yielded, resume_from
from zloader.client.items import Item, Origins
from zloader.client.merging import Merger
from zloader.client.peers import local_address
from zloader.client.stats import Stats
from zloader.client.thread import IOThread

__all__ = ["STATE_VERSION", "IOThread", "Item", "Merger", "Origins", "Stats", "Yielded",
           "local_address", "resume_from"]
