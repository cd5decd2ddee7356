"""``python -m asyncflow``: the ``asyncflow`` command."""

import sys

from asyncflow.cli import main

sys.exit(main())
