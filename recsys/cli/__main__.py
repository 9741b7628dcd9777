"""``python -m recsys.cli``: the same as the ``recsys`` command."""
import sys

from recsys.cli.main import main

sys.exit(main())
