"""Tunables, in one place. Each is the default of a public argument or an internal limit."""

DEFAULT_SPLITS = 256
"""Index-addressed sources are cut into at most this many splits unless given split_size=."""

SHUFFLE_DRAW_CHUNK = 1024
"""A shuffle buffer draws its random indices this many at a time."""
