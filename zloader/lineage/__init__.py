"""Where each element came from: the bookkeeping behind exactly-once epochs.

With dynamic sharding (no sharing, coordination or balancing) a worker tags every source
element with its *origin*: (pass, split, index), the index counting the elements the
source yields for that split. Stages carry the tags (docs/reliability.md):

- a map keeps its input's tag; a shuffle moves tags with their elements;
- a batch holds the tags of its rows; an unbatch gives each row its own back;
- an element dropped on the way (a filter, ``on_error="skip"``, a dropped remainder) is
  still *accounted for*: its tag rides with the next record as a loose origin.

The consumer keeps a :class:`Ledger` of what it received and of what it yielded. When a
worker dies, the broker asks the consumers which elements of its splits they hold and hands
the splits out again with those indices to skip; ``Loader.state_dict()`` is the yielded
ledger. Re-reading a split this way needs the source to yield the same elements for it each
time: a worker re-reading a split checks the count and a digest of what it read against the
first reading and reports a difference as a :class:`~zloader.errors.PipelineError`.

One module per job, each used by other layers through this package:

- :mod:`~zloader.lineage.tags`: tagging at read time (the worker's source reads, the
  stages' gathering of a batch's tags, the reproducibility digest);
- :mod:`~zloader.lineage.wire`: origins on the wire (a record's origin block);
- :mod:`~zloader.lineage.intsets`: sets of ints as short strings (in JSON bodies, states);
- :mod:`~zloader.lineage.ranges`: sets of indices as ranges, and the merges of many
  records' origins into them;
- :mod:`~zloader.lineage.ledger`: the consumer's ledger, and the broker's merge of what the
  consumers hold.
"""

from zloader.lineage.intsets import pack, unpack
from zloader.lineage.ledger import Ledger, merge_info
from zloader.lineage.ranges import Ranges, merge_indices, merge_runs
from zloader.lineage.tags import (
    DIGEST_GROUP,
    DIGEST_MARK,
    INDEX_BITS,
    INDEX_MASK,
    Assigned,
    Group,
    MemberRuns,
    Origin,
    Tagged,
    anchor_split,
    code,
    digest,
    exactly_once,
    gather,
    group_of_rows,
    light,
    read_split,
    read_split_chunks,
    split_tags,
    take,
    untag,
)
from zloader.lineage.wire import Origins, decode_origins, encode_origins, runs_of_list

__all__ = ["DIGEST_GROUP", "DIGEST_MARK", "INDEX_BITS", "INDEX_MASK", "Assigned", "Group",
           "Ledger", "MemberRuns", "Origin", "Origins", "Ranges", "Tagged", "anchor_split", "code",
           "decode_origins", "digest", "encode_origins", "exactly_once", "gather",
           "group_of_rows", "light", "merge_indices", "merge_info", "merge_runs", "pack",
           "read_split", "read_split_chunks", "runs_of_list", "split_tags", "take", "unpack",
           "untag"]
