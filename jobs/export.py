"""spark-submit entry point of the export; the same as ``recsys export``.

    ./spark-submit.sh jobs/export.py --date 2024-05-01 [--conf FILE] [--set KEY=VALUE ...] [--force] [--allow-older]

Writes the date's published lists into Redis (``export.redis_url``) as a new version and switches the
pointer readers follow (docs/export.md). Exits with the job's documented exit code (docs/operations.md).
"""
import sys

from recsys.cli.main import process_main

if __name__ == "__main__":
    process_main(["export", *sys.argv[1:]])
