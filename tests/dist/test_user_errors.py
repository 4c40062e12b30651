"""A job whose user code fails, or that resumes under another model, fails with a reason a user can act on."""

import json

import pytest
from _jobs import tiny_job_spec
from distflow.checkpoint import complete_checkpoints
from distflow.errors import DistflowConfigError, UserFunctionError
from distflow.launcher import launch_local

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_a_raising_reward_fails_the_job_with_its_reason_and_a_resume_under_another_model_is_refused(tmp_path):
    spec = tiny_job_spec(tmp_path, "job", reward="fails_in_step_2", checkpoint={"saveEverySteps": 1})
    with pytest.raises(UserFunctionError) as err:
        launch_local(spec, "job", progress=False)
    message = str(err.value)
    assert message.startswith(f"data.rewardFn '{spec.data.reward_fn}' raised KeyError: 'answer' at step 2 "
                              "on sample train-"), message
    assert "Traceback" not in message and "fix the function" in message
    # The step-1 checkpoint is intact, and records what it was made from.
    (last,) = complete_checkpoints(spec.checkpoint.dir, checksums=True)
    assert last.name == "step_00000001"
    made_from = json.loads((last / "trainer.json").read_text())["made_from"]
    assert made_from["model.path"] == "tiny" and made_from["critic"] is False
    assert made_from["model shape"]["num_hidden_layers"] > 0

    other_model = tiny_job_spec(tmp_path, "job", model={"path": "tiny:byte"})
    with pytest.raises(DistflowConfigError) as refused:
        launch_local(other_model, "job", progress=False)
    text = str(refused.value)
    assert (f"spec.checkpoint.dir: the step-1 checkpoint at {last} cannot resume this run: model.path: the "
            "checkpoint was made with 'tiny', this run has 'tiny:byte'") in text
    assert "--no-resume" in text
    assert [p.name for p in complete_checkpoints(spec.checkpoint.dir)] == ["step_00000001"]  # untouched
