"""The names of the MLflow tags the project writes and reads back: one home, so the writer (the
pipelines), the reader (``recsys runs``) and the filter that finds nightly runs cannot drift apart.

Values are documented with the run record in docs/operations.md; renaming one breaks every query
an operator saved, so these are part of the interface.
"""
from __future__ import annotations

PREFIX = "recsys."
JOB = "recsys.job"                      # nightly | train | evaluate | backtest
DATE = "recsys.date"                    # the run's date, YYYY-MM-DD
VERSION = "recsys.version"              # the recsys package version that ran
JOB_RUN = "recsys.job_run"              # the run key: one per attempt of one date
MODEL_VERSION = "recsys.model_version"
STATUS = "recsys.status"                # published | failed | killed (nightly); absent while running
ERROR = "recsys.error"                  # the redacted error, when a run failed (or why it was found dead)
FOUND_DEAD_BY = "recsys.found_dead_by"  # a killed run: the run key (recsys.job_run) of the run that found it dead
FOUND_DEAD_AT = "recsys.found_dead_at"  # ... and when, UTC, ISO 8601
EXIT_CODE = "recsys.exit_code"          # the command's exit code (see recsys.errors.ExitCode)
OUTPUT = "recsys.output"                # the published partition
PROTOCOL = "recsys.protocol"            # evaluate: loo | temporal
PROMOTED = "recsys.promoted"            # train: whether the alias moved
GATE = "recsys.gate"                    # train: the gate's decision, in words
GATE_VERDICT = "recsys.gate_verdict"    # train: promoted | worse (beyond the noise) | close (within it) | undecided
TRAINING_KIND = "recsys.training_kind"  # train: full (from scratch) | warm (from the alias holder's weights)
MODEL_NAME = "recsys.model_name"        # train: the registered model (mlflow.model_name) its version went to
USED_BY_PREFIX = "recsys.used_by."      # + YYYY-MM-DD on the model version (MLflow keys allow no "=")
EXPORT_VERSION = "recsys.export.version"  # nightly: the key-value store version its lists were exported as
EXPORT_STORE = "recsys.export.store"      # ... and where (the Redis URL, without credentials)
GUARD = "recsys.guard"                  # nightly: the guard's verdict, pass | warn | fail | accepted
GUARD_CROSSED = "recsys.guard_crossed"  # nightly: each threshold crossed, with figure, value and margin
GUARD_ACCEPTED = "recsys.guard_accepted"  # nightly: "true" when a refused night was published on purpose
LOCK = "recsys.lock"                    # nightly: what the date's lock promised on its store: exclusive |
                                        # compare-and-set | best effort (runs of the date must not overlap)
TRAINING_FAILED = "recsys.training_failed"  # nightly, by recsys night: why the night's training failed (its
                                            # lists came from the alias holder); absent when it did not

NOTE = "mlflow.note.content"            # MLflow's run description
DATASET_CONTEXT = "mlflow.data.context"
EXPERIMENT_KIND = "mlflow.experimentKind"

NIGHTLY_JOB = "nightly"
TRAIN_JOB = "train"
EVALUATE_JOB = "evaluate"
BACKTEST_JOB = "backtest"


def search_filter(job: str, date: object | None = None) -> str:
    """An MLflow search filter for the runs of ``job`` (on ``date`` only, if given)."""
    query = f"tags.`{JOB}` = '{job}'"
    return query + (f" and tags.`{DATE}` = '{date}'" if date is not None else "")
