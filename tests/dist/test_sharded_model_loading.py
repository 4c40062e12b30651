"""No worker reads a whole model: actor, reference and critic load their rows only, a rollout
engine's own copy is filled from the actor's shards, and a rank's peak host memory while it
loads the critic falls with the world size."""

import pytest
import torch

from _model_reads import recording_reads, models_only_worker
from _spawn import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


PPO = {"model": {"path": "tiny:byte"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
       "workflow": {"name": "ppo"}, "algorithm": {"useKlInReward": True},
       "rollout": {"shareActorWeights": False}}


def _build_all_models(rank, world):
    from distflow.engines import fsdp
    from distflow.models import load_causal_lm, model_cache_dir, resolve_model

    model_dir = str(resolve_model("tiny:byte", model_cache_dir()))
    worker = models_only_worker(PPO | {"cluster": {"procsPerNode": world}}, world, model_dir)
    with recording_reads() as reads:
        worker._build_models()
    plain = load_causal_lm(model_dir, "float32")
    copy = worker.rollout.weights.copy
    return {"reads": reads, "roles": [worker.ref_model is not None, worker.critic is not None, copy is not None],
            "copy_equal": all(torch.equal(p, dict(plain.named_parameters())[n]) for n, p in copy.named_parameters()),
            "copy_buffers": all(torch.equal(b, dict(plain.named_buffers())[n]) for n, b in copy.named_buffers()),
            "critic_full": {n: t for n, t in fsdp.full_state_tensors(worker.critic.model)}}


def test_no_worker_reads_more_than_its_rows_of_any_parameter():
    from distflow.engines.critic import load_value_model
    from distflow.models import model_cache_dir, resolve_model

    world = 2
    model_dir = resolve_model("tiny:byte", model_cache_dir())  # build once, before the ranks race for it
    results = run_on_ranks(_build_all_models, world, timeout_s=600)
    reference = dict(load_value_model(str(model_dir)).named_parameters())
    for result in results:
        assert result["roles"] == [True, True, True]  # reference, critic and a rollout copy were built
        assert result["copy_equal"] and result["copy_buffers"]
        assert result["reads"], "nothing was read"
        full = [r for r in result["reads"] if r[0] == "from_pretrained" or r[2] - r[1] > -(-r[3] // world)]
        assert not full, full[:5]
        for name, tensor in result["critic_full"].items():
            assert torch.equal(tensor, reference[name].data), name  # the head is 0, as load_value_model's
    # Actor, reference and critic read each parameter once per rank: 3 x (rows of rank 0 + rank 1) = 3 x rows.
    rows = {}
    for result in results:
        for name, start, stop, total in result["reads"]:
            rows.setdefault(name, [0, total])[0] += stop - start
    assert all(read == 3 * total for read, total in rows.values()), rows


def _critic_peak_rss(rank, world, model_dir):
    import gc

    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel

    from distflow.engines.critic import ValueModel, build_critic
    from distflow.engines import fsdp
    from tests.bench._common import peak_rss_bytes, reset_peak_rss

    torch.set_num_threads(1)
    worker = models_only_worker(PPO, world, model_dir)
    mesh = fsdp.dp_mesh(torch.device("cpu"), world)
    # Imports first (the model's code, FSDP's): their memory is the same at every W and not loading's.
    with init_empty_weights(include_buffers=False):
        fsdp.apply_fsdp(ValueModel(AutoModel.from_config(AutoConfig.from_pretrained(model_dir))), mesh)
    gc.collect()
    assert reset_peak_rss()
    base = peak_rss_bytes()
    critic = build_critic(worker.spec, model_dir, 0, mesh, world, torch.device("cpu"))
    local = sum(p.to_local().numel() * p.element_size() for p in critic.model.parameters())
    return {"peak": peak_rss_bytes() - base, "local": local}


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory):
    """A random Llama of 65M parameters saved in bfloat16 (130 MB; 260 MB as the critic's float32
    master weights), with the byte tokenizer. bfloat16 on disk, as most published checkpoints:
    a whole-model load then converts every tensor (on CPU, safetensors' memory map would
    otherwise hide the pages a rank never touches)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from distflow.models import build_byte_tokenizer

    out = tmp_path_factory.mktemp("random-llama")
    config = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(out)
    return str(out)


def test_a_ranks_peak_host_memory_loading_the_critic_falls_with_the_world_size(random_model_dir, report_figure):
    peaks, local = {}, {}
    for world in (1, 2, 4):
        results = run_on_ranks(_critic_peak_rss, world, random_model_dir, timeout_s=600)
        peaks[world], local[world] = (max(r[key] for r in results) for key in ("peak", "local"))
    assert abs(local[4] - local[1] / 4) < 1 << 20, local  # a 1/W share of the weights (+-1 row)
    mib = {w: round(p / 2**20) for w, p in peaks.items()}
    report_figure(f"critic load, peak host RSS growth per rank (MiB) by world size: {mib}")
    # Whole-model loading costs every rank the float32 model (260 MB) whatever W is; sharded
    # loading ~1/W of it and of the file's pages, plus a fixed overhead (empty model, buffers).
    # Measured on 2 shared cores: sharded {1: 505, 2: 335, 4: 205} MiB; whole-model loading
    # {1: 674, 2: 506, 4: 506}. The slack covers the fixed overhead and a loaded machine.
    assert peaks[4] < peaks[2] < 0.8 * peaks[1], mib
    assert peaks[4] < 0.5 * peaks[1], mib
