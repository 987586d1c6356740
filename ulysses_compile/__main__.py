"""``python -m ulysses_compile``: the command line (see ``cli.py``)."""

import sys

from ulysses_compile.cli import main

sys.exit(main())
