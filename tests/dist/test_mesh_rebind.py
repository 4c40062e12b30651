"""The trainer pool's FSDP2 mesh, rebound in place to the groups of a re-formed world.

3 gloo ranks: ranks 0 and 1 shard a small model (FSDP2 over ``pool_mesh`` of 2)
and take Adam steps; rank 2 stands for the rollout pool. Between two steps the
world is destroyed and formed again on the job's store (``process_group.reform``),
and the mesh is rebound (``fsdp.rebind_mesh``): the next steps' all-gathers and
reduce-scatters run on the new groups, and the parameters and Adam state after
3 steps are bit-identical to a run that never re-formed (the local shards and
every reduction are the same).

On gloo the old world's groups would still carry the collectives after the
destroy (their connections stay open while referenced), so the bit-identity
alone does not prove the rebinding; the test also checks that FSDP2's units and
the mesh use the new world's group after it. An NCCL world's destroy shuts its
communicators down: there the old groups cannot be used.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from distflow import process_group
from distflow.engines import fsdp
from tests.dist._spawn import run_on_ranks

pytestmark = pytest.mark.dist


def _train(rank: int, world_size: int, reform_before_step: int | None) -> dict | None:
    torch.manual_seed(0)
    device = torch.device("cpu")
    mesh = fsdp.pool_mesh(device, 2)  # collective over the world: every rank builds it
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    trains = rank < 2
    if trains:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        if step == reform_before_step:
            process_group.reform(device, process_group.world_store(), 1, rank, world_size)
            new_mesh = fsdp.pool_mesh(device, 2)
            if trains:
                stale = _shard_groups(model) != {id(new_mesh.get_group())}
                fsdp.rebind_mesh(mesh, new_mesh, [model])
                rebound = stale and _shard_groups(model) == {id(new_mesh.get_group())} \
                    and mesh.get_group() is new_mesh.get_group()
        if trains:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    if not trains:
        return None
    out = {"rebound": rebound} if reform_before_step is not None else {}
    out |= {f"param/{n}": p.full_tensor() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out.update({f"adam/{n}/{k}": v.full_tensor() for k, v in optimizer.state[p].items() if k != "step"})
    return out


def _shard_groups(model) -> set[int]:
    """ids of the groups FSDP2's units all-gather and reduce-scatter on."""
    return {id(unit._get_fsdp_state()._fsdp_param_group.mesh_info.shard_process_group)
            for unit in model.modules() if hasattr(unit, "_get_fsdp_state")}


def test_training_goes_on_bit_identically_on_the_rebound_mesh():
    straight = run_on_ranks(_train, 3, None)
    reformed = run_on_ranks(_train, 3, 1)
    assert straight[2] is None and reformed[2] is None
    for rank in (0, 1):
        assert reformed[rank].pop("rebound") is True  # FSDP2 and the mesh run on the new world's group
        assert straight[rank].keys() == reformed[rank].keys() and len(straight[rank]) == 4 * 3
        for key, value in straight[rank].items():
            assert torch.equal(value, reformed[rank][key]), key
    moved = (straight[0]["param/0.weight"] - _initial_weight()).abs().max().item()
    assert moved > 1e-3  # the steps did train


def _initial_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 16).weight.detach()


def test_a_mesh_of_other_ranks_is_refused():
    def mesh(ranks):  # only the ranks and the dimension names are read before refusing
        return SimpleNamespace(mesh=torch.tensor(ranks), mesh_dim_names=("dp",))

    with pytest.raises(ValueError, match="ranks or dimensions differ"):
        fsdp.rebind_mesh(mesh([0, 1]), mesh([0, 1, 2]), [])
