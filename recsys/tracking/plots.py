"""PNG plots logged with runs: what an operator glances at in the MLflow UI to see a run is sane."""
from __future__ import annotations

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless: schedulers and executors have no display
    import matplotlib.pyplot as plt

    return plt


def score_distribution(scores: np.ndarray, ranks: np.ndarray, top_n: int):
    """Histogram of recommendation scores, overall and for rank 1 vs the last rank."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    finite = np.isfinite(scores)
    ax.hist(scores[finite], bins=60, alpha=0.5, label="all ranks")
    first = finite & (ranks == 0)
    last = finite & (ranks == ranks.max()) if len(ranks) else first
    if first.any():
        ax.hist(scores[first], bins=60, alpha=0.6, label="rank 1")
    if last.any() and ranks.max() > 0:
        ax.hist(scores[last], bins=60, alpha=0.6, label=f"rank {int(ranks.max()) + 1}")
    ax.set_xlabel("score")
    ax.set_ylabel("recommendations (sample)")
    ax.set_title(f"Score distribution of the top {top_n}")
    ax.legend()
    fig.tight_layout()
    return fig


def popularity_long_tail(recommended_counts: np.ndarray, popularity_counts: np.ndarray):
    """How often each item is recommended, against its popularity rank in the window's histories.

    A healthy run recommends into the tail; a run that only repeats the head looks like the
    popularity fallback and usually means the model or its inputs are broken.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    order = np.argsort(-popularity_counts, kind="stable")
    ax.plot(np.arange(1, len(order) + 1), np.asarray(recommended_counts)[order], ".", ms=2, alpha=0.6,
            label="times recommended")
    ax.set_xscale("log")
    # counts are >= 0 and many are 0: linear up to 1, log above; without a floor at 0 the margin
    # matplotlib adds below the zeros shows up as a negative tick (-10^0) on a count axis
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("item popularity rank in the history window (1 = most popular)")
    ax.set_ylabel("times recommended")
    head = max(1, len(order) // 10)
    share = np.asarray(recommended_counts)[order[:head]].sum() / max(1, np.sum(recommended_counts))
    ax.set_title(f"Long tail: {share:.0%} of recommendations go to the top 10% of items")
    fig.tight_layout()
    return fig


def learning_curve(curve: list[dict], metric: str):
    plt = _pyplot()
    fig, ax1 = plt.subplots(figsize=(7, 4))
    epochs = [row["epoch"] for row in curve]
    ax1.plot(epochs, [row.get("train_loss", np.nan) for row in curve], color="tab:blue", label="train loss")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("train loss", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(epochs, [row.get(metric, np.nan) for row in curve], color="tab:orange", marker="o", label=metric)
    ax2.set_ylabel(metric, color="tab:orange")
    ax1.set_title("Learning curve")
    fig.tight_layout()
    return fig


VERDICT_COLOURS = {"pass": "tab:green", "warn": "tab:orange", "fail": "tab:red", "accepted": "tab:purple"}


def night_trend(nights: list[dict], guard_thresholds: dict[str, dict] | None = None, min_users: int = 0):
    """The last nights, oldest first (``recsys.pipelines.nightly_compare.trend`` rows): the realized hit rate
    of each night's lists (model against the popularity and personal-frequency baselines, drawn at the date
    the lists were published), their overlap with the night before, and catalog coverage; each night's point coloured
    by the guard's verdict, the guard's thresholds drawn where they apply. A hit rate measured over fewer
    than ``min_users`` users (``guard.min_users``: reported, not judged) is drawn hollow, so that a quiet
    night's 0 or 1 from a handful of users is not read as a trend."""
    import datetime as dt

    import matplotlib.dates as mdates

    plt = _pyplot()
    thresholds = guard_thresholds or {}
    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)

    def day(value):
        return dt.date.fromisoformat(value) if value else None

    def series(key, at="date"):
        points = [(day(n.get(at)), n.get(key)) for n in nights]
        points = [(d, v) for d, v in points if d is not None and isinstance(v, (int, float))]
        return [p[0] for p in points], [p[1] for p in points]

    ax = axes[0]
    few = {day(n.get("realized_for")) for n in nights
           if isinstance(n.get("realized_users"), (int, float)) and n["realized_users"] < min_users}
    for key, label, style in (("realized_hr_at_10", "model lists", "o-"),
                              ("realized_pop_hr_at_10", "popularity baseline, same users", "s--"),
                              ("realized_pfreq_hr_at_10", "personal frequency (own most touched), same users", "^:")):
        xs, ys = series(key, at="realized_for")
        if not xs and key != "realized_hr_at_10":   # a baseline the nights before did not measure: no legend entry
            continue
        line, = ax.plot(xs, ys, style[1:], label=label)
        for x, y in zip(xs, ys):
            ax.plot([x], [y], style[0], ms=5, color=line.get_color(),
                    markerfacecolor="white" if x in few else line.get_color())
    if few:
        ax.plot([], [], "o", ms=5, color="tab:gray", markerfacecolor="white",
                label=f"hollow: fewer than {min_users} users (not judged)")
    ax.set_ylabel("realized HR@10")
    ax.set_ylim(bottom=0)
    ax.set_title("Realized hit rate of each night's lists (what users touched until the next night)", fontsize=10)
    ax.legend(fontsize=8, loc="best")

    def with_verdicts(ax, key, label, threshold_key=None):
        xs, ys = series(key)
        ax.plot(xs, ys, "-", color="tab:blue", lw=1, label=label)
        verdicts = {day(n["date"]): n.get("verdict") for n in nights}
        for x, y in zip(xs, ys):
            ax.plot([x], [y], "o", ms=5, color=VERDICT_COLOURS.get(verdicts.get(x) or "", "tab:gray"))
        t = thresholds.get(threshold_key or key) or {}
        for level, colour in (("warn", "tab:orange"), ("fail", "tab:red")):
            if t.get(level) is not None:
                ax.axhline(t[level], color=colour, ls=":", lw=1, label=f"guard {level} {t[level]:g}")
        ax.legend(fontsize=8, loc="best")

    with_verdicts(axes[1], "jaccard_at_n_mean", "mean Jaccard@N with the night before")
    axes[1].set_ylabel("list overlap")
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].set_title("Overlap with the previous night (points: the guard's verdict; "
                      "green pass, orange warn, red fail, purple accepted)", fontsize=10)
    with_verdicts(axes[2], "catalog_coverage", "catalog coverage")
    axes[2].set_ylabel("catalog coverage")
    axes[2].set_ylim(bottom=0)
    axes[2].set_title("Share of the candidate items recommended to anyone", fontsize=10)
    days = [day(n.get("date")) for n in nights if n.get("date")]
    span = (max(days) - min(days)).days if days else 0
    axes[2].xaxis.set_major_locator(mdates.DayLocator(interval=max(1, -(-span // 12))))
    axes[2].xaxis.set_major_formatter(mdates.DateFormatter("%m-%d"))
    if days:   # one day of margin each side, so a single night is not drawn on an axis of hours
        axes[2].set_xlim(min(days) - dt.timedelta(days=1), max(days) + dt.timedelta(days=1))
    fig.autofmt_xdate()
    last = nights[-1] if nights else {}
    fig.suptitle(f"Last {len(nights)} nights up to {last.get('date', '?')}: guard {last.get('verdict', '?')}",
                 fontsize=12)
    fig.tight_layout()
    return fig


def backtest_nights(nights: list[str], series: dict[str, dict[str, list[float]]], metric: str,
                    parts: tuple[tuple[str, str], ...], highlight: str | None = None):
    """A backtest night by night: ``metric`` of each system (``series[system][part]``, one value per night,
    NaN where no user had such items) in one panel per part (all next-day items, repeats, new items), the
    job drawn thick (``highlight``), so a baseline that beats it on some nights and not others shows."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 4), sharey=False, squeeze=False)
    x = np.arange(len(nights))
    for ax, (part, title) in zip(axes[0], parts):
        for system, values in series.items():
            y = np.asarray(values.get(part, [np.nan] * len(nights)), dtype=float)
            strong = system == highlight
            ax.plot(x, y, marker="o", lw=2.5 if strong else 1.2, ms=5 if strong else 3, label=system,
                    color="black" if strong else None, zorder=3 if strong else 2)
        ax.set_xticks(x)
        ax.set_xticklabels([n[5:] for n in nights], rotation=45, ha="right")
        ax.set_title(title)
        ax.set_ylabel(metric)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small", frameon=False)
    fig.suptitle(f"{metric} per night: the job and the baselines")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
