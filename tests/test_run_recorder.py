"""RunRecorder's figures: logged into the run and closed, also when tracking is down, so a process that runs
night after night (``recsys night``, a backfill, the backtest) does not keep every plot it ever drew."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg", force=True)

import matplotlib.pyplot as plt  # noqa: E402

from recsys.config import load_config  # noqa: E402
from recsys.tracking import store as tracking  # noqa: E402


def _figure():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    return fig


def test_a_logged_figure_is_in_the_run_and_closed(tmp_path):
    from mlflow import MlflowClient

    cfg = load_config(overrides=[f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                 f"mlflow.artifact_location={tmp_path / 'artifacts'}"])
    recorder = tracking.RunRecorder(cfg.mlflow, run_name="figures")
    fig = _figure()
    recorder.log_figure(fig, "plots/line.png")
    recorder.end()
    assert not recorder.failed, recorder.error
    assert not plt.fignum_exists(fig.number)
    tracking.point_at(cfg.mlflow)
    assert [a.path for a in MlflowClient().list_artifacts(recorder.run_id, "plots")] == ["plots/line.png"]


def test_a_figure_is_closed_when_tracking_is_down():
    recorder = tracking.RunRecorder(None, run_name="no store")
    fig = _figure()
    recorder.log_figure(fig, "plots/line.png")
    assert recorder.failed and not plt.fignum_exists(fig.number)
