"""Seeding rules: every random choice derives from (seed or run entropy, position, pass key).

A *pass key* names one pass over a part of the pipeline: ``(epoch,)`` at the top, with one
more number appended by each ``repeat`` above that part (its repetition index). A stage's
position (0 for the source, 1.. for the stages) keeps two stages with one seed apart.
"""

from __future__ import annotations

import numpy as np

Key = tuple[int, ...]


def make_rng(seed: int | None, entropy: int, position: int, key: Key) -> np.random.Generator:
    """The generator for one stage in one pass.

    Args:
        seed: the stage's seed; None means "use the run's entropy" (a fresh random order
            each time the pipeline is iterated).
        entropy: random bits drawn once per run, used when ``seed`` is None.
        position: the stage's position in the pipeline.
        key: the pass key; pass ``()`` for choices that must repeat on every pass.
    """
    base = entropy if seed is None else seed
    return np.random.default_rng(np.random.SeedSequence([base, position, len(key), *key]))
