"""The base of every spec model: camelCase aliases, unknown fields rejected, frozen.

Its own module so that the spec's sections can live in several files
(``distflow.spec.models``, ``distflow.spec.pod``) without importing each other in a circle.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError


def _number_kind(annotation: Any) -> str | None:
    """"int" or "float" for a field that takes a number and not a bool (``int``, ``float | None``,
    ...); None otherwise (``bool``, ``int | bool``, anything else)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = set(typing.get_args(annotation)) if union else {annotation}
    if bool in kinds or not kinds & {int, float}:
        return None
    return "int" if int in kinds else "float"


class SpecBase(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
        serialize_by_alias=True, frozen=True,
        use_attribute_docstrings=True,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's true and false are not numbers: pydantic would read ``totalSteps: true`` as 1."""
        if isinstance(value, bool) and info.field_name is not None:
            kind = _number_kind(cls.model_fields[info.field_name].annotation)
            if kind is not None:
                raise PydanticCustomError(f"{kind}_type", "Input should be a number, not true or false")
        return value
