"""The actor and critic updates copy from the device to the host a fixed number of times per
optimizer step, however many micro-batches it has.

On CUDA ``float(t)``, ``t.item()``, ``t.tolist()``, ``t.cpu()`` of a device tensor wait for the
GPU to drain. The tests follow what is device-resident on a GPU run (the model's parameters
and gradients, the step's token and sample fields, everything computed from them) through a
``TorchFunctionMode`` and count such conversions of it during one update, with shared prompt
prefixes (whose rows are laid out on the host): the count must not grow from 2 micro-batches
to 6.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from distflow import models
from distflow.data.batch import PackedBatch
from distflow.engines.actor import Actor
from distflow.engines.critic import Critic, ValueModel
from distflow.metrics import StepMetrics
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit

VOCAB = 300
HOST_COPIES = frozenset({"__float__", "__int__", "__bool__", "item", "tolist", "cpu", "numpy"})


class DeviceToHostCounter(TorchFunctionMode):
    """Counts host conversions of tensors that would live on the accelerator: ``roots``, the
    gradients of ``params`` and any op's output computed from one of them, except a host
    conversion's own output (that is on the host)."""

    def __init__(self, params: list[torch.Tensor], roots: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = params
        self.device = {id(t): t for t in [*params, *roots]}  # strong refs: ids stay unique
        self.copies: list[str] = []

    def _on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (id(t) in self.device or any(t is p.grad for p in self.params))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tree_flatten((args, kwargs))[0]
        from_device = any(self._on_device(t) for t in inputs)
        name = getattr(func, "__name__", "")
        if from_device and name in HOST_COPIES:
            self.copies.append(name)
        out = func(*args, **kwargs)
        if from_device and name == "cpu":
            out = out.clone()  # a host tensor, as on CUDA (a CPU tensor's .cpu() is the tensor itself)
        if from_device and name not in HOST_COPIES:
            self.device.update({id(t): t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)})
        return out


def _batch(num_samples: int) -> PackedBatch:
    """GRPO groups of two responses to one prompt (micro-batches of 2 share a prompt row)."""
    gen = torch.Generator().manual_seed(num_samples)
    prompts = [torch.randint(3, VOCAB, (3 + i % 3,), generator=gen) for i in range(num_samples // 2)]
    responses = [torch.randint(3, VOCAB, (2 + i % 4,), generator=gen) for i in range(num_samples)]
    ids = torch.cat([torch.cat([prompts[i // 2], r]) for i, r in enumerate(responses)])
    prompt_lens = torch.tensor([len(prompts[i // 2]) for i in range(num_samples)])
    response_lens = torch.tensor([len(r) for r in responses])
    mask = torch.cat([torch.tensor([0] * p + [1] * r, dtype=torch.int8) for p, r in zip(prompt_lens, response_lens)])
    on_response = lambda: torch.randn(len(ids), generator=gen, dtype=torch.float64) * mask  # noqa: E731
    return PackedBatch(prompt_lens + response_lens,
                       {"input_ids": ids, "response_mask": mask, "advantages": on_response(),
                        "ref_log_probs": on_response(), "values": on_response(), "returns": on_response()},
                       {"prompt_len": prompt_lens, "response_len": response_lens,
                        "group_index": torch.arange(num_samples) // 2})


def _host_copies(role: str, num_samples: int) -> list[str]:
    """Host conversions of device data in one update of ``num_samples`` samples, two per micro-batch."""
    from transformers import AutoModelForCausalLM

    config = models.tiny_llama_config(VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 2},
                       "actor": {"microBatchSize": 2, "sharePromptPrefix": True},
                       "critic": {"microBatchSize": 2},
                       "algorithm": {"useKlLoss": True, "entropyCoeff": 0.01}})
    cpu = torch.device("cpu")
    engine = (Actor.build(spec, model, 0, 1, cpu) if role == "actor"
              else Critic.build(spec, ValueModel(model.model).double(), 0, 1, cpu))
    batch = _batch(num_samples)
    counter = DeviceToHostCounter(list(engine.model.parameters()),
                                  [*batch.token_fields.values(), *batch.sample_fields.values()])
    with counter:
        engine.update(batch, StepMetrics())
    return counter.copies


# Per optimizer step: the global token count, the micro-batches' metadata (``metadata_on_host``),
# the metrics (one ``tolist``) and the gradient norm; the critic's explained variance adds its
# global sums.
PER_STEP = {"actor": 4, "critic": 5}


@pytest.mark.parametrize("role", list(PER_STEP))
def test_host_copies_per_step_do_not_grow_with_the_micro_batches(role):
    few, many = _host_copies(role, 4), _host_copies(role, 12)
    assert sorted(many) == sorted(few), (few, many)
    assert len(few) == PER_STEP[role], few


def test_device_metrics_reach_the_step_metrics_in_one_copy():
    from distflow.metrics import DeviceMetrics

    stats, metrics = DeviceMetrics(), StepMetrics()
    # (loss share, clip fraction, tokens, |logp diff| max) of three micro-batches, on the "device"
    micro_batches = [torch.tensor(v, dtype=torch.float64)
                     for v in [(0.5, 0.25, 4.0, 0.1), (1.5, 0.5, 12.0, 0.7), (-0.25, 0.0, 2.0, 0.3)]]
    counter = DeviceToHostCounter([], micro_batches)
    with counter:
        for loss, clipfrac, tokens, diff in micro_batches:
            stats.add_sum("actor/pg_loss", loss)
            stats.add_mean("actor/pg_clipfrac", clipfrac * tokens, tokens)
            stats.add_max("rollout/actor_logp_diff/max", diff)
        stats.flush(metrics, scale=0.5)
    assert counter.copies == ["tolist"]
    out = metrics.reduce(torch.device("cpu"))
    assert out["actor/pg_loss"] == pytest.approx((0.5 + 1.5 - 0.25) * 0.5)
    assert out["actor/pg_clipfrac"] == pytest.approx((0.25 * 4 + 0.5 * 12) / 18)
    assert out["rollout/actor_logp_diff/max"] == pytest.approx(0.7)
    stats.flush(metrics)  # emptied: adds nothing more
    assert metrics.reduce(torch.device("cpu")) == out
