"""zloader: ML input pipelines on CPU worker processes, local or remote, shared across trainers.

Importing ``zloader`` imports neither torch nor tensorflow; the adapters live in the
submodules ``zloader.torch`` and ``zloader.tf``, imported explicitly.
"""

from zloader._version import __version__
from zloader.client.session import PerWorker
from zloader.errors import (
    CodecError,
    FingerprintWarning,
    MixWindowWarning,
    PipelineError,
    Timeout,
    WorkerExited,
    ZloaderError,
)
from zloader.loader import Loader
from zloader.pipeline import Pipeline

__all__ = [
    "CodecError",
    "FingerprintWarning",
    "Loader",
    "MixWindowWarning",
    "PerWorker",
    "Pipeline",
    "PipelineError",
    "Timeout",
    "WorkerExited",
    "ZloaderError",
    "__version__",
]
