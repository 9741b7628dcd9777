"""spark-submit entry point of the whole night in one process; the same as ``recsys night``.

    ./spark-submit.sh jobs/night.py --date 2024-05-01 [--force] [--conf FILE] [--set KEY=VALUE ...]

Trains when ``train.every_nights`` says it is due, then publishes the date's lists, in one Spark session;
a failed training leaves the night to the version that holds the model alias. Exits with the nightly
job's exit code (README: exit codes), which is what a scheduler acts on.
"""
import sys

from recsys.cli.main import process_main

if __name__ == "__main__":
    process_main(["night", *sys.argv[1:]])
