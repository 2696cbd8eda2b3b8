"""``python -m batchgate.gateway``: the same command line as ``batchgate``."""

import sys

from batchgate.gateway.cli import main

sys.exit(main())
