"""Security properties the job promises: no unpickling, credentials never logged or stored, arguments
passed through spark-submit.sh verbatim. No Spark."""
import datetime as dt
import io
import logging
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recsys.config import load_config
from recsys.errors import ExitCode

REPO = Path(__file__).resolve().parent.parent


class _Planted:
    """Unpickling this creates a file: proof that a loader ran pickle."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_model_files_holding_pickles_are_refused_without_being_unpickled(tmp_path):
    import torch

    from recsys.model.io import load_model, save_model
    from recsys.model.sasrec import SASRec, SASRecConfig

    model_dir = save_model(SASRec(SASRecConfig(num_items=5, dim=8, layers=1, heads=1, max_len=4)), np.arange(1, 6),
                           tmp_path / "model")
    marker = tmp_path / "pickle-ran"
    good_weights = (model_dir / "weights.safetensors").read_bytes()
    (model_dir / "weights.safetensors").write_bytes(pickle.dumps({"w": _Planted(marker)}))
    with pytest.raises(ValueError, match="never from pickles"):
        load_model(model_dir)
    buf = io.BytesIO()
    torch.save({"w": _Planted(marker)}, buf)                    # a torch checkpoint is a pickle too
    (model_dir / "weights.safetensors").write_bytes(buf.getvalue())
    with pytest.raises(ValueError, match="never from pickles"):
        load_model(model_dir)
    (model_dir / "weights.safetensors").write_bytes(good_weights)
    np.save(model_dir / "item_ids.npy", np.array([_Planted(marker)] * 5, dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="not a plain integer array"):
        load_model(model_dir)
    assert not marker.exists()


_UNSAFE = [
    (r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)", "torch.load without weights_only=True"),
    (r"\b(?:c?pickle|cloudpickle|dill|joblib)\.loads?\(", "unpickling"),
    (r"allow_pickle\s*=\s*True", "np.load with allow_pickle=True"),
    (r"\bshell\s*=\s*True|\bos\.system\(|(?<![.\w])eval\(|(?<![.\w])exec\(", "shell or eval"),
    (r"yaml\.load\((?![^)]*SafeLoader)", "yaml.load without SafeLoader"),
]


def test_no_code_in_the_package_unpickles_or_evaluates_data():
    found = []
    for path in sorted((REPO / "recsys").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in _UNSAFE:
                if re.search(pattern, code):
                    found.append(f"{path.relative_to(REPO)}:{lineno}: {what}: {line.strip()}")
    assert found == []


def test_credentials_in_uris_never_reach_run_parameters_or_the_stored_config():
    from recsys.pipelines.nightly_stages import run_params
    from recsys.tracking.store import ResolvedModel

    cfg = load_config(overrides=["mlflow.tracking_uri=https://bob:s3cret@mlflow.example.com/?token=t0ken",
                                 "export.redis_url=redis://:s3cret@127.0.0.1:6379/0",
                                 "spark.remote=sc://bob:s3cret@spark:15002/;token=t0ken"])
    model = ResolvedModel("m", "champion", "3", None, "s3://AKIAKEY:s3cret@bucket/model", Path("/tmp/m"))
    params = run_params(cfg, dt.date(2024, 5, 8), model, cfg.digest())
    stored = str(params) + str(cfg.redacted_dict())
    assert "s3cret" not in stored and "t0ken" not in stored
    assert params["tracking_uri"] == "https://***@mlflow.example.com/?token=***"


def test_the_log_filter_removes_credentials_from_messages_and_tracebacks():
    from recsys.logs import RedactingFilter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("test.redaction")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("API request to %s failed", "http://bob:s3cret@mlflow:5000/api?token=t0ken&x=1")
        try:
            raise ConnectionError("cannot reach https://alice:hunter2@mlflow.example.com/")
        except ConnectionError:
            logger.exception("unexpected")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "http://***@mlflow:5000/api?token=***&x=1" in text
    assert "s3cret" not in text and "t0ken" not in text and "hunter2" not in text
    assert "ConnectionError" in text


@pytest.mark.parametrize("ends, says, setting", [
    ("echo 'java.lang.OutOfMemoryError: Java heap space' >&2; exit 52", "ran out of Java heap", "spark.driver.memory"),
    ("kill -KILL $$", "was killed with SIGKILL (exit code 137)", "--driver-memory"),     # as the OOM killer does
])
def test_spark_submit_names_a_driver_that_ran_out_of_memory_and_exits_1(tmp_path, ends, says, setting):
    """Spark exits a JVM whose heap ran out with 52, and a driver the kernel's out-of-memory killer takes ends with
    137: both outside the documented codes, and the job's Python cannot say why (its output goes through that JVM,
    or it is the process killed). The script says it, once, and exits 1."""
    fake_home = tmp_path / "spark"
    (fake_home / "bin").mkdir(parents=True)
    fake = fake_home / "bin" / "spark-submit"
    fake.write_text(f"#!/usr/bin/env bash\n{ends}\n")
    fake.chmod(0o755)
    env = {**os.environ, "SPARK_HOME": str(fake_home), "PYSPARK_PYTHON": sys.executable}
    env.pop("SPARK_MASTER", None)
    proc = subprocess.run(["bash", str(REPO / "spark-submit.sh"), "jobs/nightly_recommendations.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.UNEXPECTED_ERROR == 1
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("spark-submit.sh:")]
    assert len(said) == 1 and says in said[0] and setting in said[0], proc.stderr


def test_spark_submit_passes_every_argument_through_verbatim(tmp_path):
    fake_home = tmp_path / "spark"
    (fake_home / "bin").mkdir(parents=True)
    received = tmp_path / "argv"
    fake = fake_home / "bin" / "spark-submit"
    fake.write_text(  # records its arguments, keeps the shipped zip, exits like a failed validation
        f"#!/usr/bin/env bash\nprintf '%s\\0' \"$@\" > {received}\n"
        f"while [[ $# -gt 0 ]]; do [[ $1 == --py-files ]] && cp \"$2\" {tmp_path}/shipped.zip; shift; done\nexit 3\n")
    fake.chmod(0o755)
    tricky = ["--date", "2024-05-01", "--set", "paths.output=/data/with space/$(touch pwned)/`id`",
              "--set", "mlflow.experiment=*", "--set", "x='quoted' \"double\";rm -rf ~", ""]
    env = {**os.environ, "SPARK_HOME": str(fake_home), "PYSPARK_PYTHON": sys.executable}
    env.pop("SPARK_MASTER", None)
    proc = subprocess.run(["bash", str(REPO / "spark-submit.sh"), "--conf", "spark.executor.memory=1g",
                           "jobs/nightly_recommendations.py", *tricky], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr                     # the job's exit code is the script's
    argv = received.read_bytes().split(b"\0")[:-1]
    argv = [a.decode() for a in argv]
    job = argv.index("jobs/nightly_recommendations.py")
    assert argv[job + 1:] == tricky                               # same strings, same count, nothing expanded
    assert argv[argv.index("--master") + 1] == "local[*,4]"
    assert argv[argv.index("spark.executor.memory=1g") - 1] == "--conf"
    assert any(a.endswith("recsys.zip") for a in argv)
    assert not (tmp_path / "pwned").exists()
    # every module of the package imports from the shipped zip alone (no site-packages: as on an
    # executor without recsys installed), including any package without __init__.py
    modules = sorted(".".join(p.relative_to(REPO).with_suffix("").parts) for p in (REPO / "recsys").rglob("*.py")
                     if p.name != "__init__.py")
    probe = ("import sys, importlib.util; sys.path.insert(0, sys.argv[1]); "
             "print([m for m in sys.argv[2:] if importlib.util.find_spec(m) is None "
             "or 'shipped.zip' not in (importlib.util.find_spec(m).origin or '')])")
    found = subprocess.run([sys.executable, "-S", "-c", probe, str(tmp_path / "shipped.zip"), *modules],
                           capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr
