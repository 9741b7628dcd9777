"""The layers of docs/architecture.md, enforced over the whole import graph (parsed, not grepped)."""
from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

import import_graph as ig


def test_every_module_is_in_a_layer_and_every_listed_name_exists():
    assert ig.unplaced() == [], "modules in no layer: add them to LAYERS in tests/import_graph.py"
    assert ig.stale_entries() == [], "tests/import_graph.py lists modules that no longer exist"


def test_a_new_top_level_module_or_package_is_in_no_layer_until_listed(tmp_path):
    root = tmp_path / "recsys"
    shutil.copytree(ig.ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "planted.py").write_text("import json\n")
    (root / "newpkg").mkdir()
    (root / "newpkg" / "__init__.py").write_text("")
    (root / "newpkg" / "part.py").write_text("")
    (root / "data" / "extra.py").write_text("")           # a module inside a listed package is that package's
    assert ig.unplaced(root) == ["recsys.newpkg", "recsys.newpkg.part", "recsys.planted"]
    with pytest.raises(LookupError, match="recsys.planted is in no layer"):
        ig.layer_of("recsys.planted")
    assert ig.layer_of("recsys.data.extra") == "glue" and ig.layer_of("recsys") == "base"


def test_a_listed_module_that_is_gone_is_named(tmp_path):
    root = tmp_path / "recsys"
    shutil.copytree(ig.ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "processes.py").unlink()
    assert ig.stale_entries(root) == ["recsys.processes"]


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


# --- docs/architecture.md matches the code ------------------------------------------------------------------

DOC = ig.ROOT.parent / "docs" / "architecture.md"


def _doc_section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _diagram() -> dict[str, set[str]]:
    """The modules the diagram of docs/architecture.md places in each layer (``recsys.x.{a,b}`` expanded)."""
    block = DOC.read_text().split("```", 2)[1]
    placed: dict[str, set[str]] = {}
    layer = None
    for line in block.splitlines():
        words = line.split()
        if words and words[0] in ig.RANK:
            layer = words[0]
        for token in re.findall(r"recsys(?:\.\w+)*(?:\.\{[\w,]+\})?", line):
            base, _, names = token.partition(".{")
            placed.setdefault(layer, set()).update(
                [f"{base}.{n}" for n in names.rstrip("}").split(",")] if names else [token])
    return placed


def test_the_doc_s_diagram_places_every_module_in_the_layer_the_test_does():
    assert _diagram() == {layer: set(prefixes) - {"recsys"} for layer, prefixes in ig.LAYERS}


def test_the_doc_s_package_table_lists_every_package():
    packages = {m for m, p in ig.modules().items() if p.name == "__init__.py" and m.count(".") == 1}
    listed = set(re.findall(r"^\| `(recsys\.\w+)` \|", _doc_section("Packages"), flags=re.M))
    assert listed == packages


def timed_stages(path: Path = ig.ROOT / "pipelines" / "nightly.py") -> list[str]:
    """The names of the stages the nightly job times, in the order of its code: the first argument of every
    ``<timer>.stage("name", ...)`` call (``StageTimer.stage``) in ``path``."""
    calls = [node for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "stage"
             and "timer" in ast.unparse(node.func.value) and node.args and isinstance(node.args[0], ast.Constant)]
    return [c.args[0].value for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


def test_the_doc_s_stage_list_is_the_stages_the_nightly_job_times():
    documented = re.findall(r"^\| `(\w+)` \|", _doc_section("Data flow"), flags=re.M)
    assert len(timed_stages()) >= 10
    assert documented == timed_stages()


def test_the_stage_list_check_sees_a_stage_added_to_the_code(tmp_path):
    planted = tmp_path / "nightly.py"
    code = (ig.ROOT / "pipelines" / "nightly.py").read_text()
    planted.write_text(code.replace('    with timer.stage("publish",',
                                    '    with timer.stage("planted"):\n        pass\n    with timer.stage("publish",', 1))
    stages = timed_stages(planted)
    assert stages[stages.index("planted") + 1] == "publish" and stages != timed_stages()
