"""``python -m csbp``: the same as the ``csbp`` command."""

import sys

from csbp.cli.main import main

sys.exit(main())
