"""``python -m bole``: the ``bole`` command."""

import sys

from bole.cli.main import main

sys.exit(main())
