"""The process entry points (the ``recsys`` command, ``jobs/*.py``, ``python -m recsys.cli``) exit through
``recsys.cli.main.process_main``: the command's exit code, and the garbage collector's objects frozen before the
interpreter's last collection (which otherwise walked every imported object, 1.3-1.4 s of each job's exit)."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# an atexit handler runs after process_main's sys.exit, as the interpreter's own last collection would
AT_EXIT = """
import atexit, gc, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count(), flush=True))
from recsys.cli.main import process_main
process_main(sys.argv[1:])
"""


@pytest.mark.parametrize("args, code", [(["sql", "--print-conf"], 0),
                                        (["sql", "--print-conf", "--set", "no.such_key=1"], 2)])
def test_a_process_exits_with_the_command_s_code_and_its_objects_frozen(tmp_path, args, code):
    run = subprocess.run([sys.executable, "-c", AT_EXIT, *args], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == code, run.stderr[-2000:]
    frozen = int(run.stdout.rsplit("frozen at exit:", 1)[1])
    assert frozen > 10_000            # every module's objects, not a handful


def _calls(path: Path) -> set[str]:
    return {node.func.id for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


def test_every_entry_point_exits_through_process_main():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"recsys": "recsys.cli.main:process_main"}
    for path in [*sorted((REPO / "jobs").glob("*.py")), REPO / "recsys" / "cli" / "__main__.py"]:
        calls = _calls(path)
        assert "process_main" in calls and "main" not in calls, path.name
