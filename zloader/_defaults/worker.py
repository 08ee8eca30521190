"""The worker's tunables, and a shared job's window. (part of :mod:`zloader._defaults`)."""

# --- worker -------------------------------------------------------------------------------

DRAIN_SECONDS = 30.0
"""A draining worker (SIGTERM) leaves after this long even with splits unfinished (fixed)."""

STOP_SECONDS = 2.0
"""A producer told to stop that has not within this long is stuck in user code (a thread
cannot be killed): the worker process then replaces itself
(``zloader.worker.links.STOP_SECONDS``; fixed)."""

EARLY_OPENS = 64
"""OPENs a worker keeps for a task it has not heard of yet; the oldest are dropped
(fixed)."""

MAX_DISPATCHED = 1 << 20
"""Work items (``DISPATCH``) that may wait for a worker's producer at once, per epoch;
a consumer that sends more is refused (fixed)."""

KEPT_EPOCHS = 2
"""A worker's task keeps the consumers' epoch inputs and dispatched items of this many
epochs, the latest (the one under way and the next; zloader/worker/task.py; fixed)."""

DISPATCH_WAIT = 0.1
"""Seconds between a waiting producer's looks at its stop while no dispatched work item
has come (zloader/worker/dispatched.py; fixed)."""

HAND_WAIT = 0.005
"""Seconds a producer delivering a record itself waits for its worker's lock before it
looks at its stop flag again (zloader/worker/producer.py ``Hand``; fixed)."""

READ_AHEAD_SECONDS = 0.002
"""An exactly-once split reader reads plain ints a group at a time (zloader/lineage/
``read_split``) only while a group takes the source less than this; a slower source is
read one element at a time, so that its first elements do not wait for the group's last
(fixed)."""

NOTICE_READ_BYTES = 1 << 16
"""Bytes a consumer reads from its record-notice pipe at once (zloader/transport/notice.py):
4,096 notices, what a pipe holds by default (fixed)."""

RECORD_ELEMENTS = 1024
"""A producer sends a record once it holds this many elements (fixed)."""

RECORD_BYTES = 1 << 20
"""... or this many bytes of them (fixed)."""

PART_RECORD_ELEMENTS = 64
"""A record of one input of a mix its consumers draw holds at most this many elements
(fixed): a small input's few records would otherwise go whole to one of a job's consumers,
whose draws then hold all of it and the others' none (worker/producer.py)."""

RECORD_LINGER = 0.002
"""... or once its first element has waited this many seconds (fixed)."""

LARGE_RECORD_BYTES = 1 << 20
"""A producer that hands a record of at least this many bytes to its worker's loop waits
until the loop has taken it (copied it into a ring slot, sent or kept it) before it makes
the next, however many credits the consumers granted: fresh arrays made for each record
(a decoded batch) then reuse memory the CPU's caches still hold, instead of cycling through
one block per credit (zloader/worker/producer.py; fixed)."""

SPLIT_AHEAD_SECONDS = 0.05
"""A producer whose last split took less than this to read asks for its next split as soon
as one arrives (while it reads that one): short splits do not each wait for a round trip
through the broker. After a slower split it asks when done, so that the split it would
take does not wait behind a slow one while other workers are free."""

MAX_AHEAD = 256
"""``SPLIT_REQ.ahead``: at most this many splits wanted past the one asked for
(protocol)."""

MIX_AHEAD_SHARE = 64
"""A producer drawing a mix among the splits it holds (a mix its workers draw), in a job
not of one worker (``num_workers=1``), takes at most 1/64 of an input's splits ahead of
the one it reads (none of an input of fewer than 128): a worker that took many would leave
the others none of that input for a while, and their streams would go without it
(fixed)."""

SPLIT_AHEAD_WORK = 0.02
"""After a split that took less than this to read, a producer asks with the next one for
as many more as it would read in this time at that pace (SPLIT_REQ.ahead, at most
MAX_AHEAD): a pass of many tiny splits (a 200-element dataset in 200 splits) does not pay one round
trip through the broker per split, and a worker holds at most about this much work that
another free worker could have read (fixed)."""

WARM_PIPELINES = 4
"""A worker keeps at most this many pipelines it loaded (unpickled, their source data
fetched) warm by fingerprint after their jobs end, for the next job of the same pipeline
(zloader/shipping.py; fixed)..."""

WARM_SECONDS = 600.0
"""... each for this long since it was last used..."""

WARM_BYTES = 256 << 20
"""... and at most this many bytes of them pickled in all (fixed)."""

START_METHODS = ("fork", "spawn")
"""How a Loader's local workers start (``Loader(start_method=)``)."""

GATE_SECONDS = 10.0
"""A forked worker waits at most this long for its Loader's broker to be bound before it
connects anyway (zloader/embedded.py; fixed)."""

FORKER_MIN_WORKERS = 3
"""A Loader with at least this many forked workers forks them through the forker
(zloader/_process.py), fewer directly (fixed)."""

HANDOFF_MIN_ELEMENTS = 100_000
"""Lists of fewer elements than this in all are packed before the fork (or not at all: see
PACK_MIN_BYTES): at 0.15-0.5 us an element that is quicker than forking the packer
(zloader/handoff.py) from a large process (fixed)."""

PACK_MIN_BYTES = 16 << 20
"""... and not at all when each worker reading all of them would copy fewer bytes of their
objects than this (``packed.copied_bytes``): packing them before the fork would make the
first batch wait longer than the copy costs (fixed)."""

PACK_SAMPLE = 32
"""Elements of each list sampled to estimate the bytes a worker copies (fixed)."""

PACKER_NICE = 10
"""The packer runs this much nicer than the workers (zloader/handoff.py): on a host with
few cores it takes the CPU the workers' first batches leave (fixed)."""

HANDOFF_UNPACKED_READS = 2
"""A forked worker reads the dataset's large lists as they are for its first this many
splits or batches, then waits for their packed copy (zloader/handoff.py): the first
batches do not wait for the packer, and a fast pipeline does not copy the dataset's pages
while it runs (fixed)."""

HANDOFF_WAIT_SECONDS = 60.0
"""... for at most this long; then it reads the lists as they are, with a warning (fixed)."""

RECONNECT_FIRST_MS = 5
"""A connecting socket tries again this soon after a failed connection (ZeroMQ's default
is 100 ms: a worker forked before its Loader's broker binds would wait that long)..."""

RECONNECT_MAX_MS = 2000
"""... doubling each time up to this, so that a peer that stays away is not hammered
(fixed)."""

MAX_GRANT = 1 << 16
"""The most credits one CREDIT message may grant; more is taken as this many (fixed)."""

FETCH_TIMEOUT = 30.0
"""Seconds a worker waits for the Loader that serves a pipeline or source to answer
(fixed)."""

WORKER_IDLE_SECONDS = 1.0
"""The longest a worker's loop waits for a message when nothing needs it sooner (its next
heartbeat comes first where the broker's interval is shorter): how soon a worker sees
that its parent, a Loader's process, is gone (fixed)."""

FORWARD_EVERY = 0.2
"""Seconds between two sends of a worker's captured user output (fixed)."""

LOG_RATE = 20.0
"""Lines a second a worker forwards of its user output, sustained
(``zloader.forward.RATE``; fixed)."""

LOG_BURST = 200
"""Lines a worker may forward at once after a quiet spell (``zloader.forward.BURST``;
fixed)."""

LOG_MAX_LINE = 2000
"""Characters kept of a forwarded line; the rest is cut and marked
(``zloader.forward.MAX_LINE``; fixed)."""

LOG_MAX_LINES = 500
"""Lines in one LOG message; the broker refuses more (``zloader.forward.MAX_LINES``;
fixed)."""

MALLOC_ARENAS = 1
"""C allocator arenas of a worker process (glibc ``M_ARENA_MAX``): one, so that a block a
producer thread allocated and the loop thread freed is reused by the next record rather
than left in a thread's arena (zloader/worker/memory.py; fixed)."""

MALLOC_MMAP_THRESHOLD = 32 << 20
"""A worker process's C allocator serves blocks smaller than this from its heap, so that
freed ones are reused warm (glibc ``M_MMAP_THRESHOLD``; 32 MiB is glibc's largest;
fixed)."""

MALLOC_TRIM_THRESHOLD = 256 << 20
"""Freed heap memory a worker process keeps mapped for the next records before giving it
back to the kernel (glibc ``M_TRIM_THRESHOLD``; fixed)."""

MEMORY_ENTRIES = 2
"""Fetched pipelines (blobs) a worker process keeps in memory (fixed)."""

DISK_ENTRIES = 8
"""Fetched pipelines (blobs) a host's directory keeps; the oldest go first (fixed)."""

# --- sharing (zloader/sharing/) -----------------------------------------------------------

DEFAULT_BLOCK_SECONDS = 10.0
"""How long a shared job's window waits for its slowest trainer before the ``share_lag``
policy applies; ``Loader(share_block_seconds=)``."""

WINDOW_MIN = 64 << 20
"""Smallest default window of a shared job, per worker (``share_window_bytes=`` overrides
the default)."""

WINDOW_MAX = 4 << 30
"""Largest default window of a shared job, per worker (``share_window_bytes=`` overrides
the default)."""

PREFIX_HISTORY_BYTES = 64 << 20
"""A worker of a shared job that takes branches (trainers whose pipelines share a prefix,
docs/sharing.md) keeps the elements that passed its taps since the epoch began while they
fit in this many bytes (and in the job's ``share_window_bytes``): a trainer with another
suffix that comes meanwhile shares the whole epoch; one that comes later gets that epoch
made for it alone (fixed)."""
