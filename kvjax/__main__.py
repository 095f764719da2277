"""`python -m kvjax ...`: the `kvjax` command line (kvjax.cli)."""

import sys

from kvjax.cli import main

sys.exit(main())
