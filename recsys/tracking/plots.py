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
