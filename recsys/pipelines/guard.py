"""The guard's judgement: tonight's figures against the thresholds of ``guard.thresholds``.

Validation (:mod:`recsys.publish.validate`) asks whether each list is well formed; the guard asks whether
the night as a whole makes sense next to the previous one: a model that gives every user the same list,
or an upstream break that changes every list, passes validation and is refused here. Each threshold has
a ``warn`` and a ``fail`` level (:class:`recsys.config.GuardThreshold`); a figure's direction (whether
lower or higher is worse) is fixed by :data:`recsys.config.GUARD_FIGURES`.

- **fail**: the night is refused (:class:`recsys.errors.GuardRefused`, exit 3): nothing is published and
  the published partitions are untouched; the message, the MLflow run and its ``guard_report.json`` name
  each figure, its threshold and by how much it crossed it. ``--accept-guard`` (one date) publishes the
  night anyway and records that it was accepted: verdict ``accepted``.
- **warn**: published, the run tagged ``recsys.guard=warn`` with the figures that crossed.
- A figure over fewer than ``guard.min_users`` users (the previous night's realized hit rate on a quiet
  night, say) is reported but not judged; a figure that could not be measured (the first night has no
  previous partition to compare with) is not judged either, and the verdict says why.

No Spark, no MLflow: a function of numbers, tested on its own.
"""
from __future__ import annotations

import datetime as dt
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping

from recsys.config import GUARD_FIGURES, GUARD_NEEDS_PREVIOUS, GuardConfig
from recsys.errors import GuardRefused

Level = Literal["pass", "warn", "fail", "not judged"]
VERDICTS = ("pass", "warn", "fail", "accepted")

# the user count behind a figure, for guard.min_users (figures not listed: tonight's rows)
USERS_BEHIND = {
    "jaccard_at_n_mean": "overlap_users", "jaccard_at_10_mean": "overlap_users",
    "first_item_changed_share": "overlap_users",
    "realized_hr_ratio_at_n": "realized_users", "realized_hr_ratio_at_10": "realized_users",
    "realized_hr_pfreq_ratio_at_n": "realized_pfreq_users", "realized_hr_pfreq_ratio_at_10": "realized_pfreq_users",
    "users_lost_share": "previous_rows",
}


@dataclass(frozen=True)
class Check:
    figure: str
    value: float | None
    direction: str               # "min" (lower is worse) or "max"
    warn: float | None
    fail: float | None
    level: Level
    margin: float | None         # how far past the crossed threshold (positive), None when none was crossed
    users: int | None
    why: str                     # one line, the words the log and the report use

    @property
    def crossed(self) -> float | None:
        return self.fail if self.level == "fail" else self.warn if self.level == "warn" else None


@dataclass(frozen=True)
class Verdict:
    """What the guard decided about one night, with every check it made."""

    verdict: str                 # pass | warn | fail | accepted (a fail published on purpose)
    checks: tuple[Check, ...]
    note: str                    # the first night, or what could not be judged
    accepted: bool = False
    first_night: bool = False
    figures: Mapping[str, float] = field(default_factory=dict)

    def crossed(self, level: Level) -> list[Check]:
        return [c for c in self.checks if c.level == level]

    def summary(self) -> str:
        """One line: the verdict and what crossed."""
        fails, warns = self.crossed("fail"), self.crossed("warn")
        parts = [c.why for c in fails + warns]
        head = {"pass": "passed", "warn": "passed with warnings", "fail": "refused",
                "accepted": "refused, accepted on purpose (--accept-guard)"}[self.verdict]
        tail = "; ".join(parts) if parts else self.note or "every figure within its thresholds"
        return f"guard {head}: {tail}"

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "accepted": self.accepted, "first_night": self.first_night,
                "note": self.note, "summary": self.summary(),
                "checks": [asdict(c) for c in self.checks],
                "figures": {k: _plain(v) for k, v in self.figures.items()}}

    def metrics(self) -> dict[str, float]:
        return {"guard_fail_checks": float(len(self.crossed("fail"))),
                "guard_warn_checks": float(len(self.crossed("warn")))}


def judge(figures: Mapping[str, float], guard: GuardConfig, *, first_night: bool, accepted: bool = False) -> Verdict:
    """Every threshold of ``guard`` against ``figures`` -> the night's verdict (never raises; see :func:`enforce`)."""
    checks = []
    skipped = []
    for name, threshold in guard.thresholds.items():
        direction, description = GUARD_FIGURES[name]
        value = figures.get(name)
        users_key = USERS_BEHIND.get(name, "rows")
        users = figures.get(users_key)
        users = None if users is None or _nan(users) else int(users)
        base = dict(figure=name, value=None if value is None or _nan(value) else float(value), direction=direction,
                    warn=threshold.warn, fail=threshold.fail, users=users)
        if first_night and name in GUARD_NEEDS_PREVIOUS:
            checks.append(Check(**base, level="not judged", margin=None, why=f"{name}: no previous night"))
            continue
        if base["value"] is None:
            skipped.append(name)
            checks.append(Check(**base, level="not judged", margin=None, why=f"{name}: not measured tonight"))
            continue
        if users is not None and users < guard.min_users:
            skipped.append(name)
            checks.append(Check(**base, level="not judged", margin=None,
                                why=f"{name} = {value:.4g} over {users} users, fewer than guard.min_users="
                                    f"{guard.min_users}: not judged"))
            continue
        level, margin, crossed = _level(float(value), direction, threshold.warn, threshold.fail)
        if level == "pass":
            why = f"{name} = {value:.4g} within its thresholds"
        else:
            side = "below" if direction == "min" else "above"
            why = (f"{name} = {value:.4g} is {side} the {level} threshold {crossed:g} by {margin:.4g} "
                   f"({description})")
        checks.append(Check(**base, level=level, margin=margin, why=why))
    fails = any(c.level == "fail" for c in checks)
    warns = any(c.level == "warn" for c in checks)
    verdict = ("accepted" if accepted else "fail") if fails else "warn" if warns else "pass"
    notes = []
    if first_night:
        notes.append("first night: no published partition before it to compare with, so the comparison and "
                     "the realized hit rate are not measured")
    if skipped:
        notes.append(f"not judged: {', '.join(skipped)}")
    return Verdict(verdict, tuple(checks), "; ".join(notes), accepted=accepted and fails, first_night=first_night,
                   figures=dict(figures))


def enforce(verdict: Verdict, date: dt.date) -> None:
    """Raise :class:`GuardRefused` (exit 3) when the verdict is ``fail``, naming what crossed by how much."""
    if verdict.verdict != "fail":
        return
    crossed = "; ".join(c.why for c in verdict.crossed("fail"))
    raise GuardRefused(
        f"the guard refused the night of {date}, nothing published (the published partitions are untouched): "
        f"{crossed}. If this night is right, rerun it with --accept-guard to publish it anyway",
        verdict.as_dict(), {k: v for k, v in verdict.figures.items() if isinstance(v, (int, float))},
    )


def _level(value: float, direction: str, warn: float | None, fail: float | None) -> tuple[Level, float | None, float | None]:
    def past(threshold: float | None) -> bool:
        return threshold is not None and (value < threshold if direction == "min" else value > threshold)

    for level, threshold in (("fail", fail), ("warn", warn)):
        if past(threshold):
            return level, abs(value - threshold), threshold   # type: ignore[return-value]
    return "pass", None, None


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _plain(value: Any) -> Any:
    """JSON has no NaN: a figure that could not be measured is null."""
    return None if _nan(value) else value
