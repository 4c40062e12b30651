"""The step's fields: every tensor a stage hands on, declared once.

A step's samples travel between stages as a ``PackedBatch``. Token fields
are packed over prompt + response tokens (``[T_total]``, 0 on prompt tokens
unless said otherwise); sample fields have one row per sample (``[B]``).
Which role produces which field is declared here and nowhere else:

- the worker checks every stage's output against it where the stage hands
  the batch on (``check_stage_output``), and
- the planner's "reads a field nothing upstream produces" check looks the
  producers up here (``producers``).

Torch-free: the planner (and ``distflow plan``) import it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TOKEN = "token"
SAMPLE = "sample"


@dataclass(frozen=True)
class StepField:
    name: str
    per: Literal["token", "sample"]
    """``token``: one value per token, ``[T_total]``; ``sample``: one per sample, ``[B]``."""
    dtype: Literal["int", "float"]
    """The dtype kind every producer must hand on."""
    producers: tuple[str, ...]
    """Roles of the workflow nodes that add it (empty: the data coordinator adds it)."""
    doc: str

    @property
    def shape(self) -> str:
        return "[T_total]" if self.per == TOKEN else "[B]"


FIELDS: dict[str, StepField] = {f.name: f for f in (
    StepField("input_ids", TOKEN, "int", ("rollout",), "prompt then response token ids"),
    StepField("response_mask", TOKEN, "int", ("rollout",),
              "1 on the tokens the model sampled; 0 on the prompt and, in a multi-turn response, on the tool "
              "outputs and chat-template tokens between the model's turns (losses, counts and advantages "
              "cover the 1s only)"),
    StepField("rollout_log_probs", TOKEN, "float", ("rollout",),
              "the sampling policy's log-probs of the sampled tokens (vllm; hf in asynchronous mode): truncated importance sampling"),
    StepField("prompt_len", SAMPLE, "int", ("rollout",), "prompt tokens (chat template included)"),
    StepField("response_len", SAMPLE, "int", ("rollout",),
              "tokens after the prompt (prompt_len + response_len is the sample's length): the model's "
              "tokens plus, in a multi-turn response, the tool tokens; the model's own are sum(response_mask)"),
    StepField("env_reward", SAMPLE, "float", ("rollout",),
              "multi-turn with an environment: the rewards its steps returned, summed"),
    StepField("policy_version", SAMPLE, "int", ("rollout",),
              "asynchronous mode: optimizer steps the generating weights had taken (distflow.pools)"),
    StepField("group_index", SAMPLE, "int", ("rollout",),
              "the prompt's id in the run (step * trainBatchSize + i); the rollout.n samples of a prompt share it"),
    StepField("origin_rank", SAMPLE, "int", (), "the rank that generated the sample (data coordinator)"),
    StepField("origin_index", SAMPLE, "int", (), "the sample's position on that rank (data coordinator)"),
    StepField("token_level_scores", TOKEN, "float", ("reward",),
              "the outcome score on the last response_mask 1 token (the model's last)"),
    StepField("scores", SAMPLE, "float", ("reward",), "the outcome score of each response"),
    StepField("token_level_rewards", TOKEN, "float", ("reward_shaping",),
              "token_level_scores + overlong penalty - beta * KL; the advantage reads it when present"),
    StepField("values", TOKEN, "float", ("values",), "the critic's V(s_t) at rollout time"),
    StepField("ref_log_probs", TOKEN, "float", ("reference",), "log-probs of the sampled tokens under the reference"),
    StepField("old_log_probs", TOKEN, "float", ("old_log_prob",),
              "log-probs of the sampled tokens under the policy before the update"),
    StepField("advantages", TOKEN, "float", ("advantage",), "per-token advantages"),
    StepField("returns", TOKEN, "float", ("advantage",), "per-token returns (the critic's targets)"),
)}


def producers(*names: str) -> tuple[str, ...]:
    """Roles that produce any of the fields ``names``, in declaration order."""
    return tuple(role for name in names for role in FIELDS[name].producers)


def check_stage_output(role: str, node_id: str, token: dict, sample: dict) -> None:
    """A stage's new fields against their declarations (custom nodes may add anything).

    Args:
        token, sample: name -> tensor of the fields the stage adds (``[T_total]`` / ``[B]``).

    Raises:
        TypeError: an undeclared field, one this role does not produce, one of the wrong
            kind (token or sample), or a tensor of the wrong dtype kind or rank.
    """
    if role == "custom":
        return
    for per, fields in ((TOKEN, token), (SAMPLE, sample)):
        for name, tensor in fields.items():
            declared = FIELDS.get(name)
            if declared is None or role not in declared.producers:
                raise TypeError(f"workflow node {node_id}: role {role} added {name!r}, which "
                                f"distflow.fields does not declare for it; declare it there")
            dtype = "float" if tensor.dtype.is_floating_point else "int"
            if declared.per != per or declared.dtype != dtype or tensor.dim() != 1:
                raise TypeError(f"workflow node {node_id}: {name} is a {per} field of {dtype} "
                                f"{tuple(tensor.shape)}; distflow.fields declares {declared.dtype} "
                                f"{declared.shape}")
