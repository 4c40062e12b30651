"""Double buffer (O(1) swap, background release) and node buffer (shared-memory hand-over)."""

from __future__ import annotations

import random
import threading
import uuid

import pytest
import torch

from _spawn import run_on_ranks
from distflow.data.batch import PackedBatch
from distflow.data.buffer import NodeBuffer, StepBuffer
from distflow.data.counters import TransferCounters
from distflow.data.redistribute import plan_redistribution

pytestmark = pytest.mark.dist


class CountingKey:
    """A key that counts every hash/eq: per-entry work on the dicts shows up here."""

    calls = 0

    def __init__(self, k: int) -> None:
        self.k = k

    def __hash__(self) -> int:
        CountingKey.calls += 1
        return hash(self.k)

    def __eq__(self, other) -> bool:
        CountingKey.calls += 1
        return isinstance(other, CountingKey) and other.k == self.k


class Tracked:
    """Records the thread that frees it."""

    freed_in: list = []

    def __del__(self) -> None:
        Tracked.freed_in.append(threading.get_ident())


@pytest.mark.parametrize("num_entries", [10, 10_000])
def test_swap_never_touches_the_entries(num_entries):
    buffer = StepBuffer()
    for generation in range(3):
        for k in range(num_entries):
            buffer.put(CountingKey(k), generation)
        CountingKey.calls = 0
        buffer.swap()
        assert CountingKey.calls == 0
    buffer.close()


def test_finished_step_is_freed_on_the_background_thread():
    Tracked.freed_in = []
    buffer = StepBuffer()
    for _step in range(3):
        for k in range(100):
            buffer.put(("logits", k), Tracked())
        buffer.swap()
    buffer.drain()
    # every swap releases the step it ends: all three steps are freed, none on this thread
    assert len(Tracked.freed_in) == 300
    assert threading.get_ident() not in Tracked.freed_in
    buffer.put(("logits", 0), Tracked())
    buffer.close()
    assert len(Tracked.freed_in) == 301


def test_swap_starts_an_empty_step():
    buffer = StepBuffer()
    buffer.put("rewards", 1)
    buffer.swap()
    assert dict(buffer.current) == {}
    with pytest.raises(KeyError, match="not in this step's buffer"):
        buffer.get("rewards")
    buffer.put("rewards", 2)
    assert buffer.get("rewards") == 2
    buffer.close()


@pytest.fixture
def node_buffer(tmp_path):
    return NodeBuffer(job_id=f"t{uuid.uuid4().hex[:8]}", node_rank=0, root=tmp_path, timeout_s=0.05)


def test_published_piece_is_taken_once_with_the_same_bytes(node_buffer):
    data = torch.arange(20, dtype=torch.float32).view(torch.uint8)
    assert node_buffer.publish(3, "rollout->actor", 0, 1, data) == 80
    got = node_buffer.take(3, "rollout->actor", 0, 1)
    assert torch.equal(got, data)
    assert torch.equal(got.view(torch.float32), torch.arange(20, dtype=torch.float32))
    assert list(node_buffer.directory.iterdir()) == []


def test_reserved_piece_is_invisible_until_committed(node_buffer):
    out = node_buffer.reserve(0, "e", 1, 0, 16)
    out.fill_(7)
    with pytest.raises(TimeoutError, match="rank 1 did not publish"):
        node_buffer.take(0, "e", 1, 0)
    node_buffer.commit(0, "e", 1, 0)
    assert node_buffer.take(0, "e", 1, 0).tolist() == [7] * 16


def test_cleanup_step_removes_only_that_step(node_buffer):
    for step in (1, 10):
        node_buffer.publish(step, "e", 0, 1, torch.ones(8, dtype=torch.uint8))
    node_buffer.cleanup_step(1)
    assert [p.name.split(".")[0] for p in node_buffer.directory.iterdir()] == ["s10"]
    node_buffer.cleanup()
    assert not node_buffer.directory.exists()


def test_every_worker_of_a_node_may_clean_up(tmp_path):
    """Each worker of a node closes on its own; the second cleanup finds the directory gone."""
    first, second = (NodeBuffer(job_id="job", node_rank=0, root=tmp_path) for _ in range(2))
    first.publish(0, "e", 0, 1, torch.ones(8, dtype=torch.uint8))
    first.cleanup()
    second.cleanup()
    assert not first.directory.exists() and first.directory == second.directory


def test_a_cleanup_that_loses_the_directory_while_listing_it_is_done(tmp_path, monkeypatch):
    """The other worker's rmdir between pathlib's is-a-directory check and its scandir: the listing
    raises FileNotFoundError (seen in a Ray job at exit); the directory is gone, as cleanup wants."""
    buffer = NodeBuffer(job_id="job", node_rank=0, root=tmp_path)
    real_glob = type(buffer.directory).glob

    def glob_after_the_other_worker(self, pattern):
        buffer.directory.rmdir()
        yield from real_glob(self, pattern)
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(type(buffer.directory), "glob", glob_after_the_other_worker)
    buffer.cleanup()
    assert not buffer.directory.exists()


def test_publish_rejects_non_bytes(node_buffer):
    with pytest.raises(ValueError, match="uint8"):
        node_buffer.publish(0, "e", 0, 1, torch.ones(4))


NODE_OF_RANK = [0, 0, 1, 1]


def node_case():
    rng = random.Random(3)
    ids = list(range(40))
    rng.shuffle(ids)
    holdings = [ids[0:7], ids[7:20], ids[20:22], ids[22:40]]
    rng.shuffle(ids)
    return holdings, [ids[0:12], ids[12:13], ids[13:30], ids[30:40]]


def node_batch(gids) -> PackedBatch:
    lens = [(g * 7) % 13 for g in gids]
    token_owner = torch.repeat_interleave(torch.tensor(gids, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64))
    return PackedBatch(
        seq_lens=torch.tensor(lens, dtype=torch.int64),
        token_fields={"log_probs": token_owner.to(torch.float32) / 7,
                      "hidden": torch.stack([token_owner, -token_owner], 1).to(torch.bfloat16)},
        sample_fields={"sample_id": torch.tensor(gids, dtype=torch.int64)},
    )


def _node_exchange(rank: int, world: int, job_id: str, root: str) -> dict:
    import torch.distributed as dist

    from distflow.data.exchange import exchange

    holdings, assignment = node_case()
    plan = plan_redistribution(holdings, assignment)
    batch = node_batch(holdings[rank])
    buffer = NodeBuffer(job_id, NODE_OF_RANK[rank], root=root)
    via_shm, via_net = TransferCounters(NODE_OF_RANK), TransferCounters(NODE_OF_RANK)
    shm = exchange(batch, plan, counters=via_shm, edge="e", node_of_rank=NODE_OF_RANK,
                   node_buffer=buffer, step=5)
    net = exchange(batch, plan, counters=via_net, edge="e")
    dist.barrier()
    return {"shm": {n: v.clone() for n, v in {**shm.token_fields, **shm.sample_fields}.items()},
            "net": {n: v.clone() for n, v in {**net.token_fields, **net.sample_fields}.items()},
            "via_shm": via_shm, "via_net": via_net,
            "leftovers": [p.name for p in buffer.directory.iterdir()]}


@pytest.fixture(scope="module")
def node_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shm"))
    return run_on_ranks(_node_exchange, 4, f"t{uuid.uuid4().hex[:8]}", root)


def test_node_buffer_path_gives_the_same_batches_as_all_to_all(node_run):
    _, assignment = node_case()
    for rank, result in enumerate(node_run):
        assert result["shm"]["sample_id"].tolist() == assignment[rank]
        for name, value in result["net"].items():
            got = result["shm"][name]
            assert got.dtype == value.dtype and torch.equal(got, value), name
        assert result["leftovers"] == []


def test_node_buffer_hands_over_intra_node_bytes_and_sends_only_cross_node(node_run):
    for result in node_run:
        shm, net = result["via_shm"], result["via_net"]
        assert shm.total_sent() == net.total_sent() and shm.total_received() == net.total_received()
        assert shm.bytes_handed_over.get("e", 0) == shm.intra_node_bytes == net.intra_node_bytes
        assert net.bytes_handed_over.get("e", 0) == 0
        assert shm.cross_node_bytes == net.cross_node_bytes
        assert shm.intra_node_bytes + shm.cross_node_bytes == shm.total_sent()
    assert sum(r["via_shm"].intra_node_bytes for r in node_run) > 0
    assert sum(r["via_shm"].cross_node_bytes for r in node_run) > 0
    node_total = [node_run[0]["via_shm"].merge(node_run[1]["via_shm"]),
                  node_run[2]["via_shm"].merge(node_run[3]["via_shm"])]
    assert node_total[0].node_pair_bytes == {(0, 1): node_total[0].cross_node_bytes}
    assert node_total[1].node_pair_bytes == {(1, 0): node_total[1].cross_node_bytes}
    metrics = node_total[0].as_metrics()
    assert metrics["data/node_pair_bytes/0_to_1"] == node_total[0].cross_node_bytes
