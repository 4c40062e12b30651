"""HSDP (2 "nodes" x 2 ranks: shard within a node, replicate across) takes the same actor step
as 1-D FSDP over the 4 ranks, keeps the replicas identical, and loads each rank's rows only."""

import pytest
import torch

from _spawn import run_on_ranks
from test_loss_rank_invariance import LAYOUTS, _actor_update, _batch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

WORLD, REPLICAS = 4, 2
CONFIG = ("vanilla", "token-mean")
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # [64, 64], random


def _hsdp_and_fsdp_steps(rank, world):
    from distflow.engines import fsdp
    from distflow.engines.loading import load_sharded_causal_lm
    from distflow.models import load_causal_lm, model_cache_dir, resolve_model

    torch.set_num_threads(1)
    local = _batch().select(LAYOUTS[world][rank])
    steps = {name: _actor_update(world, local, 1, CONFIG, replicate)
             for name, replicate in (("fsdp", 1), ("hsdp", REPLICAS))}
    model_dir = resolve_model("tiny", model_cache_dir())
    mesh = fsdp.dp_mesh(torch.device("cpu"), world, REPLICAS)
    sharded = load_sharded_causal_lm(model_dir, mesh, torch.device("cpu"), torch.float32)
    plain = dict(load_causal_lm(model_dir).named_parameters())
    return {"steps": steps, "mesh": mesh.mesh.tolist(),
            "loaded": all(torch.equal(full, plain[n].data) for n, full in fsdp.full_state_tensors(sharded)),
            "q_rows": sharded.get_parameter(Q_PROJ).to_local().shape[0],
            "q_local": sharded.get_parameter(Q_PROJ).to_local().clone()}


@pytest.fixture(scope="module")
def results():
    from distflow.models import model_cache_dir, resolve_model

    resolve_model("tiny", model_cache_dir())  # build once, before the ranks race for it
    return run_on_ranks(_hsdp_and_fsdp_steps, WORLD, timeout_s=800)


def test_hsdp_takes_the_fsdp_step(results):
    for rank, result in enumerate(results):
        (hsdp_delta, hsdp_metrics), (fsdp_delta, fsdp_metrics) = result["steps"]["hsdp"], result["steps"]["fsdp"]
        for name, expected in fsdp_delta.items():
            assert float(expected.abs().max()) > 0, name
            # Gradients summed in another order (reduce-scatter in a node, then all-reduce across).
            torch.testing.assert_close(hsdp_delta[name], expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()),
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert hsdp_metrics[key] == pytest.approx(fsdp_metrics[key], rel=1e-5), key


def test_hsdp_replicas_stay_identical(results):
    # Mesh [[0, 1], [2, 3]]: ranks 0 and 2 hold the same shard in the two replicas, as do 1 and 3.
    assert results[0]["mesh"] == [[0, 1], [2, 3]]
    for a, b in ((0, 2), (1, 3)):
        for name, delta in results[a]["steps"]["hsdp"][0].items():
            assert torch.equal(delta, results[b]["steps"]["hsdp"][0][name]), (a, b, name)


def test_sharded_load_on_the_hsdp_mesh_reads_the_shard_groups_rows(results):
    assert all(r["loaded"] for r in results)
    # 64 rows over the 2 ranks of a shard group (not over 4): 32 each, the same in both replicas.
    assert [r["q_rows"] for r in results] == [32, 32, 32, 32]
    assert torch.equal(results[0]["q_local"], results[2]["q_local"])
    assert not torch.equal(results[0]["q_local"], results[1]["q_local"])
