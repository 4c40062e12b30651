"""Rule-based reward functions: response text + ground truth -> score.

Every function in :data:`REWARD_FNS` has the signature
``fn(response_text: str, ground_truth: str, extra_info: dict) -> float``;
user functions given as ``module:function`` must have it too.

- ``gsm8k`` / ``gsm8k_flexible``: verl's ``utils/reward_score/gsm8k.py``.
  Strict takes the last ``#### <number>`` of the response, flexible the last
  number anywhere; only the last 300 characters are searched, as in verl.
  Differences from verl, for robustness: commas, ``$`` and a trailing ``.``
  are stripped from the extracted answer in both modes (verl strips commas
  and ``$`` only in strict mode), and ``#### $72`` is accepted.
- ``math``: ``math_verify`` (``parse`` + ``verify``) when installed; else the
  last ``\\boxed{...}`` (or the whole response) against the ground truth after
  light normalisation (spaces, ``$``, ``\\left``/``\\right``, ``\\text{}``,
  trailing ``.``), then numerically if both sides are numbers.
- ``arithmetic``: shaped for small models (see :func:`arithmetic_reward`).
"""

from __future__ import annotations

import re
import threading
from functools import partial
from typing import Callable, Sequence

from distflow.data.records import PromptRecord
from distflow.errors import UserFunctionError
from distflow.names import BUILTIN_REWARDS, registry
from distflow.user_functions import load_user_function

RewardFn = Callable[[str, str, dict], float]

_SOLUTION_CLIP_CHARS = 300
_STRICT_RE = re.compile(r"#### \$?(-?[0-9.,]+)")
_NUMBER_RE = re.compile(r"-?[0-9.,]+")
_INTEGER_RE = re.compile(r"-?\d[\d,]*")
_NUMERIC_ANSWER_RE = re.compile(
    r"^\s*(?:the answer is:?|answer:)?\s*(?:[-+*/×÷()\d\s.,]+=)?\s*\$?-?\d[\d,]*(?:\.\d+)?\s*\.?\s*$",
    re.IGNORECASE,
)


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".")


def extract_gsm8k_answer(response: str, method: str = "strict") -> str | None:
    """The final answer of a response, verl-style, or None if there is none.

    Args:
        response: model output text.
        method: ``"strict"`` (last ``#### <number>``) or ``"flexible"`` (last number).

    Raises:
        ValueError: unknown ``method``.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k reward: method must be 'strict' or 'flexible', got {method!r}")
    tail = response[-_SOLUTION_CLIP_CHARS:]
    candidates = _STRICT_RE.findall(tail) if method == "strict" else _NUMBER_RE.findall(tail)
    for candidate in reversed(candidates):
        cleaned = _clean_number(candidate)
        if cleaned not in ("", "-", "."):
            return cleaned
    return None


def gsm8k_reward(
    response: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K reward (verl): ``score`` if the extracted answer equals the ground truth,
    ``format_score`` if an answer was found but differs, 0 if none was found."""
    answer = extract_gsm8k_answer(response, method)
    if answer is None:
        return 0.0
    return score if answer == _clean_number(ground_truth.strip()) else format_score


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def normalize_math_answer(text: str) -> str:
    """Light LaTeX normalisation for string comparison of final answers."""
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "$", " "):
        text = text.replace(token, "")
    text = text.replace("dfrac", "frac").replace("tfrac", "frac")
    return text.rstrip(".")


def _as_float(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _fallback_math_equal(response: str, ground_truth: str) -> bool:
    boxed = last_boxed(response)
    predicted = normalize_math_answer(boxed if boxed is not None else response)
    expected = normalize_math_answer(ground_truth)
    if predicted == expected:
        return True
    a, b = _as_float(predicted), _as_float(expected)
    return a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(b))


def math_reward(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the response's final answer is mathematically equal to the ground truth, else 0.0.

    Uses ``math_verify`` when installed (its signal-based timeouts only work in
    the main thread, so they are switched off elsewhere); the ground truth is
    wrapped in ``\\boxed{}`` so a bare answer such as ``1/2`` parses as LaTeX.
    """
    try:
        from math_verify import parse, verify
    except ImportError:
        return float(_fallback_math_equal(response, ground_truth))
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}"
    gold = parse(gold_text, parsing_timeout=timeout)
    predicted = parse(response, parsing_timeout=timeout)
    if not gold or not predicted:
        return float(_fallback_math_equal(response, ground_truth))
    return float(verify(gold, predicted, timeout_seconds=timeout))


def arithmetic_reward(
    response: str, ground_truth: str, extra_info: dict | None = None, *, format_score: float = 0.1
) -> float:
    """Shaped reward of the arithmetic task (:mod:`distflow.tasks`).

    - 1.0: the last integer of the response equals the ground truth (``"85"``,
      ``"37 + 48 = 85."`` and ``"The answer is 85"`` all score 1.0);
    - ``format_score`` (0.1): a well-formed but wrong numeric answer: just a
      number (``"84"``, ``"The answer is 84."``) or an equation ending in one
      (``"37 + 48 = 84"``);
    - 0.0: otherwise (prose, a truncated explanation, no number at all).

    Why the partial score: greedy SmolLM2-135M-Instruct gets about 1 in 10 of
    the 2-digit problems right and, when wrong, either states a wrong
    equation or starts a long explanation. Crediting the concise numeric form
    gives GRPO a spread within a group even when no sample is right, and it
    stays well below a correct answer so that format alone never pays best.
    """
    expected = ground_truth.strip().replace(",", "")
    integers = _INTEGER_RE.findall(response)
    if integers and integers[-1].replace(",", "") == expected:
        return 1.0
    return format_score if _NUMERIC_ANSWER_RE.match(response) else 0.0


_BARE_INTEGER_RE = re.compile(r"^\s*(-?\d[\d,]*)\s*\.?\s*$")


def arithmetic_concise_reward(
    response: str, ground_truth: str, extra_info: dict | None = None, *, format_score: float = 0.1
) -> float:
    """The arithmetic task as the prompt states it: "Answer with just the number".

    - 1.0: the response is exactly the right integer (``"85"``, ``" 85."``);
    - 0.5: the right integer ends a longer answer (``"37 + 48 = 85"``);
    - ``format_score`` (0.1): just an integer, but the wrong one;
    - 0.0: anything else.

    The quickstart uses it: a small instruct model mostly answers with an
    equation, which the response budget often cuts before the result. Paying
    most for the asked-for bare number gives GRPO a within-group spread from the
    first step, and what it teaches (follow the format, answer directly) shows
    on the held-out set within a few dozen CPU steps.
    """
    match = _BARE_INTEGER_RE.match(response)
    expected = ground_truth.strip().replace(",", "")
    if match:
        return 1.0 if match.group(1).replace(",", "") == expected else format_score
    integers = _INTEGER_RE.findall(response)
    return 0.5 if integers and integers[-1].replace(",", "") == expected else 0.0


REWARD_FNS: dict[str, RewardFn] = registry(BUILTIN_REWARDS, {
    "gsm8k": gsm8k_reward,
    "gsm8k_flexible": partial(gsm8k_reward, method="flexible"),
    "math": math_reward,
    "arithmetic": arithmetic_reward,
    "arithmetic_concise": arithmetic_concise_reward,
}, "data.rewardFn")


def default_reward_name(data_source: str) -> str:
    """Reward for a record's ``data_source``: gsm8k sources -> ``gsm8k``,
    ``arithmetic`` -> ``arithmetic``, anything else -> ``math``."""
    if "gsm8k" in data_source.lower():
        return "gsm8k"
    if data_source == "arithmetic":
        return "arithmetic"
    return "math"


def load_reward_fn(name_or_path: str) -> RewardFn:
    """A built-in reward by name, or a user function given as ``module:function``
    (or ``path/to/file.py:function``) with signature ``(response, ground_truth, extra_info) -> float``.

    Raises:
        ValueError: unknown name (lists the choices), module not importable,
            function missing or not callable.
    """
    if name_or_path in REWARD_FNS:
        return REWARD_FNS[name_or_path]
    if ":" not in name_or_path.strip(":"):
        raise ValueError(
            f"unknown reward {name_or_path!r}; choose one of {sorted(REWARD_FNS)} "
            f"or give a user function as 'module:function'"
        )
    return load_user_function(name_or_path, "reward", ("response", "ground_truth", "extra_info"))


def compute_scores(
    responses: Sequence[str], records: Sequence[PromptRecord], reward_name: str | None = None,
    where: str = "",
) -> list[float]:
    """Scores [B] of ``responses`` [B] against the ground truth of ``records`` [B].

    Args:
        reward_name: a built-in name or ``module:function``; None (or ``"auto"``)
            picks per record from its ``data_source`` (:func:`default_reward_name`).
        where: when the scoring happens (``step 3``), for the message of a reward that raises.

    Raises:
        ValueError: lengths differ, or ``reward_name`` cannot be resolved.
        UserFunctionError: the reward function raised or returned no number on a sample; the
            message names the function, the sample (record uid, ground truth, response) and ``where``.
    """
    if len(responses) != len(records):
        raise ValueError(f"compute_scores: {len(responses)} responses for {len(records)} records")
    fixed = None if reward_name in (None, "auto") else load_reward_fn(reward_name)
    scores = []
    for response, record in zip(responses, records, strict=True):
        fn = fixed or REWARD_FNS[default_reward_name(record.data_source)]
        try:
            scores.append(float(fn(response, record.ground_truth, record.extra_info)))
        except Exception as err:  # noqa: BLE001 - whatever the user's code raises, say where
            name = reward_name if fixed else default_reward_name(record.data_source)
            raise UserFunctionError(
                f"data.rewardFn {name!r} raised {type(err).__name__}: {err} {where + ' ' if where else ''}"
                f"on sample {record.uid} (ground truth {record.ground_truth!r}, response {response[:120]!r}); "
                "fix the function (it must return a float for every response), then run again: "
                "training resumes from the last checkpoint") from err
    return scores
