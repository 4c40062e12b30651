"""``rollout.multiTurn`` is checked before any worker starts: each bad config names its field and the fix."""

from __future__ import annotations

import pytest

from distflow.errors import DistflowConfigError
from distflow.preflight import function_problems
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit

CALC = "distflow.multiturn.tools.calculator:calculate"
TOOLS = "tests.unit.multiturn_tools"


def spec(rollout=None, **turns):
    doc = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}},
           "rollout": {**(rollout or {}), "multiTurn": {"enable": True, **turns}}}
    return parse_spec(doc)


def tool(function=CALC, name="calculate", parameters=None):
    fn = {"name": name, "parameters": parameters or {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}
    return {"function": function, "toolSchema": {"type": "function", "function": fn}}


def problems(**turns) -> list[str]:
    return list(function_problems(spec(**turns)))


def rejected(rollout=None, **turns) -> str:
    with pytest.raises((ValueError, DistflowConfigError)) as err:
        spec(rollout, **turns)
    return str(err.value)


def test_a_good_section_loads_and_passes_the_preflight():
    s = spec(tools=[tool()], maxTurns=3, toolTimeoutSeconds=2.5, maxToolWorkers=4)
    assert s.rollout.multi_turn.max_turns == 3 and s.rollout.multi_turn.tools[0].tool_schema.function.name == "calculate"
    assert problems(tools=[tool()]) == []
    assert problems(environment=f"{TOOLS}:Countdown") == []


@pytest.mark.parametrize("turns, field, fix", [
    ({"maxTurns": 0, "tools": [tool()]}, "rollout.multiTurn.maxTurns", "greater than or equal to 1"),
    ({}, "rollout.multiTurn.enable", "add tools or an environment"),
    ({"tools": [tool(name="9 lives")]}, "tools[0].toolSchema.function.name", "letters, digits"),
    ({"tools": [tool(), tool()]}, "tools[1].toolSchema.function.name", "its own name"),
    ({"tools": [tool(parameters={"type": "array"})]}, "tools[0].toolSchema.function.parameters", "use type: object"),
    ({"tools": [tool(parameters={"type": "object", "properties": {"x": {"type": "text"}}})]},
     "tools[0].toolSchema.function.parameters.properties.x", "JSON schema with a type"),
    ({"tools": [tool(parameters={"type": "object", "properties": {}, "required": ["x"]})]},
     "tools[0].toolSchema.function.parameters.required", "must list names of properties"),
    ({"tools": [tool(function="calculator")]}, "tools[0].function", "not module:function"),
    ({"tools": [tool()], "environment": f"{TOOLS}:Countdown"}, "rollout.multiTurn.environment", "not supported"),
    ({"environment": "Countdown"}, "rollout.multiTurn.environment", "not module:Class"),
    ({"environment": f"{TOOLS}:Countdown", "maxTokensPerTurn": 10_000}, "maxTokensPerTurn", "use at most that"),
])
def test_bad_sections_are_rejected_naming_the_field(turns, field, fix):
    message = rejected(**turns)
    assert field in message and fix in message, message


def test_the_vllm_engine_runs_multi_turn_rollouts():
    s = spec({"engine": "vllm"}, environment=f"{TOOLS}:Countdown")
    assert s.rollout.engine == "vllm" and s.rollout.multi_turn.enable


def test_a_tensor_parallel_vllm_engine_is_refused_with_the_way_out():
    doc = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
           "cluster": {"numNodes": 1, "procsPerNode": 2},
           "rollout": {"engine": "vllm", "tensorParallelSize": 2,
                       "multiTurn": {"enable": True, "environment": f"{TOOLS}:Countdown"}}}
    parse_spec({**doc, "rollout": {**doc["rollout"], "multiTurn": {"enable": False}}})  # fine without multi-turn
    with pytest.raises((ValueError, DistflowConfigError)) as err:
        parse_spec(doc)
    message = str(err.value)
    assert "rollout.tensorParallelSize: 2; multi-turn" in message and "set it to 1" in message, message
    assert message.count("rollout.tensorParallelSize") == 1, message  # the only problem of the config


@pytest.mark.parametrize("turns, field, fix", [
    ({"tools": [tool(function="no_such_module_xyz:calc")]}, "tools[0].function", "cannot import module"),
    ({"tools": [tool(function=f"{TOOLS}:nothing")]}, "tools[0].function", "has no function 'nothing'"),
    ({"tools": [tool(function=f"{TOOLS}:lookup")]}, "tools[0].function", "cannot be called with the schema's"),
    ({"tools": [tool(function=f"{TOOLS}:sleepy", parameters={
        "type": "object", "properties": {"seconds": {"type": "number"}, "unit": {"type": "string"}}})]},
     "tools[0].function", "takes no parameter ['unit']"),
    ({"environment": f"{TOOLS}:lookup"}, "rollout.multiTurn.environment", "is not a class"),
    ({"environment": f"{TOOLS}:FIXED_OBSERVATION"}, "rollout.multiTurn.environment", "not a function"),
    ({"environment": f"{TOOLS}:NoStep"}, "rollout.multiTurn.environment", "NoStep has no step method"),
])
def test_functions_that_do_not_load_fail_the_preflight(turns, field, fix):
    (message,) = problems(**turns)
    assert message.startswith("spec.rollout.multiTurn.") and field in message and fix in message, message
