"""What the test suite may not touch: the checkout's own state, which belongs to the person running it.

The embedded default configuration writes under ``.recsys/`` relative to the working directory, and
pytest runs from the checkout. A test that forgets one path (``paths.driver_scratch`` in
tests/test_submit_log.py did) writes into the user's demo state: its registry's "version 1" was
remembered there, and a later unreachable-MLflow night published that toy model as the demo's. So
the session compares the watched places before and after, and fails naming every file a test left,
changed or removed. What the user had there before the session (the demo's data, MLflow store,
model downloads) is the baseline, never a failure.
"""
from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
# .recsys/: every default path; mlruns/ and spark-warehouse/: MLflow's and Spark's own defaults
WATCHED = (".recsys", "mlruns", "spark-warehouse")

Snapshot = dict[str, tuple[int, int]]
DIRECTORY = (-1, 0)   # directories count by presence: their times change with what is inside


def snapshot(root: Path = CHECKOUT, watched: tuple[str, ...] = WATCHED) -> Snapshot:
    """Every file, symlink and directory under the watched places: relative path -> (size, modification time in ns).

    Sizes and times, not bytes: the demo's ``.recsys/`` holds hundreds of MB, and anything a test writes
    changes at least one of the two.
    """
    found: Snapshot = {}
    for name in watched:
        top = root / name
        if top.is_symlink() or top.is_file():
            st = top.lstat()
            found[name] = (st.st_size, st.st_mtime_ns)
            continue
        if top.is_dir():
            found[name + "/"] = DIRECTORY
        for folder, dirs, files in os.walk(top):
            for entry in [*files, *dirs]:
                path = Path(folder) / entry
                try:
                    st = path.lstat()
                except FileNotFoundError:   # removed while walking
                    continue
                key = str(path.relative_to(root))
                if entry in dirs and not path.is_symlink():
                    found[key + "/"] = DIRECTORY
                else:
                    found[key] = (st.st_size, st.st_mtime_ns)
    return found


def differences(before: Snapshot, after: Snapshot) -> list[str]:
    """One line per file that appeared, changed or disappeared, sorted by path; a directory only when
    nothing under it is named already (an empty directory a test created, or one it removed whole)."""
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    lines = []
    for path in changed:
        if path.endswith("/") and any(other != path and other.startswith(path) for other in changed):
            continue
        if path not in before:
            lines.append(f"left behind: {path}")
        elif path not in after:
            lines.append(f"removed:     {path}")
        else:
            lines.append(f"changed:     {path}")
    return lines


def report(root: Path, lines: list[str], limit: int = 40) -> str:
    """The failure message: what changed, and how to find and fix the test that did it."""
    shown = lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])
    return (f"tests wrote into the checkout {root} ({len(lines)} file(s) under {', '.join(WATCHED)}); a test "
            f"must pass every path (paths.*, mlflow.tracking_uri, mlflow.artifact_location, serve.backend_dir) "
            f"into its tmp_path, or run from it (cwd=tmp_path, monkeypatch.chdir). Files:\n  " + "\n  ".join(shown))
