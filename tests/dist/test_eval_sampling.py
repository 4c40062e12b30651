"""Sampled evaluation (verl's mean@n) does not depend on the world size.

Each held-out prompt's responses are seeded by the prompt's index in the whole
eval set and the response index, with one seed for every rank, as training
rollouts are seeded per global sample. So 1 worker and 2 workers score the
untrained policy identically and write the same responses for the prompts
both loggers print (rank 0's share: prompts 0-3 with 1 worker, 0, 2, 4, 6 with 2).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from distflow.metrics import read_jsonl
from distflow.launcher import launch_local
from tests.dist._jobs import tiny_job_spec, varied_prompts

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


def _eval_at_step_0(tmp_path, num_nodes: int) -> tuple[float, dict[str, list[str]]]:
    name = f"world{num_nodes}"
    spec = tiny_job_spec(
        tmp_path, name,
        data={"eval": {"path": varied_prompts(tmp_path / "eval.jsonl", n=12)}},
        rollout={"val": {"n": 2, "temperature": 1.0}},
        cluster={"numNodes": num_nodes, "procsPerNode": 1, "device": "cpu"},
        trainer={"totalSteps": 1, "seed": 3, "logDir": str(tmp_path / name), "numThreads": 1},
        checkpoint={"dir": None},
    )
    launch_local(spec, name, progress=False)
    records = read_jsonl(tmp_path / name / "metrics.jsonl")
    score = next(r["eval/score"] for r in records if r.get("training/step") == 0 and "eval/score" in r)
    responses: dict[str, list[str]] = defaultdict(list)
    for sample in read_jsonl(tmp_path / name / "eval_samples.jsonl"):
        if sample["step"] == 0:
            responses[sample["prompt"]].append(sample["response"])
    return score, {prompt: sorted(texts) for prompt, texts in responses.items()}


def test_sampled_eval_is_the_same_on_one_and_two_workers(tmp_path):
    one_score, one = _eval_at_step_0(tmp_path, 1)
    two_score, two = _eval_at_step_0(tmp_path, 2)
    shared = one.keys() & two.keys()
    assert len(shared) == 2, (sorted(one), sorted(two))  # prompts 0 and 2
    assert {p: one[p] for p in shared} == {p: two[p] for p in shared}
    # Sampling at temperature 1 gives each prompt two different answers somewhere (not a greedy rerun).
    assert any(len(set(texts)) > 1 for texts in one.values()), one
    assert one_score == pytest.approx(two_score, abs=1e-12), (one_score, two_score)
