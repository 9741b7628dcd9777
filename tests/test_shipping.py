"""The model reaches the Python workers through Spark's file distribution, checked by digest."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from recsys.scoring.shipping import ShippedModel, model_files_digest, ship_model

pytestmark = pytest.mark.spark


def _model_dir(path, seed=0):
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    (path / "config.json").write_text(json.dumps({"seed": seed}))
    np.save(path / "item_ids.npy", rng.integers(0, 100, 10))
    (path / "weights.safetensors").write_bytes(rng.bytes(1000))
    return path


def _fetched_in_a_task(spark, shipped: ShippedModel) -> list[dict]:
    def task(batches):
        import pandas as pd

        from recsys.scoring.shipping import fetch_model, model_files_digest

        for _ in batches:
            pass
        try:
            local = fetch_model(shipped)
            yield pd.DataFrame([{"out": json.dumps({"dir": str(local), "digest": model_files_digest(local),
                                                    "files": sorted(p.name for p in local.iterdir())})}])
        except RuntimeError as exc:
            yield pd.DataFrame([{"out": json.dumps({"error": str(exc)})}])

    return [json.loads(r.out) for r in spark.range(0, 2, 1, 2).mapInPandas(task, "out string").collect()]


def test_a_shipped_model_arrives_in_every_task_under_its_own_names_and_digest(spark, tmp_path):
    model = _model_dir(tmp_path / "model")
    shipped = ship_model(spark, model, name="m", version="3", scratch=tmp_path / "driver")
    assert shipped.digest == model_files_digest(model) and shipped.cache_key == f"m/3#{shipped.digest}"
    assert all(name.startswith(f"recsys-model-{shipped.digest}-") for name, _ in shipped.files)
    for got in _fetched_in_a_task(spark, shipped):
        assert got["digest"] == shipped.digest
        assert got["files"] == ["config.json", "item_ids.npy", "weights.safetensors"]
        assert not got["dir"].startswith(str(tmp_path))       # Spark's copy, not the driver's directory


def test_two_versions_with_the_same_file_names_do_not_collide(spark, tmp_path):
    a = ship_model(spark, _model_dir(tmp_path / "a", seed=1), name="m", version="1", scratch=tmp_path / "driver")
    b = ship_model(spark, _model_dir(tmp_path / "b", seed=2), name="m", version="2", scratch=tmp_path / "driver")
    assert a.digest != b.digest and not set(a.files) & set(b.files)
    assert {g["digest"] for g in _fetched_in_a_task(spark, b)} == {b.digest}
    again = ship_model(spark, tmp_path / "a", name="m", version="1", scratch=tmp_path / "driver")   # a backfill
    assert again == a


def test_files_that_differ_from_what_the_driver_shipped_are_refused(spark, tmp_path):
    shipped = ship_model(spark, _model_dir(tmp_path / "model", seed=3), name="m", version="1",
                         scratch=tmp_path / "driver")
    forged = dataclasses.replace(shipped, digest="0" * 16)
    errors = [g.get("error", "") for g in _fetched_in_a_task(spark, forged)]
    assert all("arrived with digest" in e and "expected 0000000000000000" in e for e in errors), errors


def test_the_worker_cache_key_changes_with_the_files_not_only_the_version(tmp_path):
    a = _model_dir(tmp_path / "a", seed=4)
    b = _model_dir(tmp_path / "b", seed=5)
    key = lambda d: ShippedModel("m", "7", model_files_digest(d), ()).cache_key  # noqa: E731
    assert key(a) != key(b) and key(a) == key(a)
