"""Every tunable, in one place: timeouts, intervals, sizes, limits, counts and ratios, and the
defaults of public arguments and command-line flags.

Each value says what it bounds and what overrides it ("fixed" when nothing does: change it
here). The modules that use a value import it from here (most keep its name as a module
attribute, so ``zloader.worker.links.STOP_SECONDS`` still reads). Not here: protocol
constants (commands, versions, magic numbers, record layouts) and enumerations of choices;
tests/test_package.py checks that no other module defines a numeric constant outside its
short allow-list. The values live in one module per role (``pipeline``, ``client``,
``broker``, ``worker``, ``transport``), each re-exported here; the package imports nothing
else: every layer may import it.
"""

from zloader._defaults.broker import *  # noqa: F403
from zloader._defaults.client import *  # noqa: F403
from zloader._defaults.pipeline import *  # noqa: F403
from zloader._defaults.transport import *  # noqa: F403
from zloader._defaults.worker import *  # noqa: F403
