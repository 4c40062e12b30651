"""Redistribution on real gloo process groups: exchange vs centralized, counters, errors.

Each world size spawns once (module fixture) and runs every scenario; the
tests then check what each rank returned against data rebuilt here.
"""

from __future__ import annotations

import random

import pytest
import torch

from _spawn import run_on_ranks
from distflow.data.balance import balance_partition
from distflow.data.batch import PackedBatch
from distflow.data.counters import TransferCounters
from distflow.data.redistribute import balanced_assignment, plan_redistribution

pytestmark = pytest.mark.dist

SEED = 7


def make_sample(gid: int) -> dict:
    """Sample ``gid``'s fields, the same in every process; some samples are empty."""
    gen = torch.Generator().manual_seed(1000 + gid)
    length = int(torch.randint(0, 12, (1,), generator=gen))
    return {
        "seq_len": length,
        "input_ids": torch.randint(0, 50_000, (length,), generator=gen, dtype=torch.int64),
        "log_probs": torch.randn(length, generator=gen),
        "hidden": torch.randn(length, 3, generator=gen).to(torch.bfloat16),
        "reward": torch.randn(1, generator=gen),
        "prompt_span": torch.randint(0, 9, (1, 2), generator=gen, dtype=torch.int64),
        "is_truncated": torch.rand(1, generator=gen) > 0.5,
    }


def make_batch(gids) -> PackedBatch:
    samples = [make_sample(g) for g in gids]

    def cat(name, empty):
        return torch.cat([s[name] for s in samples]) if samples else empty

    return PackedBatch(
        seq_lens=torch.tensor([s["seq_len"] for s in samples], dtype=torch.int64),
        token_fields={
            "input_ids": cat("input_ids", torch.zeros(0, dtype=torch.int64)),
            "log_probs": cat("log_probs", torch.zeros(0)),
            "hidden": cat("hidden", torch.zeros(0, 3, dtype=torch.bfloat16)),
        },
        sample_fields={
            "reward": cat("reward", torch.zeros(0)),
            "prompt_span": cat("prompt_span", torch.zeros(0, 2, dtype=torch.int64)),
            "is_truncated": cat("is_truncated", torch.zeros(0, dtype=torch.bool)),
        },
    )


def random_case(world: int, seed: int):
    """Uneven random holdings and target: the last rank starts empty and, with
    more than 2 ranks, rank 0 ends empty."""
    rng = random.Random(seed)

    def split(ids):
        cuts = sorted(rng.sample(range(1, len(ids)), world - 1))
        return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]

    ids = list(range(6 * world))
    rng.shuffle(ids)
    holdings = split(ids)
    holdings[-2] += holdings[-1]
    holdings[-1] = []
    target = list(ids)
    rng.shuffle(target)
    assignment = split(target)
    if world > 2:
        assignment[1] += assignment[0]
        assignment[0] = []
    return holdings, assignment


def all_move_case(world: int):
    """Equal holdings; every sample goes to the next rank (nothing stays)."""
    holdings = [list(range(r * 8, (r + 1) * 8)) for r in range(world)]
    return holdings, [holdings[(r - 1) % world] for r in range(world)]


def uniform_batch(gids) -> PackedBatch:
    """10 tokens per sample, so every rank's batch has the same size."""
    gids = torch.tensor(gids, dtype=torch.int64)
    return PackedBatch(seq_lens=torch.full((len(gids),), 10),
                       token_fields={"log_probs": torch.arange(10 * len(gids), dtype=torch.float32)},
                       sample_fields={"sample_id": gids})


def plain(batch: PackedBatch) -> dict:
    return {"seq_lens": batch.seq_lens.clone(),
            **{n: v.clone() for n, v in batch.token_fields.items()},
            **{n: v.clone() for n, v in batch.sample_fields.items()}}


def _scenarios(rank: int, world: int, seed: int) -> dict:
    from distflow.data.centralized import exchange_centralized
    from distflow.data.exchange import allgather_lengths, exchange

    out = {}
    holdings, assignment = random_case(world, seed)
    plan = plan_redistribution(holdings, assignment)
    batch = make_batch(holdings[rank])
    for name, fn in (("distributed", exchange), ("centralized", exchange_centralized)):
        counters = TransferCounters()
        out[name] = plain(fn(batch, plan, counters=counters, edge="rollout->actor"))
        out[name + "_counters"] = counters

    same = plan_redistribution(holdings, holdings)
    counters = TransferCounters()
    out["identity_returns_input"] = exchange(batch, same, counters=counters, edge="actor->ref") is batch
    out["identity_counters"] = counters

    lengths = allgather_lengths(batch.seq_lens)
    out["all_lengths"] = [x.clone() for x in lengths]
    length_of = {g: int(n) for held, lens in zip(holdings, lengths) for g, n in zip(held, lens)}
    balanced = balanced_assignment(holdings, length_of)
    out["balanced"] = plain(exchange(batch, plan_redistribution(holdings, balanced), all_lengths=lengths))
    out["balanced_assignment"] = balanced

    moved_holdings, moved_target = all_move_case(world)
    moving = uniform_batch(moved_holdings[rank])
    moving_plan = plan_redistribution(moved_holdings, moved_target)
    for name, fn in (("busy_distributed", exchange), ("busy_centralized", exchange_centralized)):
        counters = TransferCounters()
        fn(moving, moving_plan, counters=counters, edge="e")
        out[name] = counters

    out.update(_metadata_scenario(batch, holdings, balanced))

    odd = batch.with_fields(sample={"extra": torch.zeros(batch.num_samples)}) if rank == world - 1 else batch
    try:
        exchange(odd, plan)
    except ValueError as err:
        out["schema_error"] = str(err)
    return out


def _metadata_scenario(batch, holdings, balanced) -> dict:
    """gather_metadata with too small and with enough capacity; exchange fed by it."""
    import torch.distributed as dist

    from distflow.data.exchange import exchange, gather_metadata

    calls = {"all_gather": 0}
    real = dist.all_gather

    def counting(*args, **kwargs):
        calls["all_gather"] += 1
        return real(*args, **kwargs)

    rank = dist.get_rank()
    gids = torch.tensor(holdings[rank], dtype=torch.int64)
    out = {}
    dist.all_gather = counting
    try:
        for capacity in (0, max(len(h) for h in holdings)):
            calls["all_gather"] = 0
            meta = gather_metadata(batch, [gids, gids * 10], capacity)
            out[f"meta_{capacity and 'enough' or 'none'}"] = (
                [r.clone() for r in meta.rows], list(meta.digests), meta.max_count, calls["all_gather"])
        calls["all_gather"] = 0
        moved = exchange(batch, plan_redistribution(holdings, balanced), metadata=meta)
        out["metadata_exchange"] = (plain(moved), calls["all_gather"])
    finally:
        dist.all_gather = real
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def run(request):
    world = request.param
    return world, run_on_ranks(_scenarios, world, SEED)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True


def assert_batch_is(got: dict, gids) -> None:
    expected = plain(make_batch(gids))
    assert got.keys() == expected.keys()
    for name in expected:
        assert bitwise_equal(got[name], expected[name]), name


def test_every_sample_arrives_once_on_its_planned_rank_in_planned_order(run):
    world, results = run
    holdings, assignment = random_case(world, SEED)
    assert holdings[-1] == [] and (world == 2 or assignment[0] == [])
    for rank, result in enumerate(results):
        assert_batch_is(result["distributed"], assignment[rank])


def test_centralized_gives_bit_identical_batches(run):
    world, results = run
    for result in results:
        for name, value in result["distributed"].items():
            assert bitwise_equal(result["centralized"][name], value), name


def test_piece_size_pads_each_field_chunk_to_8_bytes():
    from distflow.data.wire import piece_nbytes

    schema = make_batch([]).field_schema()
    # 5 tokens: int64 40, float32 20->24, bf16x3 30->32; 2 samples: float32 8,
    # int64x2 32, bool 2->8
    assert piece_nbytes(schema, num_tokens=5, num_samples=2) == 40 + 24 + 32 + 8 + 32 + 8


def test_counters_record_the_wire_bytes_of_every_piece(run):
    from distflow.data.wire import piece_nbytes

    world, results = run
    holdings, assignment = random_case(world, SEED)
    plan = plan_redistribution(holdings, assignment)
    schema = make_batch([]).field_schema()

    def piece(src, dst):
        gids = [holdings[src][p] for p in plan.sends[src][dst]]
        tokens = sum(make_sample(g)["seq_len"] for g in gids)
        return piece_nbytes(schema, tokens, len(gids)) if gids else 0

    for rank, result in enumerate(results):
        counters = result["distributed_counters"]
        others = [peer for peer in range(world) if peer != rank]
        assert counters.bytes_sent.get("rollout->actor", 0) == sum(piece(rank, d) for d in others)
        assert counters.bytes_received.get("rollout->actor", 0) == sum(piece(s, rank) for s in others)
        assert counters.exchanges["rollout->actor"] == 1
        assert counters.cache_hits.get("rollout->actor", 0) == 0


def test_identity_plan_moves_zero_bytes_and_counts_a_cache_hit(run):
    _, results = run
    for result in results:
        counters = result["identity_counters"]
        assert result["identity_returns_input"]
        assert counters.total_sent() == 0 and counters.total_received() == 0
        assert counters.cache_hits["actor->ref"] == 1
        assert counters.as_metrics()["data/cache_hits"] == 1.0


def test_balanced_plan_gives_each_rank_the_balanced_share(run):
    world, results = run
    holdings, _ = random_case(world, SEED)
    lengths = results[0]["all_lengths"]
    ids = [g for held in holdings for g in held]
    costs = [int(n) for lens in lengths for n in lens]
    best_max = max(sum(costs[i] for i in b) for b in balance_partition(costs, world))
    balanced = results[0]["balanced_assignment"]
    for rank, result in enumerate(results):
        assert result["balanced_assignment"] == balanced
        assert_batch_is(result["balanced"], balanced[rank])
        assert int(result["balanced"]["seq_lens"].sum()) <= best_max
    assert sorted(g for part in balanced for g in part) == sorted(ids)


def test_busiest_rank_moves_about_one_nth_of_the_centralized_root(run):
    world, results = run
    busiest = {name: max(r[name].total_sent() + r[name].total_received() for r in results)
               for name in ("busy_distributed", "busy_centralized")}
    # distributed: each rank sends and receives one batch; centralized: the root
    # receives and sends the N-1 other batches, so the ratio is 1/(N-1) ~ 1/N
    assert busiest["busy_distributed"] * (world - 1) == busiest["busy_centralized"]


def test_schema_mismatch_raises_on_every_rank_naming_the_field(run):
    world, results = run
    for result in results:
        assert "'extra'" in result["schema_error"]
        assert f"rank {world - 1}" in result["schema_error"]


def test_gather_metadata_is_one_all_gather_with_capacity_and_feeds_the_exchange(run):
    world, results = run
    holdings, _ = random_case(world, SEED)
    expected = [torch.tensor([[make_sample(g)["seq_len"], g, 10 * g] for g in held], dtype=torch.int64).reshape(-1, 3)
                for held in holdings]
    for rank, result in enumerate(results):
        for key, collectives in (("meta_none", 2), ("meta_enough", 1)):
            rows, digests, max_count, calls = result[key]
            assert calls == collectives, key  # capacity 0: a second gather; enough: one
            assert len(rows) == world and all(torch.equal(a, b) for a, b in zip(rows, expected)), key
            assert len(set(digests)) == 1 and max_count == max(len(h) for h in holdings)
        moved, calls = result["metadata_exchange"]
        assert calls == 0  # lengths and schema digests came with the metadata
        for name, value in result["balanced"].items():
            assert bitwise_equal(moved[name], value), name
