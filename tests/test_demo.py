"""The demo path end to end: MovieLens import -> train -> nightly job -> the printed summary."""
import json
import re

import pyarrow.parquet as pq
import pytest

from recsys.config import load_config
from recsys.cli.demo import REPO_ROOT, run_demo
from recsys.errors import ExitCode

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_demo_imports_trains_recommends_and_tells_the_user_where_to_look(spark, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)        # the embedded default's relative paths land in tmp_path/.recsys
    cfg = load_config(overrides=["train.epochs=1", "train.model.sasrec.dim=16", "train.model.sasrec.layers=1",
                                 "train.model.sasrec.heads=1", "scoring.top_n=5"])
    code = run_demo(cfg, data=REPO_ROOT / "data" / "ml-latest-small", spark=spark)
    out = capsys.readouterr().out

    assert code == ExitCode.OK
    partition = tmp_path / ".recsys" / "recommendations" / "dt=2018-09-25"   # the day after the last rating
    rows = pq.read_table(partition).to_pylist()
    assert len(rows) == 611                                               # every MovieLens user has history
    assert all(len(r["recommendations"]) == 5 for r in rows)
    manifest = json.loads((partition / "_manifest.json").read_text())
    assert manifest["catalog_snapshot"] == "1996-03-29"
    assert "mlflow ui --backend-store-uri sqlite:///.recsys/mlflow.db" in out
    assert "recsys recommend --date 2018-09-25" in out
    assert str(partition) in out
    # published to the table by default, and a reader of the table gets the night
    assert ("""table recsys.recommendations: spark.sql("select count(*) from recsys.recommendations where """
            """dt = '2018-09-25'") -> 611""") in out
    assert spark.sql("select count(*) from recsys.recommendations where dt = '2018-09-25'").first()[0] == 611
    listed = re.findall(r"^ +\d+\. (.*)  \(item \d+, score", out, flags=re.M)
    assert len(listed) == 15 and "?" not in listed                       # 3 users x 5 items, each with its title
    # a second demo reuses the imported data instead of importing again
    marker = json.loads((tmp_path / ".recsys" / "data" / "_recsys_import.json").read_text())
    assert marker["run_date"] == "2018-09-25"
