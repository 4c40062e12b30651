"""Reward functions: verl GSM8K strict/flexible, math, shaped arithmetic, user functions."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from distflow.data.sources import PromptRecord, gsm8k_ground_truth
from distflow.rewards import (
    REWARD_FNS,
    arithmetic_reward,
    compute_scores,
    default_reward_name,
    extract_gsm8k_answer,
    gsm8k_reward,
    last_boxed,
    load_reward_fn,
    math_reward,
)

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K_DIR = Path(os.environ.get("DISTFLOW_GSM8K_DIR", REPO_ROOT / ".." / "shared" / "data" / "gsm8k"))


def record(data_source: str, ground_truth: str) -> PromptRecord:
    return PromptRecord(uid="u", messages=({"role": "user", "content": "q"},), ground_truth=ground_truth,
                        data_source=data_source)


# --- gsm8k -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, strict, flexible",
    [
        ("So 48 + 24 = 72 clips.\n#### 72", "72", "72"),
        ("#### 5 then I changed my mind #### 7 apples", "7", "7"),
        ("It costs $1,080.", None, "1080"),
        ("#### $1,080.", "1080", "1080"),
        ("#### -7", "-7", "-7"),
        ("no digits here", None, None),
        ("I counted 3 and 4 and then got 12.5 in total...", None, "12.5"),
        ("#### 72" + " filler" * 60, None, None),  # verl looks at the last 300 characters only
    ],
)
def test_gsm8k_strict_takes_the_last_hashes_answer_and_flexible_the_last_number(response, strict, flexible):
    assert extract_gsm8k_answer(response, "strict") == strict
    assert extract_gsm8k_answer(response, "flexible") == flexible


def test_gsm8k_reward_scores_and_format_score():
    assert gsm8k_reward("2 + 3 = 5\n#### 5", "5", {}) == 1.0
    assert gsm8k_reward("#### 6", "5", {}) == 0.0
    assert gsm8k_reward("#### 6", "5", {}, format_score=0.1) == 0.1
    assert gsm8k_reward("the answer is 5", "5", {}, format_score=0.1) == 0.0  # strict: no answer found
    assert REWARD_FNS["gsm8k_flexible"]("the answer is 5", "5", {}) == 1.0
    assert gsm8k_reward("#### 1,080", "1080", {}) == 1.0
    with pytest.raises(ValueError, match="strict.*flexible"):
        extract_gsm8k_answer("x", "loose")


@pytest.mark.skipif(not (GSM8K_DIR / "train.jsonl").is_file(), reason="GSM8K data not found")
def test_gsm8k_reference_solutions_score_one_against_their_parsed_ground_truth():
    with open(GSM8K_DIR / "train.jsonl", encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(400)]
    truths = [gsm8k_ground_truth(r["answer"]) for r in rows]
    assert [gsm8k_reward(r["answer"], t, {}) for r, t in zip(rows, truths)] == [1.0] * 400
    # Scored against the next problem's truth, a solution is right only where both answers agree.
    wrong = [gsm8k_reward(r["answer"], t, {}) for r, t in zip(rows, truths[1:])]
    assert sum(wrong) == sum(a == b for a, b in zip(truths, truths[1:]))


# --- math --------------------------------------------------------------------------------------


def test_last_boxed_matches_nested_braces():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed("nothing") is None
    assert last_boxed(r"\boxed{unclosed") is None


def test_math_reward_with_math_verify_accepts_equivalent_forms():
    pytest.importorskip("math_verify")
    assert math_reward(r"The answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", {}) == 1.0
    assert math_reward(r"So we get $\boxed{0.5}$", r"\frac{1}{2}", {}) == 1.0
    assert math_reward(r"So we get $\boxed{3}$", "2", {}) == 0.0


def test_math_reward_works_outside_the_main_thread():
    result = []
    worker = threading.Thread(target=lambda: result.append(math_reward(r"$\boxed{4}$", "4", {})))
    worker.start()
    worker.join()
    assert result == [1.0]


def test_math_reward_falls_back_to_normalized_comparison_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    assert math_reward(r"thus \boxed{\dfrac{1}{2}}", r"\frac{1}{2}", {}) == 1.0
    assert math_reward(r"thus \boxed{2.50}", "2.5", {}) == 1.0
    assert math_reward(r"thus \boxed{\text{(B)}}", "(B)", {}) == 1.0
    assert math_reward(r"thus \boxed{3}", "2", {}) == 0.0


# --- arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, score",
    [
        ("85", 1.0),
        (" 85.\n", 1.0),
        ("37 + 48 = 85", 1.0),
        ("The answer is 85", 1.0),
        ("1,085", 0.1),  # well-formed, wrong (ground truth is 85)
        ("84", 0.1),
        ("The answer is 84.", 0.1),
        ("37 + 48 = 84", 0.1),
        ("(37 + 48) = 84.", 0.1),
        ("I think it is 84 apples", 0.0),
        ("To solve this, we need to combine the numbers 37 and 4", 0.0),
        ("eighty-five", 0.0),
        ("", 0.0),
    ],
)
def test_arithmetic_reward_is_shaped(response, score):
    assert arithmetic_reward(response, "85", {}) == score


def test_arithmetic_reward_handles_negative_and_comma_answers():
    assert arithmetic_reward("-11", "-11", {}) == 1.0
    assert arithmetic_reward("11", "-11", {}) == 0.1
    assert arithmetic_reward("1,085", "1085", {}) == 1.0
    assert arithmetic_reward("84", "85", {}, format_score=0.2) == 0.2


# --- dispatch and user functions ---------------------------------------------------------------


def test_compute_scores_dispatches_on_data_source():
    records = [record("openai/gsm8k", "72"), record("arithmetic", "85"), record("lighteval/MATH", "4")]
    responses = ["#### 72", "84", r"\boxed{4}"]
    assert [default_reward_name(r.data_source) for r in records] == ["gsm8k", "arithmetic", "math"]
    assert compute_scores(responses, records) == [1.0, 0.1, 1.0]
    assert compute_scores(responses, records, "gsm8k_flexible") == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 responses for 3 records"):
        compute_scores(responses[:2], records)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "LIMIT = 3\n"
        "def length_bonus(response, ground_truth, extra_info):\n"
        "    return min(len(response), LIMIT) + (ground_truth in response)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_rewards", None)


def test_user_reward_function_loads_from_module_colon_function(user_module):
    fn = load_reward_fn("my_rewards:length_bonus")
    assert fn("abcdef 7", "7", {}) == 4
    assert compute_scores(["x", "7"], [record("a", "7"), record("a", "7")], "my_rewards:length_bonus") == [1.0, 2.0]
    assert load_reward_fn(f"{user_module / 'my_rewards.py'}:length_bonus")("ab", "z", {}) == 2


def test_user_reward_function_errors_say_what_is_wrong(user_module):
    with pytest.raises(ValueError, match="has no function 'missing'.*length_bonus"):
        load_reward_fn("my_rewards:missing")
    with pytest.raises(ValueError, match="my_rewards.LIMIT is a int, not a function"):
        load_reward_fn("my_rewards:LIMIT")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'.*PYTHONPATH"):
        load_reward_fn("no_such_module_xyz:score")
    with pytest.raises(ValueError, match="file 'nowhere/r.py' not found"):
        load_reward_fn("nowhere/r.py:score")


def test_unknown_reward_name_lists_the_choices():
    choices = r"\['arithmetic', 'arithmetic_concise', 'gsm8k', 'gsm8k_flexible', 'math'\]"
    with pytest.raises(ValueError, match=r"unknown reward 'gsm9k'.*" + choices):
        load_reward_fn("gsm9k")
    assert load_reward_fn("math") is math_reward


@pytest.mark.parametrize("response, score", [
    ("17", 1.0), (" 17.", 1.0), ("17\n", 1.0), ("18", 0.1), ("12 + 5 = 17", 0.5),
    ("The answer is 17", 0.5), ("12 + 5 = 1", 0.0), ("", 0.0), ("-3", 0.1),
])
def test_arithmetic_concise_pays_most_for_the_asked_format(response, score):
    from distflow.rewards import arithmetic_concise_reward

    assert arithmetic_concise_reward(response, "17") == score


def test_a_reward_function_of_another_signature_is_refused_when_loaded(tmp_path):
    (tmp_path / "one_arg.py").write_text("def score(response):\n    return 1.0\n"
                                         "def loose(*args, **kwargs):\n    return 1.0\n")
    with pytest.raises(ValueError) as err:
        load_reward_fn(f"{tmp_path / 'one_arg.py'}:score")
    assert str(err.value) == (
        f"reward '{tmp_path / 'one_arg.py'}:score': {tmp_path / 'one_arg.py'}.score(response) cannot be called as "
        "score(response, ground_truth, extra_info) (too many positional arguments); give it that signature")
    assert load_reward_fn(f"{tmp_path / 'one_arg.py'}:loose")("x", "y", {}) == 1.0


def test_a_missing_function_lists_at_most_twenty_names_of_its_module():
    with pytest.raises(ValueError) as err:
        load_reward_fn("os:no_such_function")
    message = str(err.value)
    assert message.startswith("reward 'os:no_such_function': module 'os' has no function 'no_such_function'; it has [")
    listed = message.split("it has ")[1]
    assert listed.count("'") == 2 * 21 and listed.endswith(" more']")
