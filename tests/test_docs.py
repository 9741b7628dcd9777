"""The reference in docs/ stays whole: every config key, exit code and environment variable is documented,
and every document the code cites exists. No Spark."""
import re
from pathlib import Path

import yaml

from recsys import config
from recsys.errors import ExitCode
from recsys.hooks import FAULT_ENV, PAUSE_ENV, PAUSE_MAX_ENV

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _dotted_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        # spark.conf is free-form; an open section's entries (guard.thresholds.<figure>) are one row each
        # an empty open section (recommend.exclude.catalog: {}) is one row too
        if isinstance(value, dict) and value and dotted != "spark.conf" and prefix[:-1] not in config.OPEN_SECTIONS:
            keys += _dotted_keys(value, f"{dotted}.")
        else:
            keys.append(dotted)
    return keys


def test_every_key_of_the_embedded_default_has_a_row_in_the_configuration_reference():
    keys = _dotted_keys(yaml.safe_load(config.default_config_text()))
    assert len(keys) > 50
    text = (DOCS / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9_.]+)` \|", text, flags=re.M))
    assert [k for k in keys if k not in documented] == []


def test_every_exit_code_is_in_the_operations_reference_with_its_number_and_name():
    text = (DOCS / "operations.md").read_text()
    for code in ExitCode:
        assert re.search(rf"^\| {code.value} \| `{code.name}` \|", text, flags=re.M), code


def test_every_environment_variable_the_project_reads_is_documented():
    text = (DOCS / "configuration.md").read_text()
    for name in (config.SPARK_REMOTE_ENV, config.SHUFFLE_PARTITIONS_ENV, FAULT_ENV, PAUSE_ENV, PAUSE_MAX_ENV):
        assert f"| `{name}` |" in text, name
    faults = (DOCS / "faults.md").read_text()
    assert all(f"| `{name}` |" in faults for name in (FAULT_ENV, PAUSE_ENV, PAUSE_MAX_ENV))


def test_only_the_config_module_reads_the_environment_for_settings():
    readers = []
    for path in sorted((REPO / "recsys").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ\.get\(|os\.getenv\(|environ\[\"(?:RECSYS|SPARK_REMOTE)", line):
                readers.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert [r for r in readers if not r.startswith("recsys/config.py")] == []


def test_documents_cited_by_the_code_exist():
    cited = []
    for path in sorted([*(REPO / "recsys").rglob("*.py"), *(REPO / "jobs").glob("*.py"), REPO / "spark-submit.sh"]):
        for name in re.findall(r"\b(docs/[a-z-]+\.md|[A-Z][A-Z_]+\.md)\b", path.read_text()):
            if not (REPO / name).is_file():
                cited.append(f"{path.relative_to(REPO)} cites {name}")
    assert cited == []


def test_no_module_reaches_into_another_module_s_private_names():
    found = []
    for path in sorted((REPO / "recsys").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(tracking|store|run_record|nightly|stages|config|session|publisher|readers)\._[a-z]\w*", line):
                found.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert found == []


def test_the_demo_finds_the_checkout_and_its_bundled_movielens_sample():
    from recsys.cli.demo import MOVIELENS_CANDIDATES, REPO_ROOT

    assert REPO_ROOT == REPO
    assert (REPO / "data" / "ml-latest-small" / "ratings.csv").is_file()
    assert REPO / "data" / "ml-latest-small" in MOVIELENS_CANDIDATES
