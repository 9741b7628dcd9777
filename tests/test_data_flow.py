"""The night reads as one data flow, its records are typed, and no function takes a crowd of parameters.

Counted on the parsed source by ``tests/flow_figures.py`` (``python tests/flow_figures.py`` prints the
figures and the calls behind them; pass a checkout's ``recsys/`` to count another version).
"""
import textwrap

import flow_figures as ff

MAX_SWITCHES = 8


def test_the_night_runs_its_stages_without_walking_back_and_forth_between_modules():
    night = ff.run_switches()
    modules = [m for _, _, m in night.calls]
    assert night.switches <= MAX_SWITCHES, "\n".join(f"{line} {name} {m}" for line, name, m in night.calls)
    # the comparison with the previous night is one stage: found once, judged once
    assert [name for _, name, _ in night.calls if name.startswith("compare.")] == ["compare.previous_night",
                                                                                  "compare.guard_stage"]
    # every stage of the night is called from _run, in the order data flows
    stages = [name.removeprefix("stages.") for _, name, m in night.calls if m.endswith(".nightly_stages")]
    order = ["read_catalog", "read_histories", "popularity_fallback_stage", "score", "validate", "run_metrics",
             "manifest", "publish", "retain", "record"]
    assert [s for s in stages if s in order] == order
    assert len(set(modules)) <= 3


def test_the_stage_records_have_no_field_typed_any():
    assert ff.any_fields() == []


def test_no_function_takes_more_than_seven_parameters_outside_argument_parsers():
    assert ff.long_functions() == []


def test_the_counters_count_what_they_claim(tmp_path):
    """The same counters on a planted package: a switch per change of module, Any inside a generic, the
    parameters of a function (argument parsers aside)."""
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    (tmp_path / "a.py").write_text("def one(): pass\ndef two(): pass\n")
    (tmp_path / "b.py").write_text("def three(): pass\n")
    (pipelines / "nightly.py").write_text(textwrap.dedent("""
        from typing import Any, Mapping
        from dataclasses import dataclass
        from recsys import a, b
        from recsys.b import three

        @dataclass
        class Record:
            fine: int
            loose: Mapping[str, Any]

        def _run(run):
            x = a.one(b.three(), a.two())
            three()
            run.timer.stage(x)
            return local(x)

        def local(x): return x

        def crowded(a, b, c, d, e, f, g, *, h): pass

        def parser(a, b, c, d, e, f, g, h):
            a.add_argument("--x")
    """))
    night = ff.run_switches(tmp_path, "recsys.pipelines.nightly")
    assert [m.rsplit(".", 1)[-1] for _, _, m in night.calls] == ["a", "b", "a", "b", "nightly"]
    assert night.switches == 4
    assert ff.any_fields(tmp_path, ("recsys.pipelines.nightly",)) == [
        "recsys.pipelines.nightly.Record.loose: Mapping[str, Any]"]
    assert ff.long_functions(tmp_path) == ["recsys.pipelines.nightly.crowded (8)"]
