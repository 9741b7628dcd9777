"""spark-submit entry point of training; the same as ``recsys train``.

    ./spark-submit.sh jobs/train.py --date 2024-05-01 [--force] [--if-due] [--conf FILE] [--set KEY=VALUE ...]
"""
import sys

from recsys.cli.main import process_main

if __name__ == "__main__":
    process_main(["train", *sys.argv[1:]])
