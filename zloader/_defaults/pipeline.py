"""The pipeline's tunables: sources, stages, pickling, fingerprints, file formats and
storage, the cache, the codec's limits, mixing. (part of :mod:`zloader._defaults`)."""

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

ZSTD_PIECE_BYTES = 1 << 10
"""Compressed bytes of a zstd file inflated at once (zloader/formats/compressed.py): at
most 32 MiB of output however the file was made (a zstd block of 128 KiB may take 4
bytes); measured, a 10 KB file of 40 M empty JSON lines inflates at most 11 MB a piece
(92 MB with 8 KiB pieces), and 44 MB of text 0.16 s instead of 0.11; fixed."""

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

MIX_SPREAD_SPLITS = 16
"""A mix that its workers draw (docs/semantics.md, "Mixing") reads each input that is not
addressed by index (files, a generator) of fewer splits in at least this many interleaved
parts, each of which reads the whole split and keeps its share, so that every worker
holds some of each input; one addressed by index is cut into DEFAULT_SPLITS (zloader/plan.py
``spread``; fixed)."""

MAX_MIX_INPUTS = 4096
"""The most inputs one mix may have (``REGISTER.source.inputs``; fixed)."""

MAX_STAGES = 1024
"""The most stages a shared job's prefix fingerprints may name (``REGISTER.prefixes``:
one per stage of the worker part, and the source's); a trainer whose pipeline has more
does not share a prefix, only a whole pipeline (fixed)."""

MAX_BRANCHES = 64
"""The most branches (trainers' pipelines that share a prefix with its own) one shared job
takes; a trainer whose pipeline would be one more gets a job of its own (fixed)."""
