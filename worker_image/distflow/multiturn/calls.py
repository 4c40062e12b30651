"""Tool calls in a model turn's text, in the hermes format, and the instructions that teach it.

Hermes (NousResearch's function-calling format, used by Qwen2.5/3's chat
templates): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One call a model turn asked for."""

    name: str
    """The tool's name (``toolSchema.function.name``); empty when ``error`` is set."""
    arguments: dict[str, Any]
    """Keyword arguments for the tool's function."""
    error: str | None = None
    """Why the call could not be read (bad JSON, no name, arguments not an object); the tool
    is not run and this becomes its observation (``multiturn/tool_errors/parse``)."""


def parse_hermes_calls(text: str, known: set[str]) -> list[ToolCall]:
    """The calls in ``text``, in order; ``[]`` when it has none.

    An opening ``<tool_call>`` without its closing tag, bad JSON, a name not in
    ``known`` or arguments that are not an object give a call with ``error`` set.
    """
    calls = [_read_call(body, known) for body in _CALL.findall(text)]
    if text.count(OPEN_TAG) > len(calls):
        calls.append(ToolCall("", {}, "a <tool_call> is not closed with </tool_call>"))
    return calls


def _read_call(body: str, known: set[str]) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", {}, f"the tool call is not JSON ({err.msg} at character {err.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", {}, 'the tool call has no "name"; write {"name": ..., "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if name not in known:
        return ToolCall("", {}, f"no tool {name!r}; the tools are {sorted(known)}")
    if not isinstance(arguments, dict):
        return ToolCall("", {}, f'the "arguments" of {name!r} are not a JSON object')
    return ToolCall(name, arguments)


def hermes_system_prompt(schemas: list[dict[str, Any]]) -> str:
    """Instructions listing the tools, for a chat template that does not render ``tools=``
    (Qwen2.5's own template text)."""
    listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
