"""Generation stops at every EOS id of the model's generation config, not only the tokenizer's.

Qwen2.5 and Llama-3 instruct models end a turn with a token (``<|im_end|>``,
``<|eot_id|>``) that ``generation_config.eos_token_id`` lists beside the
tokenizer's ``eos_token``. Here a tiny random Llama's config lists two EOS
ids: the tokenizer's (2) and the token the model greedily emits first for
the prompt; the response must be exactly that one token.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distflow import models
from distflow.engines.rollout import SamplingParams, eos_token_ids, generate

pytestmark = pytest.mark.unit

VOCAB, PAD, BOS, EOS = 300, 0, 1, 2
PROMPT = [17, 45, 230, 9, 101]
CPU = torch.device("cpu")
GREEDY = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=8, micro_batch_size=4)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    config = models.tiny_llama_config(VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)


def _response(model) -> list[int]:
    batch = generate(model, TOKENIZER, [PROMPT], [0], GREEDY, seed=0, device=CPU)
    ids, mask = batch.token_fields["input_ids"], batch.token_fields["response_mask"].bool()
    return ids[mask].tolist()


def test_response_stops_at_a_second_eos_id_of_the_generation_config(model):
    free = _response(model)
    assert len(free) == GREEDY.max_new_tokens and EOS not in free  # the premise: no stop by itself
    first = free[0]
    model.generation_config.eos_token_id = [EOS, first]
    try:
        assert _response(model) == [first]
    finally:
        model.generation_config.eos_token_id = EOS


def test_eos_ids_are_the_union_of_tokenizer_and_generation_config():
    tokenizer = SimpleNamespace(eos_token_id=5)
    assert eos_token_ids(tokenizer, SimpleNamespace(eos_token_id=[2, 7])) == [2, 5, 7]
    assert eos_token_ids(tokenizer, SimpleNamespace(eos_token_id=None)) == [5]
    assert eos_token_ids(tokenizer, None) == [5]
