"""Name -> function lookup shared by the algorithm families."""

from __future__ import annotations

from typing import Mapping, TypeVar

F = TypeVar("F")


def lookup(table: Mapping[str, F], name: str, field: str) -> F:
    """``table[name]``, or a ValueError naming ``field`` and listing the choices."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{field}: unknown name {name!r}; choose one of {', '.join(table)}") from None

