"""The Airflow DAG acts on recsys.errors.ExitCode, whether or not its Airflow can import recsys.

Airflow usually runs in a virtualenv of its own, where recsys is not importable: the DAG then uses a copy
of the codes. These tests load the DAG file without Airflow (a few stand-in classes for the names it
imports) both ways, with recsys importable and with it hidden, and check that each way the operators
do what docs/operations.md says for each code. tests/test_airflow_dag.py runs the DAG in a real Airflow.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest

from recsys.errors import ExitCode

DAG_FILE = Path(__file__).resolve().parent.parent / "conf" / "schedulers" / "airflow_dag.py"


class AirflowException(Exception):
    pass


class AirflowFailException(AirflowException):
    pass


class _Operator:
    log = logging.getLogger("airflow-dag-test")

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def __rshift__(self, other):
        return other


class _Dag:
    def __init__(self, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _stand_ins() -> dict[str, types.ModuleType]:
    mods = {name: types.ModuleType(name) for name in (
        "pendulum", "airflow", "airflow.providers", "airflow.providers.standard",
        "airflow.providers.standard.operators", "airflow.providers.standard.operators.bash", "airflow.sdk",
        "airflow.sdk.exceptions")}
    mods["pendulum"].datetime = lambda *a, **k: None
    mods["pendulum"].duration = lambda **k: None
    mods["airflow.providers.standard.operators.bash"].BashOperator = _Operator
    mods["airflow.sdk"].DAG = _Dag
    mods["airflow.sdk.exceptions"].AirflowException = AirflowException
    mods["airflow.sdk.exceptions"].AirflowFailException = AirflowFailException
    return mods


def _load_dag(monkeypatch, recsys_importable: bool) -> types.ModuleType:
    for name, module in _stand_ins().items():
        monkeypatch.setitem(sys.modules, name, module)
    if not recsys_importable:
        monkeypatch.setitem(sys.modules, "recsys.errors", None)   # import recsys.errors raises ImportError
    spec = importlib.util.spec_from_file_location(f"airflow_dag_{recsys_importable}", DAG_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("recsys_importable", [True, False], ids=["recsys-importable", "airflow-own-venv"])
def test_the_dag_s_exit_codes_are_exit_code_s(monkeypatch, recsys_importable):
    dag = _load_dag(monkeypatch, recsys_importable)
    assert dag.EXIT_CODES == {code.name: int(code) for code in ExitCode}, (
        "conf/schedulers/airflow_dag.py's copy of the exit codes differs from recsys.errors.ExitCode: set it to "
        f"{ {code.name: int(code) for code in ExitCode} }")


@pytest.mark.parametrize("recsys_importable", [True, False], ids=["recsys-importable", "airflow-own-venv"])
def test_each_exit_code_gets_what_the_operations_guide_says(monkeypatch, recsys_importable):
    dag = _load_dag(monkeypatch, recsys_importable)
    for operator in (dag.NightlyJobOperator(task_id="night"), dag.ExportJobOperator(task_id="export")):
        for code in (ExitCode.BAD_INPUT, ExitCode.VALIDATION_FAILED):       # fails at once, not retried
            with pytest.raises(AirflowFailException, match=f"code {int(code)}"):
                operator.on_failure(int(code))
        assert operator.on_failure(int(ExitCode.TRACKING_FAILED)) is None     # published: success with a warning
        for code in (ExitCode.UNEXPECTED_ERROR, ExitCode.LOCK_HELD, ExitCode.INTERRUPTED):   # retried
            with pytest.raises(AirflowException) as raised:
                operator.on_failure(int(code))
            assert not isinstance(raised.value, AirflowFailException)
