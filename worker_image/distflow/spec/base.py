"""The base of every spec model: camelCase aliases, unknown fields rejected, frozen.

Its own module so that the spec's sections can live in several files
(``distflow.spec.models``, ``distflow.spec.pod``) without importing each other in a circle.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecBase(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
        serialize_by_alias=True, frozen=True,
        use_attribute_docstrings=True,
    )
