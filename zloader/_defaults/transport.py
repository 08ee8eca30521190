"""The transport's tunables: rings, segments, message sizes. (part of :mod:`zloader._defaults`)."""

# --- transport: rings, segments, message sizes --------------------------------------------

DEFAULT_RING_BYTES = 64 * 1024 * 1024
"""Data capacity of a ring (one per co-located worker and consumer);
``Loader(ring_bytes=)`` (None means this, or less with many workers: each ring starts at
its worker's share of the memory budget, MEMORY_BUDGET_SHM_SHARE)."""

MEMORY_BUDGET_SHM_SHARE = 0.5
MEMORY_BUDGET_RAM_SHARE = 0.25
"""A consumer's rings and the records in flight to it take at most this share of /dev/shm's
size and of the host's memory, whichever is less (zloader/client/budget.py);
``Loader(memory_budget=)`` sets the budget in bytes instead."""

RING_BUDGET_SLACK = 2
"""When the budget limits prefetch, each worker's share of it keeps room for this many
records besides those in flight: the one the user holds, the one being written (fixed)."""

MIN_MEMORY_BUDGET = 1 << 20
"""The smallest ``Loader(memory_budget=)`` accepted (fixed)."""

RING_RESERVE_BYTES = 2 * 1024 * 1024
"""A ring's writer reserves this much of its data region in /dev/shm when it attaches, and
more, doubling, only as its records reach past it (zloader/transport/ring.py): a ring costs
the memory its records use, not its capacity (fixed)."""

RING_RESTART_BYTES = 1 << 20
"""A ring's writer may start its next record at the region start again, rather than where
the last one ended, once at least this many bytes (and the record's size) lie before that
end (zloader/transport/ring.py, rule 6): a consumer that keeps up then has its records
written over the same memory, still in the CPU's caches. Records in fewer bytes never
restart, so that positions do not leap by a ring's capacity every few records (fixed)."""

RING_RESTART_ROOM = 3
"""... and, when records are still live in the ring, only if room for this many records of
the next one's size lies between the region start and the oldest of them: until that one
is released the ring holds no more, and a consumer that suddenly holds more records than
that sends the rest through segments of their own (fixed)."""

PREFAULT_CHUNK_BYTES = 256 * 1024
"""A ring's writer faults its pages in on a background thread this many bytes at a time
(zloader/transport/prefault.py): small, so that the thread, at the lowest CPU priority,
never holds the process's memory map for long (fixed)."""

PREFAULT_JOIN_SECONDS = 0.5
"""How long closing a ring's writer waits for its prefaulting thread to finish its chunk;
the thread holds the ring's mapping until it does (fixed)."""

SEGMENT_BYTES = 1 << 20
"""A record this large that finds its ring full goes in a shared-memory segment of its own
(one copy) rather than over the socket (a copy at each end; fixed)."""

MAX_BUFFERS = 1 << 20
"""Most buffers one record may carry (fixed)."""

MAX_BODY_BYTES = 1 << 20
"""Largest JSON body of a control message other than REGISTER (fixed)."""

MAX_BODY_DEPTH = 32
"""Bodies nested deeper than this are refused (real ones nest 11 deep at most): a handler,
or the journal re-encoding a body, must never recurse near Python's limit (fixed)."""

MAX_PIPELINE_BYTES = 8 << 20
"""Pipeline definitions larger than this are refused by the broker; see docs/protocol.md
(fixed)."""

MESSAGE_SLACK_BYTES = 4096
"""Room for a message's other frames (command, version, ids) above its body and pipeline."""

MAX_REGISTER_BODY_BYTES = 8 << 20
"""Largest JSON body of a REGISTER: a resumed Loader's state travels in it, and lists the
groups anchored in the splits under way of a stage that changes the number of rows (2.2
MB for a tokenizer's pipeline over 1 M elements with a 20,000-element shuffle buffer).
A Loader whose state would not fit is refused when it is made (fixed)."""

MAX_MESSAGE_BYTES = MAX_PIPELINE_BYTES + MAX_REGISTER_BODY_BYTES + MESSAGE_SLACK_BYTES
"""The broker's socket drops any larger frame (ZeroMQ's MAXMSGSIZE: the peer is cut off)."""

MAX_DATA_FRAME_BYTES = 1 << 30
"""A worker's data socket drops any larger frame (an epoch's input sent with OPEN is the
largest thing a consumer sends; fixed)."""

MAX_NAME = 1024
"""The longest id, name, endpoint or digest a message body may hold (characters; fixed)."""

MAX_ITEMS = 1 << 16
"""The most entries a list of a message body may hold (1 MiB bodies hold fewer anyway;
fixed)."""

MAX_FIELD_DEPTH = 12
"""How deeply a field whose contents its reader checks may nest (the deepest real one,
``DELIVERED.splits`` with a split's groups and their inner groups, nests 10 levels; the
body as a whole is held to MAX_BODY_DEPTH; fixed)."""

HANDOVER_SPLITS = 1 << 15
"""The most splits one entry of a shared job's handover holds (``HEARTBEAT.handover``,
``HANDOVER``: one entry per message, well within MAX_BODY_BYTES; fixed)."""

HANDOVER_SWITCHES = 1024
"""The most switches of a mix's weights one entry of a handover carries (with
HANDOVER_SPLITS splits and HANDOVER_SERVED trainers, well within MAX_BODY_BYTES; a segment
with more takes entries of its own for the rest; fixed)."""

HANDOVER_SERVED = 4096
"""The most served trainers one entry of a handover names (with HANDOVER_SPLITS splits,
well within MAX_BODY_BYTES; a shared job has a handful; fixed)."""

MAX_HANDOVER_ENTRIES = 4096
"""The most handover entries the broker keeps for one drained worker (``HEARTBEAT.handover``:
134 M splits; fixed)."""

MAX_RANGES = 4096
"""The most ranges of places a shared job's trainer says it had of a dead worker's
elements (``DELIVERED.shared.ranges``); one with more says only how many (fixed)."""
