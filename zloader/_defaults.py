"""Tunables, in one place. Each is the default of a public argument or an internal limit."""

DEFAULT_SPLITS = 256
"""Index-addressed sources are cut into at most this many splits unless given split_size=."""

SHUFFLE_DRAW_CHUNK = 1024
"""A shuffle buffer draws its random indices this many at a time."""

STAGES = ("pipeline", "splits", "encode", "blocked")
"""Where a worker's producers spend their time, in seconds: running the pipeline (user code
and the source), waiting for the broker's splits, encoding records, and blocked for want of
credits (the consumers are slower). Reported in heartbeats, summed per job by the broker."""

DRAIN_SECONDS = 30.0
"""A draining worker (SIGTERM) leaves after this long even with splits unfinished."""

SLICE_SECONDS = 1.0
"""A worker pool with more hungry jobs than workers time-slices: a job with no worker takes
one that has served another job this long (zloader/broker/pool.py)."""

HUNGRY_STARVATION = 0.02
"""A job whose consumers waited for data more than this share of the last heartbeat
interval is hungry: the pool may move a worker to it (zloader/broker/pool.py)."""
