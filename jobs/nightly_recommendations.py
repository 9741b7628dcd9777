"""spark-submit entry point of the nightly job; the same as ``recsys recommend``.

    ./spark-submit.sh jobs/nightly_recommendations.py --date 2024-05-01 [--conf FILE] [--set KEY=VALUE ...]
    ./spark-submit.sh --master spark://host:7077 jobs/nightly_recommendations.py --date 2024-05-01
    ./spark-submit.sh jobs/nightly_recommendations.py --start-date 2024-04-01 --end-date 2024-04-30 [--force]
    ./spark-submit.sh jobs/nightly_recommendations.py --date 2024-05-01 --accept-guard   # publish a refused night

Exits with the job's documented exit code (README: exit codes), which is what a scheduler acts on.
"""
import sys

from recsys.cli.main import process_main

if __name__ == "__main__":
    process_main(["recommend", *sys.argv[1:]])
