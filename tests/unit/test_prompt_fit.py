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
