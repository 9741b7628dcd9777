"""The layers of docs/architecture.md, enforced over the whole import graph (parsed, not grepped)."""
from __future__ import annotations

import shutil

import import_graph as ig


def test_every_module_is_in_a_layer():
    for module in ig.modules():
        ig.layer_of(module)   # raises, naming the module, if a new package was added to no layer


def test_no_import_breaks_a_layer_rule():
    bad = ig.violations()
    assert not bad, "imports that break the layers (docs/architecture.md):\n" + "\n".join(bad)


def test_no_cycle_between_packages():
    assert ig.cycles(ig.package_graph()) == []


def test_the_graph_sees_lazy_relative_and_from_package_imports():
    found = {(i.source, i.target) for i in ig.imports()}
    assert ("recsys.tracking.run_notes", "recsys.data.partitions") in found           # inside a function
    assert ("recsys.data.readers", "recsys.fs") in found or ("recsys.data.partitions", "recsys.fs") in found
    assert ("recsys.cli.main", "recsys.cli.runs") in found                            # from recsys.cli import runs


def _copy_with(tmp_path, module: str, line: str):
    root = tmp_path / f"{module}-{abs(hash(line))}" / "recsys"
    shutil.copytree(ig.ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    path = root / (module.replace("recsys.", "").replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n\ndef _added():\n    " + line + "\n")
    return ig.imports(root)


def test_an_upward_import_inside_a_function_fails(tmp_path):
    found = _copy_with(tmp_path, "recsys.scoring.core", "from recsys.pipelines.nightly import run_nightly")
    assert any("recsys.scoring.core" in v and "upward, from core to pipelines" in v for v in ig.violations(found))


def test_a_sideways_import_and_a_cycle_fail(tmp_path):
    found = _copy_with(tmp_path, "recsys.data.readers", "from recsys.publish import publisher")
    assert any("sideways between glue packages" in v for v in ig.violations(found))
    found = _copy_with(tmp_path, "recsys.model.io", "import recsys.learning.split")
    assert any({"recsys.learning", "recsys.model"} <= set(c) for c in ig.cycles(ig.package_graph(found)))


def test_the_core_imports_neither_spark_nor_mlflow_nor_the_config(tmp_path):
    found = _copy_with(tmp_path, "recsys.scoring.core", "import pyspark.sql")
    assert any("must not depend on pyspark" in v for v in ig.violations(found))
    found = _copy_with(tmp_path, "recsys.model.sasrec", "from recsys.config import Config")
    assert any("knows no configuration object" in v for v in ig.violations(found))
