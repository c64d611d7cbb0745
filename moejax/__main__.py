"""``python -m moejax serve MODEL [flags]``: the ``moejax`` command (moejax/cli.py)."""

import sys

from moejax.cli import main

sys.exit(main())
