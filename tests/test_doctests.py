"""The examples in docstrings run (the scoring core's, and every other module that has some): a public function
whose behaviour changes fails here as well as in its own tests, and the docstring cannot drift from the code."""
from __future__ import annotations

import doctest
import importlib

import pytest

CORE_MODULES = ("recsys.scoring.core", "recsys.model.repeats", "recsys.sequences", "recsys.model.stream",
                "recsys.model.warm", "recsys.model.base", "recsys.model.item_to_item")
OTHER_MODULES = ("recsys.errors", "recsys.data.contracts", "recsys.data.readers", "recsys.learning.split",
                 "recsys.pipelines.nightly_stages", "recsys.pipelines.train", "recsys.spark.failures")


@pytest.mark.parametrize("name", CORE_MODULES + OTHER_MODULES)
def test_the_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0, f"{name} has no examples left"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (see the output above)"


def test_every_module_with_examples_is_listed():
    """A module that gains a docstring example is run here without anyone remembering to list it."""
    from pathlib import Path

    import recsys

    root = Path(recsys.__file__).parent
    with_examples = {".".join(("recsys",) + p.relative_to(root).with_suffix("").parts)
                     for p in root.rglob("*.py") if ">>> " in p.read_text(encoding="utf-8")}
    assert with_examples == set(CORE_MODULES + OTHER_MODULES)
