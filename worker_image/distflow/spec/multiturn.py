"""The ``rollout.multiTurn`` section: rollouts of several turns with tools or an environment.

A response becomes a trajectory: model turn, tool (or environment) output,
model turn, ... within ``data.maxResponseLength`` tokens over all turns. Tools
are user functions ``module:function`` described in the OpenAI tool format
(``{type: function, function: {name, description, parameters}}``, what chat
templates render); an environment is a class ``module:Class`` with
``reset(record) -> observation`` and ``step(action_text) -> (observation,
reward, done)`` (gym's interface, as verl's interactions and TRL's
environments). The runtime is :mod:`distflow.multiturn`; these models only
hold and check the names (imports are the pre-flight's, :mod:`distflow.preflight`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from distflow.spec.base import SpecBase

TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
"""OpenAI's function names: letters, digits, underscores and dashes, at most 64."""
JSON_SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class ToolFunctionSpec(SpecBase):
    name: str
    """The name the model calls the tool by (`<tool_call>{"name": ...}`)."""
    description: str = ""
    """What the tool does, shown to the model."""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    """The arguments as a JSON schema of `type: object` (their `properties` and `required`)."""


class ToolSchemaSpec(SpecBase):
    type: Literal["function"] = "function"
    """Always `function` (the OpenAI tool format)."""
    function: ToolFunctionSpec
    """Name, description and parameters of the function."""


class ToolSpec(SpecBase):
    function: str = Field(min_length=1)
    """The Python function that runs a call: `module:function` (or `path/to/file.py:function`),
    called with the call's arguments as keywords; it returns the observation as a string."""
    tool_schema: ToolSchemaSpec
    """The tool in the OpenAI tool format (verl's `tool_schema`), rendered into the prompt by
    the chat template (`tools=`), or as Hermes-style system instructions by a template without
    tool support."""


class MultiTurnSpec(SpecBase):
    enable: bool = False
    """Roll out trajectories of several turns (off: one response per sample), with either
    `rollout.engine` (vllm with `rollout.tensorParallelSize: 1`)."""
    max_turns: int = Field(default=4, ge=1, le=64)
    """Model turns per trajectory at most (verl's `max_assistant_turns`)."""
    max_tokens_per_turn: int | None = Field(default=None, ge=1)
    """Tokens one model turn may generate (None: what is left of `data.maxResponseLength`, the
    budget over all turns, model and tool tokens together)."""
    tools: list[ToolSpec] = Field(default_factory=list, max_length=64)
    """The tools the model may call; a model turn that calls none ends the trajectory."""
    tool_call_format: Literal["hermes"] = "hermes"
    """How a model turn calls tools: `hermes` is `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` (Qwen2.5/3, Hermes, SmolLM3), any number per turn."""
    tool_timeout_seconds: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Wall seconds one tool call (or environment step) may take; a later answer is dropped
    and the call ends with an error observation (`multiturn/tool_errors/timeout`)."""
    max_tool_workers: int = Field(default=8, ge=1, le=256)
    """Tool calls (or environment steps) of a rank run at once, all samples' calls of a turn together."""
    environment: str | None = None
    """An environment class `module:Class` (or `path/to/file.py:Class`) for tasks that are not
    plain tools: one instance per sample, `reset(record)` returns the first observation (str or
    None, appended to the prompt as a user message), `step(action_text)` gets every model turn's
    text and returns `(observation, reward, done)`; the observation is the next user message and
    the rewards are summed into the sample field `env_reward` (reported as
    `multiturn/env_reward/mean`) and added to the reward function's score of the sample."""


def tool_problems(spec: MultiTurnSpec):
    """``rollout.multiTurn.<field>: what is wrong; the fix`` for each tool whose description cannot
    work, and a section with nothing to call (``JobSpec`` raises them with the other cross-field checks)."""
    names: dict[str, int] = {}
    for i, tool in enumerate(spec.tools):
        where = f"rollout.multiTurn.tools[{i}]"
        fn = tool.tool_schema.function
        if ":" not in tool.function:
            yield f"{where}.function: {tool.function!r} is not module:function; give e.g. mypkg.tools:search"
        if not TOOL_NAME.match(fn.name):
            yield (f"{where}.toolSchema.function.name: {fn.name!r} is not a tool name; use letters, digits, "
                   f"'_' and '-' (at most 64, not starting with a digit)")
        elif fn.name in names:
            yield (f"{where}.toolSchema.function.name: {fn.name!r} is also tools[{names[fn.name]}]'s; "
                   f"give each tool its own name")
        names.setdefault(fn.name, i)
        yield from (f"{where}.toolSchema.function.parameters{p}" for p in parameter_problems(fn.parameters))
    if spec.enable and not spec.tools and spec.environment is None:
        yield "rollout.multiTurn.enable: a multi-turn rollout needs something to call; add tools or an environment, or set enable: false"
    if spec.tools and spec.environment is not None:
        yield ("rollout.multiTurn.environment: tools and an environment together are not supported; give the environment "
               "the tools' work, or drop one")
    if spec.environment is not None and ":" not in spec.environment:
        yield f"rollout.multiTurn.environment: {spec.environment!r} is not module:Class; give e.g. mypkg.envs:GuessNumber"


def parameter_problems(parameters: dict[str, Any]):
    """``<sub-path>: problem; fix`` for a tool's parameters that is not an object JSON schema."""
    if parameters.get("type") != "object":
        yield f": type is {parameters.get('type')!r}; the arguments are a JSON object, use type: object"
        return
    props = parameters.get("properties", {})
    if not isinstance(props, dict):
        yield ".properties: must map each argument name to its schema"
        return
    for name, schema in props.items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        kinds = kind if isinstance(kind, list) else [kind]
        if not isinstance(schema, dict) or not all(k in JSON_SCHEMA_TYPES for k in kinds):
            yield (f".properties.{name}: {schema!r} is not a JSON schema with a type; give e.g. "
                   f"{{type: string, description: ...}} (types: {', '.join(JSON_SCHEMA_TYPES)})")
    required = parameters.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        yield (f".required: {required!r} must list names of properties ({sorted(props)}); "
               f"add the missing properties or drop them from required")
