"""A stand-in for DagWorker with just what ``distflow.checkpoint`` saves: a small model, its Adam
state, a loader position and a KL coefficient. Module-level functions, so spawned ranks can run them."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class _State:
    def __init__(self, **values):
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


def fake_worker(width: int = 32, seed: int = 0) -> SimpleNamespace:
    """Model [width, width] + bias, Adam with state after one step; loader/KL states that say ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, width)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, width)).sum().backward()
    optimizer.step()
    actor = SimpleNamespace(model=model, optimizer=optimizer)
    return SimpleNamespace(actor=actor, critic=None, loader=_State(epoch=0, offset=4 * seed),
                           kl_ctrl=_State(value=0.1 * seed), made_from={"model.path": "linear"},
                           rollout=SimpleNamespace(sync=lambda actor_model: None))


def params(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.actor.model.state_dict().items()}
