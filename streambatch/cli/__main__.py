"""``python -m streambatch.cli``: the ``shardify`` command."""

import sys

from . import main

sys.exit(main())
