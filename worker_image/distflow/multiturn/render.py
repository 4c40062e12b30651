"""Token ids of the prompt (with the tools) and of what is appended between turns.

Only new text is ever tokenized: a turn's observation is rendered by the chat
template as a *delta*. ``render_delta`` templates a fixed conversation (user,
assistant) with and without the new messages and keeps the tokens after the
assistant's end-of-turn token (verl's agent loop does the same with a system
prefix). The ids of earlier turns are never produced by the tokenizer again.
"""

from __future__ import annotations

from typing import Any

from distflow.engines.rollout import render_prompt
from distflow.multiturn.calls import hermes_system_prompt

_FIXED = ({"role": "user", "content": "0"}, {"role": "assistant", "content": "1"})
"""The conversation the delta is taken against: any short one does, the template is what matters."""


def template_ids(tokenizer, messages, add_generation_prompt: bool, tools=None) -> list[int]:
    """``apply_chat_template`` as a list of token ids (whatever the transformers version returns)."""
    kwargs = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def renders_tools(tokenizer, schemas: list[dict[str, Any]]) -> bool:
    """Whether the chat template shows ``tools=`` to the model (SmolLM2's, for one, ignores them)."""
    return template_ids(tokenizer, _FIXED[:1], True, schemas) != template_ids(tokenizer, _FIXED[:1], True)


def render_tool_prompt(tokenizer, record, system_prompt: str | None, schemas: list[dict[str, Any]],
                       observation: str | None = None) -> list[int]:
    """A record's prompt ids with the tools shown and, if given, a first observation as a user message.

    The template renders the tools where it can; otherwise hermes instructions listing them
    (``calls.hermes_system_prompt``) join the system prompt (``data.systemPrompt``, else the record's).
    """
    messages = list(record.messages) + ([{"role": "user", "content": observation}] if observation else [])
    shown = type(record)(**{**vars(record), "messages": tuple(messages)}) if observation else record
    if not schemas or renders_tools(tokenizer, schemas):
        return _with_tools(tokenizer, shown, system_prompt, schemas)
    own = next((m["content"] for m in record.messages if m.get("role") == "system"), None)
    system = "\n\n".join(s for s in (system_prompt or own, hermes_system_prompt(schemas)) if s)
    return render_prompt(tokenizer, shown, system)


def _with_tools(tokenizer, record, system_prompt, schemas) -> list[int]:
    if not schemas:
        return render_prompt(tokenizer, record, system_prompt)
    messages = list(record.messages)
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}] + [m for m in messages if m.get("role") != "system"]
    return template_ids(tokenizer, messages, True, schemas)


def render_delta(tokenizer, messages: list[dict[str, Any]], end_ids: set[int], closed: bool) -> list[int]:
    """Token ids that follow a model turn: ``messages`` (tool results, an observation) and the
    next assistant generation prompt, as the chat template renders them after an assistant turn.

    Args:
        end_ids: the end-of-turn / EOS token ids (``eos_token_ids``).
        closed: whether the model's turn ended with one of ``end_ids``; if not (cut at
            ``maxTokensPerTurn``), the template's end-of-turn token opens the delta.
    Raises:
        ValueError: the template renders a conversation's start differently once more messages
            follow (the delta is then not well defined); fix the chat template.
    """
    base = template_ids(tokenizer, _FIXED, False)
    full = template_ids(tokenizer, list(_FIXED) + list(messages), True)
    if full[:len(base)] != base:
        raise ValueError("rollout.multiTurn: the chat template renders a conversation's first messages "
                         "differently once tool or user messages follow, so the tokens to append cannot be "
                         "taken as a suffix; use a template whose renderings extend each other")
    ends = [i for i, t in enumerate(base) if t in end_ids]
    if not ends:
        return full[len(base):]
    return full[ends[-1] + (1 if closed else 0):]
