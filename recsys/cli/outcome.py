"""The job's last log line: what happened, in one line a scheduler's log viewer shows at the bottom.

An operator opening a failed task's log reads the end first. Whatever the command did (published,
skipped, failed), the last line names the exit code, what the code means for a retry, and why.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

from recsys.errors import ExitCode, RunStatus


def final_line(command: str, code: int, detail: str | None) -> tuple[int, str]:
    """(logging level, message) of the command's last line."""
    # never ERROR: an expected failure prints exactly one ERROR line (the contract), which came before
    level = logging.INFO if code == 0 else logging.WARNING
    meaning = ExitCode(code).meaning if code in ExitCode._value2member_map_ else "unknown exit code"
    return level, f"recsys {command} finished with exit code {code} ({meaning})" + (f": {detail}" if detail else "")


def recommend_detail(results: Sequence[Any]) -> str:
    """Per date: published (and where, which run) or skipped (and why), for one date or a backfill."""
    parts = []
    for r in results:
        if r.status == RunStatus.SKIPPED:
            parts.append(f"skipped {r.date}, {r.reason}")
        else:
            tracking_error = r.manifest.tracking.error
            recorded = f"MLflow run not recorded: {tracking_error}" if tracking_error else f"MLflow run {r.run_id}"
            rows = r.manifest.counts.rows
            guard = r.manifest.quality.guard if r.manifest.quality is not None else {}
            noted = f" ({guard['summary']})" if guard.get("verdict") in ("warn", "accepted") else ""
            parts.append(f"published {r.date} ({rows:,} users) to {r.output_dir}, {recorded}{noted}" if rows is not None
                         else f"published {r.date} to {r.output_dir}, {recorded}{noted}")
    return "; ".join(parts) or "no date ran"
