"""``python -m batchgate``: the same command line as ``batchgate``."""

import sys

from batchgate.gateway.cli import main

sys.exit(main())
