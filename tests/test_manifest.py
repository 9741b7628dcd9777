"""The manifest as a record: every format the job has published reads, and reads back to the same document.

The old documents below are what the job wrote at the commits named (their keys as the code of the
time assembled them; the values of a small run): a reader of any published night must keep working.
"""
import datetime as dt
import json

import pytest

from recsys.data.contracts import SUCCESS_MARKER
from recsys.pipelines.nightly import skip_reason
from recsys.publish import manifest as manifest_file
from recsys.publish.manifest import Counts, FallbackList, Manifest, ModelRef, NextNight, Quality, TrackingNote
from recsys.publish.published import find_published

# d82acee, the first format: no run key, publish method, model resolution, workers, fallback or quality
FIRST_FORMAT = """{
  "catalog_snapshot": "2024-05-06",
  "config_digest": "9b7e0f3a51c2",
  "counts": {"candidate_items": 300, "events_read": 4210, "fallback_users": 2, "model_users": 498, "rows": 500,
             "users_in_window": 500},
  "date": "2024-05-08",
  "format_version": 1,
  "metrics": {"catalog_rows": 320, "model_misses": 1, "rows": 500, "users_per_s": 812.5},
  "model": {"alias": "champion", "name": "recsys-default", "source": "file:///tmp/mlartifacts/1/abc/artifacts/model",
            "uri": "models:/recsys-default@champion", "version": "3"},
  "published_at": "2026-11-30T01:02:03+00:00",
  "recsys_version": "0.1.0",
  "run_id": "0a1b2c3d4e5f60718293a4b5c6d7e8f9",
  "timings": {"stage_read_catalog_s": 0.4, "stage_score_s": 3.2},
  "tracking": {"error": null, "experiment": "recsys", "uri": "sqlite:///.recsys/mlflow.db"},
  "validation": {"duplicate_rows": 0, "missing_users": 0, "seen_items": 0}
}"""

# b15291d .. 86452fb: the run key, the publish method, the model's resolution and (from the cluster branch) the
# workers; MLflow was down for this one (run_id null, tracking.error set), the model alias null (pinned version)
BEFORE_THE_GUARD = """{
  "catalog_snapshot": "2024-05-06",
  "config_digest": "9b7e0f3a51c2",
  "counts": {"candidate_items": 300, "events_read": 4210, "fallback_users": 2, "model_users": 498, "rows": 500,
             "users_in_window": 500},
  "date": "2024-05-08",
  "format_version": 1,
  "job_run": "20261130T090102Z-1a2b3c4d",
  "metrics": {"model_misses": 1, "rows": 500, "task_retries": 0},
  "model": {"alias": null, "name": "recsys-default", "resolution": "remembered: MLflow unreachable",
            "source": "file:///tmp/m", "uri": "models:/recsys-default/3", "version": "3"},
  "publish_method": "exchange",
  "published_at": "2026-11-30T09:01:40+00:00",
  "recsys_version": "0.1.0",
  "run_id": null,
  "timings": {"stage_score_s": 3.2, "stage_score_share": 0.41},
  "tracking": {"error": "MLflow unreachable", "experiment": "recsys", "uri": "http://mlflow:5000"},
  "validation": {"missing_users": 0},
  "workers": [{"gpus": "", "host": "exec-1", "model_hits": 3, "model_misses": 1, "pid": 4242,
               "python": "./environment/bin/python", "tasks": 4}]
}"""


@pytest.mark.parametrize("text", [FIRST_FORMAT, BEFORE_THE_GUARD], ids=["first format", "before the guard"])
def test_an_old_manifest_reads_and_writes_back_to_the_same_document(text):
    manifest = manifest_file.parse(text)
    assert manifest.date == dt.date(2024, 5, 8) and manifest.catalog_snapshot == dt.date(2024, 5, 6)
    assert manifest.model.version == "3" and manifest.counts.rows == 500 and manifest.config_digest == "9b7e0f3a51c2"
    assert manifest.fallback is None and manifest.quality is None
    assert json.loads(manifest_file.to_text(manifest)) == json.loads(text)


def test_the_fields_an_old_format_lacked_read_as_not_recorded():
    first = manifest_file.parse(FIRST_FORMAT)
    assert (first.job_run, first.publish_method, first.model.resolution, first.workers) == (None, None, None, None)
    assert first.run == "0a1b2c3d4e5f60718293a4b5c6d7e8f9"           # the MLflow run stood for the run key then
    later = manifest_file.parse(BEFORE_THE_GUARD)
    assert later.run == "20261130T090102Z-1a2b3c4d" and later.run_id is None
    assert later.tracking.error == "MLflow unreachable" and later.model.alias is None
    assert later.workers[0]["python"] == "./environment/bin/python"


def test_the_skip_decision_reads_an_old_manifest():
    old = manifest_file.parse(FIRST_FORMAT)
    assert "already published at 2026-11-30T01:02:03+00:00 by run 0a1b2c" in skip_reason(old, "3", "9b7e0f3a51c2")
    assert skip_reason(old, "4", "9b7e0f3a51c2") is None


def test_a_path_view_published_in_the_first_format_is_found_as_the_published_night(tmp_path):
    view = tmp_path / "dt=2024-05-08"
    view.mkdir()
    (view / "_manifest.json").write_text(FIRST_FORMAT)
    (view / SUCCESS_MARKER).write_text("")
    night = find_published(str(tmp_path), dt.date(2024, 5, 8))
    assert night is not None and night.source == "path view"
    assert (night.run, night.model_version, night.rows, night.catalog_snapshot) == (
        "0a1b2c3d4e5f60718293a4b5c6d7e8f9", "3", 500, "2024-05-06")
    assert night.fallback is None and night.sources == ["model", "popularity"] and night.refusal() is None


def test_a_manifest_that_is_not_one_counts_as_not_published(tmp_path, caplog):
    view = tmp_path / "dt=2024-05-08"
    view.mkdir()
    (view / SUCCESS_MARKER).write_text("")
    for text in ("{not json", "[1, 2]", '{"date": "yesterday"}', '{"counts": 3}'):
        (view / "_manifest.json").write_text(text)
        assert manifest_file.read(str(tmp_path), dt.date(2024, 5, 8)) is None
    assert caplog.text.count("treating it as not published") == 4


def _current() -> Manifest:
    return Manifest(
        date=dt.date(2024, 5, 8), run_id="r" * 32, job_run="20261203T000000Z-00000000", publish_method="exchange",
        model=ModelRef(uri="models:/m@champion", name="m", alias="champion", version="7",
                       source="s3://key:secret@bucket/models/7", resolution="registry"),
        catalog_snapshot=dt.date(2024, 5, 6), config_digest="d",
        rules={"exclude": {"touched": False, "events": [{"event_type": "purchase", "within_days": 3}]}, "fill": "none"},
        counts=Counts(rows=3, users_in_window=3, model_users=2, fallback_users=1, candidate_items=9, events_read=12),
        validation={"missing_users": 0}, fallback=FallbackList(name="popularity", item_ids=(5, 4), scores=(0.6, 0.4)),
        metrics={"rows": 3, "users_per_s": 10.5}, timings={"stage_score_s": 1.25},
        tracking=TrackingNote(uri="sqlite:///x.db", experiment="recsys", error=None),
        workers=({"host": "h", "pid": 1, "python": "p", "gpus": "", "tasks": 2, "model_misses": 1, "model_hits": 1},),
        quality=Quality(previous=None, realized_for=None, guard={"verdict": "pass"},
                        for_next_night=NextNight(popularity_ranking=(5, 4, 3))))


def test_the_current_format_is_finished_with_its_own_fields_redacted_and_reads_back_equal():
    finished = manifest_file.finish(_current())
    document = finished.as_dict()
    assert list(document) == list(manifest_file.KEYS)           # MLflow's copy keeps the job's key order
    assert document["format_version"] == manifest_file.FORMAT_VERSION and document["published_at"]
    assert "secret" not in manifest_file.to_text(finished)
    assert document["quality"]["for_next_night"] == {"popularity_ranking": [5, 4, 3]}   # no deciles: no key
    assert manifest_file.parse(manifest_file.to_text(finished)) == finished


def test_keys_a_later_version_adds_are_kept_when_the_manifest_is_rewritten(tmp_path):
    newer = json.loads(BEFORE_THE_GUARD) | {"format_version": 2, "lineage": {"events": ["dt=2024-05-07"]}}
    manifest = manifest_file.Manifest.from_dict(newer)
    assert manifest.extra == {"lineage": {"events": ["dt=2024-05-07"]}}
    (tmp_path / SUCCESS_MARKER).write_text("")
    manifest_file.write(str(tmp_path), manifest)
    assert manifest_file.read_at(str(tmp_path)) == manifest
    assert json.loads((tmp_path / "_manifest.json").read_text()) == newer


def test_a_run_that_was_not_recorded_says_so_in_every_copy(tmp_path):
    dirs = [tmp_path / "run", tmp_path / "view"]
    published = manifest_file.finish(_current())
    for d in dirs:
        d.mkdir()
        manifest_file.write(str(d), published)
    marked = manifest_file.mark_unrecorded([str(d) for d in dirs], published, "MLflow unreachable")
    assert marked.tracking.error == "MLflow unreachable" and published.tracking.error is None
    assert all(json.loads((d / "_manifest.json").read_text())["tracking"]["error"] == "MLflow unreachable" for d in dirs)
    assert manifest_file.mark_unrecorded([str(d) for d in dirs], marked, "another error") is marked
