"""``python -m recsys.cli``: the same as the ``recsys`` command."""
from recsys.cli.main import process_main

process_main()
