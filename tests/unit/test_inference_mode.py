"""Rollout and log-prob stages run the policy in eval mode, also after an actor update.

``Actor.update`` leaves the model in train mode. Were the next rollout or
old-log-prob pass to run in it, dropout would perturb the sampled tokens and
the log-probs the PPO ratio divides by (and with gradient checkpointing
transformers turns the KV cache off wherever gradients are enabled). A tiny
random Llama with attention dropout 0.5, left in train mode as an update
leaves it, must sample and score exactly as the same model in eval mode.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from distflow import models
from distflow.engines.fsdp import RolloutWeights
from distflow.engines.rollout import SamplingParams, generate

pytestmark = pytest.mark.unit

VOCAB, PAD, BOS, EOS = 300, 0, 1, 2
CPU = torch.device("cpu")
PROMPTS = [[17, 45, 230, 9, 101], [33, 4, 250], [7, 8, 9, 10, 11, 12, 13]]
TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
SAMPLED = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6, micro_batch_size=4)


@pytest.fixture(scope="module")
def trained_mode_model():
    """The model as an actor update leaves it: dropout 0.5, train mode."""
    from transformers import AutoModelForCausalLM

    config = models.tiny_llama_config(VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    config.attention_dropout = 0.5
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def _rollout(model):
    with RolloutWeights(model).policy() as policy:
        return generate(policy, TOKENIZER, PROMPTS, [0, 1, 2], SAMPLED, seed=5, device=CPU)


def test_rollout_after_an_update_samples_as_the_eval_mode_policy(trained_mode_model):
    reference = _rollout(copy.deepcopy(trained_mode_model).eval())
    got = _rollout(trained_mode_model)
    assert torch.equal(got.token_fields["input_ids"], reference.token_fields["input_ids"])
    assert trained_mode_model.training  # the update's mode is given back after the rollout


def _old_log_probs(model, batch):
    from distflow.stages.model_passes import run_old_log_prob

    spec = SimpleNamespace(actor=SimpleNamespace(micro_batch_size=2, share_prompt_prefix=False, max_tokens_per_micro_batch=None),
                           rollout=SimpleNamespace(temperature=1.0))
    ctx = SimpleNamespace(spec=spec, models=SimpleNamespace(policy=model), tokenizer=TOKENIZER)
    return run_old_log_prob(ctx, SimpleNamespace(id="old_log_prob"), batch).token["old_log_probs"]


def test_old_log_probs_after_an_update_are_the_eval_mode_policy_s(trained_mode_model):
    batch = _rollout(copy.deepcopy(trained_mode_model).eval())
    reference = _old_log_probs(copy.deepcopy(trained_mode_model).eval(), batch)
    got = _old_log_probs(trained_mode_model, batch)
    assert torch.count_nonzero(reference) > 0
    assert torch.equal(got, reference)
    assert trained_mode_model.training
