"""data.truncation: over-long prompts stop the job, are dropped, or are cut from the left.

A stand-in "tokenizer" counts a prompt's words; records 1 and 3 have 5 and 7
words, over the limit of 4.
"""

import pytest

from distflow.data.prompt_fit import Overlong, SubsetSource, fit_prompts, scan_share
from distflow.data.sources import PromptRecord
from distflow.errors import DistflowConfigError
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit

WORDS = [2, 5, 4, 7, 1]


class Words:
    num_records = len(WORDS)

    def read(self, indices):
        return [PromptRecord(f"r{i}", ({"role": "user", "content": " ".join(["w"] * WORDS[i])},), "", "x")
                for i in indices]


def words(record) -> int:
    return len(record.messages[0]["content"].split())


def overlong_of_all_ranks(world: int) -> list[Overlong]:
    found = [o for rank in range(world) for o in scan_share(Words(), rank, world, 4, words)]
    return sorted(found, key=lambda o: o.index)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_scan_disjoint_shares_that_together_find_every_overlong_prompt(world):
    assert overlong_of_all_ranks(world) == [Overlong(1, "r1", 5), Overlong(3, "r3", 7)]


def test_error_names_the_field_the_limit_and_the_longest_prompt():
    with pytest.raises(DistflowConfigError) as err:
        fit_prompts(Words(), overlong_of_all_ranks(2), "error", 4, "data.train")
    message = str(err.value)
    assert "spec.data.train: 2 prompt(s) exceed data.maxPromptLength=4" in message
    assert "'r3' (record 3) with 7" in message and "data.truncation: filter" in message


def test_filter_keeps_the_prompts_that_fit_in_order():
    source = fit_prompts(Words(), overlong_of_all_ranks(2), "filter", 4, "data.train")
    assert isinstance(source, SubsetSource) and source.num_records == 3
    assert [r.uid for r in source.read([0, 1, 2])] == ["r0", "r2", "r4"]


def test_left_and_nothing_overlong_keep_the_source():
    source = Words()
    assert fit_prompts(source, overlong_of_all_ranks(1), "left", 4, "data.train") is source
    assert fit_prompts(source, [], "error", 4, "data.train") is source


def test_filter_that_leaves_nothing_is_an_error():
    everything = [Overlong(i, f"r{i}", 9) for i in range(len(WORDS))]
    with pytest.raises(DistflowConfigError, match="every prompt exceeds"):
        fit_prompts(Words(), everything, "filter", 4, "data.eval")


def test_truncation_is_a_spec_choice_and_error_by_default():
    base = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}}}
    assert parse_spec(base).data.truncation == "error"
    assert parse_spec({**base, "data": {**base["data"], "truncation": "filter"}}).data.truncation == "filter"
    with pytest.raises(Exception, match="truncation"):
        parse_spec({**base, "data": {**base["data"], "truncation": "right"}})


def _arithmetic(max_prompt_length: int, truncation: str, **data):
    return parse_spec({"model": {"path": "tiny:byte"},
                       "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 2,
                                "maxPromptLength": max_prompt_length, "truncation": truncation, **data}})


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    from distflow.models import build_tiny_model

    return build_tiny_model("byte", tmp_path_factory.mktemp("cache"))


def test_a_max_prompt_length_shorter_than_the_chat_template_fails_before_workers(byte_model):
    """The byte tokenizer's ChatML template around an empty user message is 19 tokens (bytes and
    3 specials), so 10 leaves no room for any question, whatever data.truncation says."""
    from distflow.preflight import prompt_length_problems

    for truncation in ("error", "filter", "left"):
        assert list(prompt_length_problems(_arithmetic(10, truncation), byte_model)) == [
            "spec.data.maxPromptLength: 10 tokens, but the chat template alone takes 19 tokens, so no prompt "
            "fits; raise data.maxPromptLength above 19 plus the length of a question"]
    with_system = _arithmetic(30, "left", systemPrompt="Answer with a number.")
    assert "chat template and data.systemPrompt alone take" in next(prompt_length_problems(with_system, byte_model))


def test_a_first_prompt_over_the_limit_fails_before_workers_only_when_truncation_is_error(byte_model):
    """Arithmetic's first training prompt renders to 64 byte tokens."""
    from distflow.preflight import check_prompt_lengths

    with pytest.raises(DistflowConfigError, match=(
            r"spec.data.maxPromptLength: 40 tokens, but the first prompt of data.train renders to 64 tokens "
            r"\(chat template included\) and data.truncation is error; raise data.maxPromptLength to at least 64")):
        check_prompt_lengths(_arithmetic(40, "error"), byte_model)
    check_prompt_lengths(_arithmetic(64, "error"), byte_model)
    check_prompt_lengths(_arithmetic(40, "filter"), byte_model)  # the workers drop and count them
    check_prompt_lengths(_arithmetic(40, "left"), byte_model)


def test_validate_checks_prompt_lengths_once_the_model_is_on_disk(byte_model, tmp_path, monkeypatch, capsys):
    import yaml

    from distflow import cli

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "tiny:byte"},
                                      "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 2,
                                               "maxPromptLength": 40, "truncation": "error"}}))
    monkeypatch.setenv("DISTFLOW_CACHE", str(tmp_path / "empty"))
    assert cli.main(["validate", str(config)]) == 0  # no model on disk: validate converts and builds nothing
    monkeypatch.setenv("DISTFLOW_CACHE", str(byte_model.parent.parent))
    assert cli.main(["validate", str(config)]) == 2
    assert "the first prompt of data.train renders to 64 tokens" in capsys.readouterr().err


def test_the_tools_shown_to_a_multi_turn_model_count_against_max_prompt_length(byte_model):
    """The hermes tool instructions join the prompt: 100 tokens fit the bare template, not the tools."""
    from distflow.preflight import prompt_length_problems

    calculator = {"function": "distflow.multiturn.tools.calculator:calculate",
                  "toolSchema": {"type": "function", "function": {
                      "name": "calculate", "description": "Evaluate an arithmetic expression.",
                      "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                     "required": ["expression"]}}}}
    plain = _arithmetic(100, "left")
    assert list(prompt_length_problems(plain, byte_model)) == []
    spec = parse_spec({**plain.model_dump(by_alias=True, exclude_unset=True),
                       "rollout": {"multiTurn": {"enable": True, "tools": [calculator]}}})
    [problem] = prompt_length_problems(spec, byte_model)
    assert problem.startswith("spec.data.maxPromptLength: 100 tokens, but the chat template and the tools of "
                              "rollout.multiTurn alone take ")
