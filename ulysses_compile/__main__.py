"""``python -m ulysses_compile``: the command line (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
