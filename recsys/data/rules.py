"""The operators' rules (``recommend.*``, docs/rules.md) where they meet the inputs.

Two of the rules are about the data, not the lists, and are applied where the data is read, so that no
second pass over anything is needed:

- the catalog rules (``recommend.exclude.catalog``, ``recommend.include.catalog``) decide which of the
  snapshot's available items may be candidates at all (:func:`catalog_rule_mask`, on the snapshot the driver
  reads anyway);
- the event rules (``recommend.exclude.events``) become each user's ``excluded_items`` in the same
  aggregation that builds the histories (:func:`exclusion_since` for ``recsys.data.history``); whether each
  rule's event type occurs in the window at all is counted on the same pass (:func:`event_type_counts`,
  observed on the events) and judged before scoring (:func:`check_event_types`).

The rules the scorer applies per list (``touched``, ``min_new_items``, ``fill``) are
:class:`recsys.scoring.params.RuleParams`.
"""
from __future__ import annotations

import datetime as dt
from typing import Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column
from pyspark.sql import functions as F

from recsys.config import RecommendConfig
from recsys.errors import ConfigError

__all__ = ["catalog_rule_mask", "check_catalog_columns", "check_event_types", "event_type_counts",
           "exclusion_since"]


def check_catalog_columns(rules: RecommendConfig, columns: list[str], where: str) -> None:
    """Every column a catalog rule names must be one of the snapshot's; else one line naming the first."""
    for kind, rule in (("exclude", rules.exclude.catalog), ("include", rules.include.catalog)):
        for column in rule:
            if column not in columns:
                raise ConfigError(f"recommend.{kind}.catalog names column {column!r}, which {where} does not have "
                                  f"(it has {', '.join(sorted(columns))}); fix the rule or the catalog export")


def catalog_rule_mask(table: pa.Table, rules: RecommendConfig, where: str) -> np.ndarray:
    """[rows] bool: the rows of a snapshot (read with the rules' columns) that the catalog rules let be candidates.

    An item is kept when, for every ``include`` column, the column holds one of its values, and for no
    ``exclude`` column it does. Values are cast to the column's type first: a value that type cannot hold is a
    configuration error naming it (a typo such as ``in_stock: [flase]`` must not silently match nothing). A null
    matches no value.
    """
    keep = np.ones(table.num_rows, dtype=bool)
    for kind, rule in (("include", rules.include.catalog), ("exclude", rules.exclude.catalog)):
        for column, values in rule.items():
            matched = _matches(table.column(column), values, f"recommend.{kind}.catalog.{column}", where)
            keep &= matched if kind == "include" else ~matched
    return keep


def _matches(column: pa.ChunkedArray, values: tuple, key: str, where: str) -> np.ndarray:
    kind = column.type
    if pa.types.is_nested(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        raise ConfigError(f"{key}: the column has type {kind} in {where}; rules match columns of strings, numbers, "
                          f"booleans or dates")
    cast = []
    for value in values:
        try:
            cast.append(pa.array([value]).cast(kind))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            raise ConfigError(f"{key}: value {value!r} cannot be a {kind} (the column's type in {where}); "
                              f"give values of that type") from None
    value_set = pa.concat_arrays(cast)
    return np.asarray(pc.is_in(column, value_set=value_set).fill_null(False).to_numpy(zero_copy_only=False),
                      dtype=bool)


def exclusion_since(rules: RecommendConfig, date: dt.date) -> list[tuple[str, dt.datetime]]:
    """(event type, the earliest time that still counts) of each event rule, for the night of ``date``: its
    events from ``within_days`` days before the night's start on. Naive UTC, as the history window's bounds."""
    night = dt.datetime.combine(date, dt.time())
    return [(rule.event_type, night - dt.timedelta(days=rule.within_days)) for rule in rules.exclude.events]


def event_type_counts(rules: RecommendConfig) -> list[Column]:
    """Aggregates counting the window's events of each rule's type (``rule_events_<i>``): observed on the events
    as the histories are built, so a type the window never holds is found without another pass."""
    return [F.count_if(F.col("event_type") == F.lit(rule.event_type)).alias(f"rule_events_{i}")
            for i, rule in enumerate(rules.exclude.events)]


def check_event_types(rules: RecommendConfig, observed: Mapping[str, int], present: Callable[[], list[str]],
                      where: str) -> None:
    """Refuse a rule whose event type the window's events never hold (a typo, or a type the log does not have),
    naming it and the types the window does hold (``present``: asked only then)."""
    for i, rule in enumerate(rules.exclude.events):
        if not int(observed.get(f"rule_events_{i}") or 0):
            types = present()
            shown = ", ".join(repr(t) for t in types[:20]) + (", ..." if len(types) > 20 else "")
            raise ConfigError(f"recommend.exclude.events: no event of type {rule.event_type!r} in {where} (the "
                              f"types there: {shown or 'none'}); fix the rule's event_type (types are "
                              "case-sensitive) or remove the rule")
