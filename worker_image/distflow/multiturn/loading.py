"""The tools and the environment a spec names, loaded like the reward function.

``load_tools`` / ``load_environment`` import them (cached per process, through
``distflow.user_functions``); the pre-flight (``distflow validate`` and every
launcher) calls ``multi_turn_problems`` so a typo fails before any worker starts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from distflow.spec.multiturn import MultiTurnSpec
from distflow.user_functions import load_user_function


@dataclass(frozen=True)
class Tool:
    name: str
    """``toolSchema.function.name``."""
    function: Callable[..., Any]
    """Called with the call's arguments as keywords; returns the observation (a str)."""
    schema: dict[str, Any]
    """The OpenAI tool format, for the chat template's ``tools=``."""


def load_tools(spec: MultiTurnSpec) -> dict[str, Tool]:
    """name -> ``Tool`` for each of ``spec.tools``.

    Raises:
        ValueError: a function that cannot be imported, is not callable, or cannot take the
            schema's required parameters as keywords (message names the tool).
    """
    tools = {}
    for tool, schema in zip(spec.tools, tool_schemas(spec)):
        name = schema["function"]["name"]
        fn = load_user_function(tool.function, f"tool {name!r}")
        _check_parameters(fn, tool.function, name, schema["function"]["parameters"])
        tools[name] = Tool(name, fn, schema)
    return tools


def tool_schemas(spec: MultiTurnSpec) -> list[dict[str, Any]]:
    """The tools in the OpenAI format, as the chat template gets them (nothing imported)."""
    return [tool.tool_schema.model_dump(by_alias=True, exclude_none=True) for tool in spec.tools]


def _check_parameters(fn: Callable, ref: str, name: str, parameters: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the call will tell
        return
    required = {k: None for k in parameters.get("required", [])}
    try:
        signature.bind(**required)
    except TypeError as err:
        raise ValueError(f"tool {name!r} {ref!r}: {fn.__name__}{signature} cannot be called with the schema's "
                         f"required parameters {sorted(required)} as keywords ({err}); make its signature and "
                         f"toolSchema.function.parameters agree") from None
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    unknown = set(parameters.get("properties", {})) - set(signature.parameters)
    if unknown and not accepts_any:
        raise ValueError(f"tool {name!r} {ref!r}: {fn.__name__}{signature} takes no parameter {sorted(unknown)} "
                         f"of its schema; add them to the function or drop them from toolSchema.function.parameters")


def load_environment(spec: MultiTurnSpec) -> type | None:
    """The environment class of ``spec.environment`` (None when unset).

    Raises:
        ValueError: it cannot be imported, is not a class, or lacks ``reset`` or ``step``.
    """
    if spec.environment is None:
        return None
    cls = load_user_function(spec.environment, "environment")
    if not isinstance(cls, type):
        raise ValueError(f"environment {spec.environment!r}: {cls!r} is not a class; give a class with "
                         f"reset(record) and step(action_text)")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {spec.environment!r}: {cls.__name__} has no {' or '.join(missing)} "
                         f"method; give it reset(record) -> observation and "
                         f"step(action_text) -> (observation, reward, done)")
    return cls


def multi_turn_problems(spec: MultiTurnSpec):
    """``spec.rollout.multiTurn.<field>: problem`` for each tool or environment that does not load."""
    if not spec.enable:
        return
    for i, tool in enumerate(spec.tools):
        try:
            load_tools(spec.model_copy(update={"tools": [tool]}))
        except ValueError as err:
            yield f"spec.rollout.multiTurn.tools[{i}].function: {err}"
    try:
        load_environment(spec)
    except ValueError as err:
        yield f"spec.rollout.multiTurn.environment: {err}"
