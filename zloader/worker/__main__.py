"""``python -m zloader.worker``: the same as ``zloader-worker`` (see ``--help``)."""

import sys

from zloader.cli import worker_main

sys.exit(worker_main())
