"""The Loader's tunables, its adapters' (torch, tensorflow), and the command line's and the
demo's defaults. (part of :mod:`zloader._defaults`)."""

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

SMALL_INDEX_SET = 256
"""A set of at most this many indices (a group's rows held, in a state) is made ranges in
plain Python, not numpy (fixed)."""

LEAVE_GRACE_SECONDS = 5.0
"""How long a consumer of a job without exactly-once still reads a worker its job's view
no longer lists and that has not ended the epoch: a worker moved to another job sends
what it made before it moves, and the broker's view can arrive first (fixed)."""

SCATTER_SAMPLE = 17
"""How many of a record's first origin codes the producer looks at to choose how its
origin block carries them: runs when they make runs of four or more on average, else the
codes themselves (a shuffle's; fixed: zloader/lineage/wire.py ``encode_origins``)."""

LEDGER_FOLD_RECORDS = 256
LEDGER_FOLD_RUNS = 65536
"""A consumer's ledger of origins adds the records it is given this many at a time, or
once they hold LEDGER_FOLD_RUNS runs (or when it is read): one merge per split for many
small records, not one per record, and the runs of large ones merged while they are still
in the CPU's caches. Each fold walks the ranges a split holds (a shuffle leaves one per
element its buffer holds back): 256 walks them a quarter as often as 64 did, and holds
at most 512 KiB of a shuffle's codes meanwhile (fixed)."""

MERGE_COUNT_RUNS = 4096
MERGE_PLACES = 16
MERGE_SPAN_FACTOR = 2
MERGE_SPAN_SLACK = 1 << 16
"""A ledger merges MERGE_COUNT_RUNS runs or more of up to MERGE_PLACES splits by counting
(linear time) when each split's runs span at most MERGE_SPAN_FACTOR times as many indices
as there are runs, plus MERGE_SPAN_SLACK; by sorting otherwise, fewer runs included (a
few numpy calls per split cost more than their sort) (fixed: zloader/lineage/
``merge_runs``)."""

MERGE_BITMAP_FACTOR = 64
MERGE_BITMAP_SLACK = 1 << 16
"""The compiled fold of a shuffle's codes into a ledger (zloader/_core.pyx
``merge_indices``) marks them in a bitmap of their span when it holds at most
MERGE_BITMAP_FACTOR bits per code, plus MERGE_BITMAP_SLACK; it leaves thinner ones to the
pure twin's sort (fixed)."""

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

PERMUTATION_MIN_SAMPLES = 1 << 16
"""torch's shuffles of at least this many samples have their first indices emulated while
torch draws the whole permutation on a thread (zloader/torch/permutation.py): drawn on a
quiet core, 3 M samples take 40-64 ms and 200,000 about 1.5 ms, against 1.3 ms for the
emulation's start; but a shuffle is drawn while the workers start, and there 200,000
took 11 ms before the first batch of bench.startup's 2-worker case on 2 cores (fixed)."""

PERMUTATION_AHEAD = 1 << 14
"""... for at most this many indices: the thread starts once a quarter of them are taken
(the first batches are out by then), and the trainer waits for torch's whole permutation
past them (fixed)."""

PERMUTATION_NICE = 10
"""That thread runs this much nicer than the trainer's others: on a host with few cores
the workers go first (fixed)."""
