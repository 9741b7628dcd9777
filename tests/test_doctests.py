"""The examples in the scoring core's docstrings run: a public function whose behaviour changes fails here
as well as in its own tests, and the docstring cannot drift from the code."""
from __future__ import annotations

import doctest
import importlib

import pytest

CORE_MODULES = ("recsys.scoring.core", "recsys.model.repeats", "recsys.sequences", "recsys.model.stream",
                "recsys.model.warm")


@pytest.mark.parametrize("name", CORE_MODULES)
def test_the_docstring_examples_of_the_scoring_core_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0, f"{name} has no examples left"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (see the output above)"
