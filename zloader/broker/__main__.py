"""``python -m zloader.broker``: the same as ``zloader-broker``."""

import sys

from zloader.cli import broker_main

sys.exit(broker_main())
