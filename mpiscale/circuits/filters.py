"""Metadata filters: ``KEY=VALUE`` (``*`` and ``?`` match as in file names), ``KEY!=VALUE``, ranges
``KEY>=N``, ``KEY<N`` ..., and ``tag=NAME``; a circuit passes when every filter holds.

Keys are a catalogue's columns (``name``, ``model``, ``layer``, ``source``,
``atom``, ``usage`` ...) and the user's fields. A filter that cannot mean
anything (an unknown key, a range on text, a number that is not one) is
refused with the keys the catalogue has.
"""

from __future__ import annotations

import fnmatch
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .catalogue import Catalogue
from .store import CatalogueError

_FILTER = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|!=|=|>|<)\s*(.*?)\s*$")
_RANGES: dict[str, Callable] = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclass(frozen=True)
class Filter:
    """One condition on a column."""

    key: str
    op: str
    value: str

    @classmethod
    def parse(cls, text: str) -> Filter:
        found = _FILTER.match(text)
        if not found:
            raise ValueError(f"filter {text!r}: write KEY=VALUE, KEY!=VALUE, KEY>=N, KEY<=N, KEY>N, KEY<N or "
                             "tag=NAME")  # fmt: skip
        return cls(*found.groups())

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value}"


def parse_filters(items: list[str]) -> list[Filter]:
    """The filters of ``--where`` options, each of which may hold several separated by ``;``. An option with no
    filter at all is refused: ``--where "$LAYERS"`` with the variable unset would otherwise take every circuit."""
    for item in items:
        if not item.replace(";", "").strip():
            raise ValueError(f"--where {item!r} holds no filter (an unset shell variable?); leave --where out to "
                             "take every circuit")  # fmt: skip
    return [Filter.parse(part) for item in items for part in item.split(";") if part.strip()]


def matching(catalogue: Catalogue, filters: list[Filter], start: int = 0, stop: int | None = None) -> np.ndarray:
    """Which circuits of rows ``start:stop`` pass every filter (a boolean mask)."""
    stop = catalogue.count if stop is None else stop
    keep = np.ones(stop - start, bool)
    for condition in filters:
        keep &= _holds(catalogue, condition, start, stop)
    return keep


def check_filters(catalogue: Catalogue, filters: list[Filter]) -> None:
    """Refuse filters on unknown keys, ranges on text and numbers that are not numbers (before any search)."""
    known = catalogue.keys()
    for condition in filters:
        if condition.key not in known:
            raise CatalogueError(catalogue.path, f"filter {condition}: no column {condition.key!r}; columns: "
                                                 f"{', '.join(known)}")  # fmt: skip
        text = catalogue.is_text(condition.key)
        if text and condition.op in _RANGES:
            raise CatalogueError(catalogue.path, f"filter {condition}: {condition.key} is text; ranges take "
                                                 "numbers")  # fmt: skip
        if not text:
            _number(catalogue, condition)


def _number(catalogue: Catalogue, condition: Filter) -> float:
    try:
        value = float(condition.value)
    except ValueError:
        raise CatalogueError(catalogue.path, f"filter {condition}: {condition.key} holds numbers, and "
                                             f"{condition.value!r} is not one") from None  # fmt: skip
    if math.isnan(value):
        raise CatalogueError(catalogue.path, f"filter {condition}: NaN matches nothing; give a number")
    return value


def _holds(catalogue: Catalogue, condition: Filter, start: int, stop: int) -> np.ndarray:
    if condition.key == "tag":
        tags = catalogue.column("tags", start, stop)
        found = np.array([condition.value in value.split(",") for value in tags], bool)
        return found if condition.op == "=" else ~found
    values = catalogue.column(condition.key, start, stop)
    if catalogue.is_text(condition.key):
        pattern = condition.value
        if any(char in pattern for char in "*?["):
            found = np.array([fnmatch.fnmatchcase(value, pattern) for value in values], bool)
        else:
            found = values == pattern
        return found if condition.op == "=" else ~found
    number = _number(catalogue, condition)
    compare = _RANGES.get(condition.op, operator.eq if condition.op == "=" else operator.ne)
    return np.asarray(compare(values, number), bool)
