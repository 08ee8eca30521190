"""Every tunable, in one place: timeouts, intervals, sizes, limits, counts and ratios, and the
defaults of public arguments and command-line flags.

Each value says what it bounds and what overrides it ("fixed" when nothing does: change it
here). The modules that use a value import it from here (most keep its name as a module
attribute, so ``zloader.worker.links.STOP_SECONDS`` still reads). Not here: protocol
constants (commands, versions, magic numbers, record layouts) and enumerations of choices;
tests/test_package.py checks that no other module defines a numeric constant outside its
short allow-list. This module imports nothing: every layer may import it.
"""

# --- pipeline: sources, stages, pickling, fingerprints ------------------------------------

DEFAULT_SPLITS = 256
"""Index-addressed sources are cut into at most this many splits; ``split_size=`` of a
source overrides it."""

SHUFFLE_DRAW_CHUNK = 1024
"""A shuffle buffer draws its random indices this many at a time (fixed)."""

CHUNK_ELEMENTS = 256
"""The most elements handed on at once to a stage that takes them in bulk (a shuffle, a
batch: zloader/chunks.py), gathered while they come quickly and are light."""

LIGHT_BYTES = 4096
LIGHT_ITEMS = 8
"""Elements read ahead into a chunk are light: numbers, None, strings, bytes and numpy
arrays of at most LIGHT_BYTES, or tuples, lists and dicts of at most LIGHT_ITEMS of those;
any other is read when it is used (zloader/lineage/tags.py ``light``)."""

ORIGINS_NAMED = 4
"""Origins an error message names, of a batch's many (fixed)."""

MAX_SEARCH_DEPTH = 12
"""How deep the search for what cannot be pickled follows references from a stage to the
value at fault (zloader/_pickling.py; fixed)."""

LABEL_LIMIT = 256
"""Characters in a name, version or job name (``job_name=``, ``Pipeline.named``): they travel
in every control message (fixed)."""

PACK_MIN_ITEMS = 4096
"""A forked worker reads a list or tuple of at least this many atoms (or tuples and dicts of
atoms) held by its source or dataset from shared memory, packed before the fork
(zloader/packed.py); shorter ones it reads as they are. ``Loader(pack_dataset=False)``
packs none."""

PACK_MAX_DEPTH = 4
"""How deep the packer looks into an element's tuples and dicts for atoms; an element
nested deeper is not plain data, and its list is left as it is (fixed)."""

PACK_DATASET_DEPTH = 3
"""Datasets held by a dataset (``Subset.dataset.dataset``) whose attributes are packed, at
most this deep (fixed)."""

PACK_CHUNK_ITEMS = 1 << 16
"""Elements marshalled at once while packing: bounds the packer's temporary objects
(fixed)."""

FINGERPRINT_MAX_DEPTH = 400
"""Deepest nesting of values a pipeline fingerprint follows; deeper raises ``Unhashable``
(``zloader.fingerprint.MAX_DEPTH``; fixed)."""

STAGES = ("pipeline", "splits", "encode", "blocked")
"""Where a worker's producers spend their time, in seconds: running the pipeline (user code
and the source), waiting for the broker's splits, encoding records, and blocked for want of
credits (the consumers are slower). Reported in heartbeats, summed per job by the broker."""

# --- file formats and storage (zloader/formats/, zloader/storage.py) ----------------------

READ_BLOCK_BYTES = 1 << 20
"""Bytes a file source reads from storage at a time (the streaming buffer of a local file
or an fsspec URL: a shard is never read whole); fixed."""

STORAGE_RETRIES = 5
"""Attempts of one storage operation (stat, glob, open, read) that failed with a transient
error (a connection error, a timeout, a 5xx) before the source fails naming the URL;
fixed."""

STORAGE_BACKOFF = 0.05
"""Seconds before the first retry of a storage operation; each retry waits twice as long,
up to ``STORAGE_BACKOFF_MAX``, with jitter (fixed)."""

STORAGE_BACKOFF_MAX = 2.0
"""Longest wait between two retries of a storage operation, in seconds (fixed)."""

PARQUET_READ_ROWS = 4096
"""Rows ``from_parquet`` reads from a row group at a time when it yields rows
(``batch_rows=`` sets it when it yields batches); fixed."""

PARALLEL_READ_BUFFER = 64
"""Elements each reader thread of ``parallel_reads=k`` holds ahead of the interleave (so k
readers hold at most k times this); fixed."""

PARALLEL_READ_POLL = 0.1
"""Seconds a reader thread of ``parallel_reads=k`` waits on a full buffer before it checks
whether the read was abandoned (fixed)."""


# --- file formats: what one element may take, slow storage (docs/sources.md) -----------------

MAX_RECORD_BYTES = 256 << 20
"""Largest TFRecord record ``from_tfrecord`` reads; a length field above it is a corrupt
record (it ends the file), never an allocation. ``from_tfrecord(max_record_bytes=)``
overrides it."""

MAX_MEMBER_BYTES = 256 << 20
"""Largest tar member ``from_webdataset`` reads (its size as the tar header states it,
sparse members included); a larger one makes its sample an error, or ends the shard when
skipping it would mean inflating it (a compressed shard, or one of unknown size).
``from_webdataset(max_member_bytes=)`` overrides it."""

MAX_TAR_HEADER_BYTES = 1 << 20
"""Most bytes the headers of one tar member may take in ``from_webdataset`` (its PAX and
GNU long-name headers and sparse map, which tarfile reads whole); more ends the shard with
an error. No tar writer comes near it (a long path takes a few KiB); fixed."""

MAX_LINE_BYTES = 16 << 20
"""Longest line ``from_jsonl`` reads, in bytes after decompression; a longer one is an
error for that line only (the parsed value may take several times the line's size).
``from_jsonl(max_line_bytes=)`` overrides it."""

MAX_IMAGE_PIXELS = 1 << 26
"""Most pixels (width x height, 8192 x 8192) ``decode_image`` decodes; the size is read from
the image's header before any pixel is. ``decode_image(max_pixels=)`` and
``from_image_folder(max_pixels=)`` override it; Pillow refuses, on its own, images over
twice ``PIL.Image.MAX_IMAGE_PIXELS``."""

STORAGE_WAIT_WARNING = 5.0
"""Seconds a storage operation (list, stat, open, seek, read) may wait, retries included,
before a warning names the URL and what is waited for; the module attribute
``zloader.storage.STORAGE_WAIT_WARNING`` overrides it."""

STORAGE_WAIT_REPEAT = 30.0
"""Seconds between the next warnings about one storage operation still waiting; the module
attribute ``zloader.storage.STORAGE_WAIT_REPEAT`` overrides it."""


# --- the cache (Pipeline.cache, zloader/cache.py) -------------------------------------------

CACHE_DIR_VARIABLE = "ZLOADER_CACHE_DIR"
"""The environment variable naming the cache folder of ``Pipeline.cache()`` without a path
and of ``zloader cache`` without one; when unset, ``$XDG_CACHE_HOME/zloader/cache`` (or
``~/.cache/zloader/cache``)."""

CACHE_STALE_SECONDS = 3600.0
"""A temporary cache file untouched this long is a writer's leftover (it was killed midway):
``zloader cache rm --stale`` removes it (``--older-than``)."""

CACHE_MAX_ENTRY_BYTES = 2 << 30
"""Largest cache entry (one split's output) a worker writes or reads back, in bytes: an
entry is read into the worker's memory whole, so this bounds what one read allocates,
whatever sizes the file claims. A split whose output grows past it is read without caching
(with a warning); a larger entry already there is ignored and its split computed.
``Pipeline.cache(max_entry_bytes=)`` sets it per cache."""


# --- codec: limits of an encoded element --------------------------------------------------

CODEC_MAX_DEPTH = 100
"""Deepest nesting of containers an element may have, encoded or decoded (deeper usually
means a cycle; ``zloader.codec.MAX_DEPTH``; fixed)."""

CODEC_INLINE_MAX = 1024
"""``str``/``bytes`` up to this many bytes travel inside a record's header, longer ones as
buffers of their own (``zloader.codec.INLINE_MAX``; fixed)."""

CODEC_MAX_BIGINT_BYTES = 1024
"""Widest Python int an element may hold, in bytes (fixed)."""

CODEC_MAX_NDIM = 32
"""Most dimensions of an array in an element (fixed)."""

# --- client: the Loader and its I/O thread ------------------------------------------------

DEFAULT_TIMEOUT = 60.0
"""Seconds a Loader waits for data (or a worker with credits stays silent) before it raises
``Timeout``; ``Loader(timeout=)``."""

DEFAULT_PREFETCH = 8
"""Records in flight per worker for one consumer; ``Loader(prefetch=)`` (None means this)."""

HEARTBEAT = 1.0
"""Seconds between heartbeats: the broker's default (``Broker(heartbeat=)``,
``zloader-broker --heartbeat``), and what workers and consumers use until the broker says
its own."""

WORKER_STOP_SECONDS = 3.0
"""How long closing an embedded Loader waits for each of its worker processes to leave
before it kills it (fixed)."""

POLL_SECONDS = 0.1
"""How often a wait for data checks the Loader's timeout (fixed)."""

LOST_GRACE_SECONDS = 1.0
"""When one of an embedded Loader's own workers died and the epoch cannot complete without
it, the Loader raises WorkerExited once it has waited this long for data: what the worker
sent before it died is yielded first (fixed)."""

SMALL_ORIGIN_BLOCK = 32
"""An exactly-once record with at most this many origins (or an origin block of at most
this many int64s) is encoded and checked in plain Python, not numpy: for few values numpy's
per-call cost is the larger (fixed)."""

LEAVE_GRACE_SECONDS = 5.0
"""How long a consumer of a job without exactly-once still reads a worker its job's view
no longer lists and that has not ended the epoch: a worker moved to another job sends
what it made before it moves, and the broker's view can arrive first (fixed)."""

SCATTER_SAMPLE = 17
"""How many of a record's first origin codes the producer looks at to choose how its
origin block carries them: runs when they make runs of four or more on average, else the
codes themselves (a shuffle's; fixed: zloader/lineage/wire.py ``encode_origins``)."""

LEDGER_FOLD_RECORDS = 64
LEDGER_FOLD_RUNS = 65536
"""A consumer's ledger of origins adds the records it is given this many at a time, or
once they hold LEDGER_FOLD_RUNS runs (or when it is read): one merge per split for many
small records, not one per record, and the runs of large ones merged while they are still
in the CPU's caches (fixed)."""

MERGE_COUNT_RUNS = 4096
MERGE_PLACES = 16
MERGE_SPAN_FACTOR = 2
MERGE_SPAN_SLACK = 1 << 16
"""A ledger merges MERGE_COUNT_RUNS runs or more of up to MERGE_PLACES splits by counting
(linear time) when each split's runs span at most MERGE_SPAN_FACTOR times as many indices
as there are runs, plus MERGE_SPAN_SLACK; by sorting otherwise, fewer runs included (a
few numpy calls per split cost more than their sort) (fixed: zloader/lineage/
``merge_runs``)."""

CHECK_SECONDS = 0.05
"""A consumer's loop looks for leaving workers whose grace is over at most this often, not
at every step (each check looks at every worker), and for stuck ones this often while its
epoch has not begun (then when one can next be stuck; fixed)."""

NOTICE_HOLD_SECONDS = 1.0
"""How long a consumer holds back a record whose notice came before a DATA message its
worker sent earlier (transport/notice.py) before it takes it anyway: that message was lost
on the way, and the worker's stream must not stop for it (fixed)."""

POLL_MS = 50
"""Milliseconds the I/O thread's poll of its sockets waits before it looks again at its
commands and heartbeats (fixed). Commands wake it at once, except credits given back short
of a CREDIT message's worth (half the prefetch): those wait for its next wake-up."""

SMALL_COPY = 4096
"""A record's buffers up to this many bytes are copied into its ring slot by a memoryview
assignment (cheaper to start); larger ones by numpy, which releases the GIL while it
copies (fixed)."""

LEND_SECONDS = 0.02
"""How long a consumer's I/O thread leaves its sockets to the iterating thread after that
thread last read them itself (it does while it waits for data, so that a record needs no
handoff between threads): a trainer back for its next element within this time finds
them free; one that is away longer has the I/O thread read ahead for it (fixed)."""

BYE_LINGER_MS = 200
"""At most how long closing a Loader waits for its BYE to reach the broker, in
milliseconds (fixed)."""

RING_MAX_BYTES = 1 << 30
"""A ring that keeps filling up with large records grows, by doubling, up to this size;
``Loader(ring_bytes=)`` sets where it starts (fixed)."""

VACANT_WARNING = 10.0
"""Seconds a coordinated consumer waits for a missing one before it says so, then again
(fixed)."""

SILENT_BROKER_WARNING = 5.0
"""Seconds a Loader sends REGISTER without an answer before it warns, naming the broker's
address, then again every ``SILENT_BROKER_REPEAT`` seconds until the timeout (fixed)."""

SILENT_BROKER_REPEAT = 15.0
"""Seconds between the warnings of a Loader whose broker does not answer (fixed)."""

REREADS = 3
"""Times an exactly-once epoch that ended short asks for a split again before it raises
(fixed)."""

INLINE_SOURCE_BYTES = 1 << 20
"""In-memory sources larger than this reach workers from the Loader (``FETCH``), not via
the broker (fixed)."""

INLINE_PIPELINE_BYTES = 1 << 20
"""Pickled pipelines larger than this reach workers from the Loader (``FETCH``), not via
the broker (fixed)."""

# --- adapters: torch, tensorflow ----------------------------------------------------------

STACK_LATER_BYTES = 1 << 16
"""Tensors of a batch that hold at least this many bytes in all are copied once, straight
into shared memory, instead of being stacked first (fixed)."""

PREFETCH_STOP_SECONDS = 10.0
"""How long closing a pinning/copying iterator waits for its thread to leave a batch
(fixed)."""

TF_PROBE = 2
"""Elements ``zloader.tf.dataset`` runs in this process to infer the output signature
(``probe=``)."""

# --- broker -------------------------------------------------------------------------------

HEARTBEAT_RANGE = (0.05, 60.0)
"""Heartbeat intervals a broker may use, in seconds (bounds ``zloader-broker
--heartbeat``; a peer refuses an announced interval outside it)."""

LIVENESS = 3
"""Heartbeats a peer may miss before the broker takes it for dead (``State(liveness=)``)."""

KILLS_TO_FAIL = 3
"""A split that was being read by a dying worker this many times is reported, not re-run
(fixed)."""

FENCE_GRACE = 10
"""Expiries (``liveness`` heartbeats each) a fence waits for a consumer that went silent: a
stalled consumer that comes back still answers, so what it holds is not read again
(fixed)."""

COMPACT_LINES = 100_000
"""The journal is rewritten without collected jobs once it has this many lines (fixed)."""

KEEP_EPOCHS = 2
"""Epochs before a coordinated job's current one whose round counts are kept, for late
consumers (fixed)."""

KEEP_RESOLVED = 4096
"""Recently committed or lost rounds remembered, to answer a consumer that asks again
(fixed)."""

START_TIMEOUT = 10.0
"""How long starting a broker thread waits for its socket to be bound
(``Broker.start(timeout=)``)."""

CLOSE_SECONDS = 5.0
"""How long closing a broker thread waits for its loop to stop (``Broker.close(timeout=)``)."""

BROKER_BEATS_AT_ONCE = 100
"""The broker sends its workers' HEARTBEATs this many at a time, reading what came in
between: a fleet's thousand beats in one go would hold up every answer behind them."""

BROKER_POLL_SECONDS = 0.05
"""The broker loop's longest wait for a message: how soon it sees ``close()`` (an embedded
Loader's close waits for it)."""

# --- broker: floods and exhaustion (docs/reliability.md, "Floods") ------------------------

MAX_JOBS = 1024
"""Jobs a broker holds at once; a REGISTER of one more is refused with ERROR
(``zloader-broker --max-jobs``, ``Limits.jobs``)."""

MAX_PEER_JOBS = 16
"""Jobs one connection (a consumer's socket) may have made and still hold; a Loader makes
one (``zloader-broker --max-peer-jobs``, ``Limits.peer_jobs``)."""

MAX_PIPELINE_BYTES_HELD = 256 << 20
"""Bytes of pickled pipelines a broker keeps for its jobs, all together (a Loader sends at
most INLINE_PIPELINE_BYTES; larger ones its workers fetch from it): ``zloader-broker
--max-pipeline-bytes``, ``Limits.pipeline_bytes``."""

MAX_PEER_PIPELINE_BYTES = 32 << 20
"""Bytes of pickled pipelines the jobs of one connection may hold in the broker
(``zloader-broker --max-peer-pipeline-bytes``, ``Limits.peer_pipeline_bytes``)."""

UNHEARD_BEATS = 2
"""A consumer that has sent nothing since its REGISTER (no HEARTBEAT, no EPOCH) for this
many heartbeats is taken for one that does not read: its job has no claim on the pool's
busy workers until it does (a Loader's first heartbeat comes within one; a flood's
REGISTERs never read; fixed)."""

BROKER_TURN_SECONDS = 0.05
"""The longest the broker reads messages before it looks at its timers (heartbeats, the
tick that places workers): a flood of requests delays them by this much at most (fixed)."""

REFUSALS_LOGGED_EVERY = 5.0
"""Seconds between two log lines about refused REGISTERs (the count is in STATUS; fixed)."""

STATUS_REPLY_BYTES = 768 << 10
"""Bytes of workers and jobs one STATUS reply carries, at most; the rest is counted, and
asked for with ``from`` (``zloader status --all``; fixed: below MAX_BODY_BYTES)."""

STATUS_LIST_ITEMS = 64
"""Entries of a list inside one job of a STATUS reply (a shared job's trainers, the
hosts of its consumers); the rest is counted (fixed)."""

HANDSHAKE_SECONDS = 10.0
"""A connection to the broker that has not finished its ZeroMQ handshake (the security
handshake, with keys) within this long is closed (ZMQ_HANDSHAKE_IVL; fixed)."""

BROKER_SEND_WAIT_SECONDS = 10.0
"""How long a worker waits for room in its queue to the broker, once the broker has
answered on that connection, before it gives up saying the broker is not reading."""

DESCRIPTORS_LOW = 0.9
"""Share of the broker process's file-descriptor limit in use at which it warns, and drops
connections that have not finished their handshake, oldest first (fixed)."""

DESCRIPTORS_IDLE_SECONDS = 0.5
"""A connection without a finished handshake this old may be dropped when descriptors run
low: an honest peer's takes milliseconds (fixed)."""

DESCRIPTORS_CHECK_SECONDS = 0.25
"""Seconds between two counts of the broker's open descriptors while connections come in,
and at each heartbeat otherwise (fixed)."""

DESCRIPTORS_WARN_SECONDS = 10.0
"""Seconds between two warnings that descriptors run low (fixed)."""

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

HANDOFF_MIN_ELEMENTS = 100_000
"""Lists of fewer elements than this in all are packed before the fork (or not at all: see
PACK_MIN_BYTES): at about 0.5 us an element that is quicker than forking the packer
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
"""Largest JSON body of a control message (fixed)."""

MAX_BODY_DEPTH = 32
"""Bodies nested deeper than this are refused (real ones nest 11 deep at most): a handler,
or the journal re-encoding a body, must never recurse near Python's limit (fixed)."""

MAX_PIPELINE_BYTES = 8 << 20
"""Pipeline definitions larger than this are refused by the broker; see docs/protocol.md
(fixed)."""

MESSAGE_SLACK_BYTES = 4096
"""Room for a message's other frames (command, version, ids) above its body and pipeline."""

MAX_MESSAGE_BYTES = MAX_PIPELINE_BYTES + MAX_BODY_BYTES + MESSAGE_SLACK_BYTES
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

HANDOVER_SERVED = 4096
"""The most served trainers one entry of a handover names (with HANDOVER_SPLITS splits,
well within MAX_BODY_BYTES; a shared job has a handful; fixed)."""

MAX_HANDOVER_ENTRIES = 4096
"""The most handover entries the broker keeps for one drained worker (``HEARTBEAT.handover``:
134 M splits; fixed)."""

# --- autoscaling and actuators (zloader/broker/autoscale.py, zloader/actuator.py) ----------------

AUTOSCALE_UP = 0.07
"""Starvation above which the autoscaler adds a worker, and the gain each addition must
buy to be followed by another (``Autoscaler(up=)``)."""

AUTOSCALE_DOWN = 0.03
"""Starvation below which the autoscaler removes a worker, and the cost a removal may have
(``Autoscaler(down=)``)."""

AUTOSCALE_COOLDOWN = 30.0
"""Seconds of starvation samples between two changes of a job's desired workers
(``Broker(cooldown=)``, ``zloader-broker --autoscale-cooldown``)."""

AUTOSCALE_MIN_WORKERS = 1
"""Fewest workers the autoscaler asks for a job (``Autoscaler(min_workers=)``)."""

AUTOSCALE_MAX_WORKERS = 4096
"""Most workers the autoscaler asks for a job (``Autoscaler(max_workers=)``); the fleet's
own limits (an actuator's ``--max-processes``, ``max_workers``) hold it lower: an addition
they do not carry out is given up and becomes a ceiling for a while."""

AUTOSCALE_HOLD = 10
"""Cooldowns a floor or ceiling set by an undone step first lasts, then doubles
(``Autoscaler(hold=)``)."""

START_SECONDS = 60.0
"""How long actuators get to add the workers asked for (two cooldowns if longer): a new
process starts in a second, a Ray actor or a Kubernetes pod can take much longer
(fixed)."""

ACTUATOR_EXPIRY = 10.0
"""Seconds after an actuator's last status request that the broker stops counting its cap
(``STATUS.actuator``) in the fleet's (fixed)."""

MAX_ACTUATOR_CAP = 1 << 20
"""The largest cap an actuator may report (``STATUS.actuator.cap``; fixed)."""

ACTUATOR_INTERVAL = 1.0
"""Seconds between two looks of an actuator at the broker's status
(``zloader-worker --autoscale-interval``, ``ProcessActuator(interval=)``,
``zloader.ray.Autoscaler(interval=)``)."""

REMOTE_DELAY = 5.0
"""Seconds a shortfall lasts before an actuator grows without consumers of the job on its
host (``remote_delay=`` of the process and Ray actuators)."""

RESTART_DELAY = 1.0
"""Seconds ``zloader-worker --processes N`` waits before replacing a worker process that
died; doubled at each death of that slot's processes, up to ``RESTART_MAX_DELAY``, so a
process that always dies does not spin (``--restart-delay``)."""

RESTART_MAX_DELAY = 60.0
"""The longest wait before ``zloader-worker --processes N`` replaces a dead worker process
(``--restart-max-delay``)."""

RESTART_RESET_SECONDS = 60.0
"""A worker process that ran this long before it died is replaced after
``RESTART_DELAY`` again, not after its slot's doubled delay (fixed)."""

SUPERVISE_POLL = 0.2
"""Seconds between two looks of ``zloader-worker --processes N`` at its children (fixed)."""

ACTOR_READY_SECONDS = 30.0
"""How long a Ray worker actor asked for its worker's id waits for the worker's loop to
run (fixed)."""

RAY_START_TIMEOUT = 120.0
"""Seconds ``zloader.ray.start_workers`` waits for every actor to run
(``start_timeout=``)."""

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

# --- pool: several jobs on one pool of workers (zloader/broker/pool.py) -------------------

SLICE_SECONDS = 1.0
"""A worker pool with more hungry jobs than workers time-slices: a job with no worker takes
one that has served another job this long (fixed)."""

MAX_FANOUT = 1 << 16
"""``JobOptions.balanced`` and ``num_consumers`` (``Loader(balanced=, num_consumers=)``):
at most this many consumers."""

WEIGHT_RANGE = (0.001, 1000.0)
"""``Loader(weight=)``, ``REGISTER.options.weight``: a job's share of the pool relative to other
jobs' lies in this range (docs/pool.md)."""

HUNGRY_STARVATION = 0.02
"""A job whose consumers waited for data more than this share of the last heartbeat
interval is hungry: the pool may move a worker to it (fixed)."""

HUNGRY_HOLD_BEATS = 3
"""A job sampled hungry stays hungry for this many heartbeat intervals, whatever the next
samples say: one low sample (heartbeats read late by a busy broker) must not make it give
its workers away and take them back a second later (fixed)."""

MOVES_PER_SECOND = 32.0
"""Workers the pool moves between jobs, at most, per second (a burst of as many at once):
a fleet's rebalancing goes at this pace, so one decision never moves hundreds of workers
in a tick, and a late broker never churns the fleet (docs/pool.md; fixed)."""

OVERDRAW_RECORDS = 1 << 16
"""Records a worker draining to move may make and send beyond its consumers' credits (it
finishes the splits it took; their remainder is far less)."""

MOVE_DRAIN_SECONDS = 10.0
"""A worker the pool moves off a job that does not run exactly-once first finishes the
splits it took (``RELEASE.drain``); one not done within this many seconds is moved at
once, and its split under way is read again by the job's other workers (docs/pool.md)."""

# --- command line and demo ----------------------------------------------------------------

STATUS_TIMEOUT = 5.0
"""Seconds ``zloader status`` and ``zloader top`` wait for the broker (``--timeout``)."""

TOP_INTERVAL = 2.0
"""Seconds between two refreshes of ``zloader top`` (``--interval``)."""

DEMO_IMAGES = 20000
"""Images ``zloader demo`` runs (``--images``)."""

DEMO_PIPELINE_IMAGES = 4096
"""Images of ``zloader.demo.demo_pipeline`` (``images=``)."""

DEMO_BATCH_SIZE = 64
"""Batch size of ``zloader demo`` and ``demo_pipeline`` (``--batch-size``)."""

DEMO_SIZE = 64
"""Image side of ``zloader demo`` and ``demo_pipeline`` (``--size``)."""

DEMO_WORKERS = 2
"""Worker processes of ``zloader demo`` (``--workers``)."""

DEMO_DISTINCT = 64
"""Distinct encoded images the demo source cycles through (fixed)."""


# --- mixing (zloader/mixing.py) -------------------------------------------------------------

MIX_KEY = 1 << 40
"""The pass keys of a mix's input ``k`` hold ``MIX_KEY + k`` (pass keys are otherwise epochs
and repetition counts, far below it; fixed: workers, brokers and journals must agree)."""

GROUP_KEY = 1 << 41
"""A *group* (the source elements of one batch that a map turned into another number of
rows, zloader/lineage/) has its rows' origins in a pass of its own: the anchor's pass
key, then ``GROUP_KEY + position`` (the unbatch's position) and the anchor's index
(fixed, above every ``MIX_KEY + k``: workers, brokers and journals must agree)."""

MAX_GROUP_MEMBERS = 1 << 20
"""The most source elements one group may hold (a batch's rows before a map that changes
their number); a record or state naming more is malformed (fixed)."""

MIX_DRAW_CHUNK = 1024
"""A mix draws this many inputs at once (one numpy call); the unused rest is drawn again
when an input ends (fixed)."""

MAX_MIX_INPUTS = 4096
"""The most inputs one mix may have (``REGISTER.source.inputs``; fixed)."""

