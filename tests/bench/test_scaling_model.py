"""The scaling cost model's arithmetic, against hand-computed values."""

import math

import pytest

from tests.bench import scaling_model as sm

# Pure, but under tests/bench: conftest skips everything here unless -m names bench.
pytestmark = [pytest.mark.unit, pytest.mark.bench]

HW = sm.Hardware(peak_flops=1e12, train_mfu=0.5, inference_mfu=0.5, decode_mfu=0.25, network_bytes_per_s=1e9,
                 network_latency_s=1e-3, pcie_bytes_per_s=1e9, device_copy_bytes_per_s=2e9,
                 controller_bytes_per_s=1e9, controller_dispatch_s=1e-3, fsdp_collectives_per_layer=3)
TOY = sm.Workload("toy", params=1e9, num_layers=2, algorithm="grpo", samples_per_gpu=2, prompt_tokens=10,
                  response_tokens=20)
MEASURED = sm.Measured(bytes_per_token=10, host_copy_bytes_per_s=1e9, metadata_collectives_per_edge=3,
                       planning_points=((8, 0.1), (16, 0.4)), imbalance_points=((2, 1.5), (8, 1.1)))


def test_loglog_interpolation_follows_the_power_law_between_and_beyond_points():
    points = [(1, 1.0), (10, 100.0)]
    assert sm.interpolate_loglog(points, 5) == pytest.approx(25.0)
    assert sm.interpolate_loglog(points, 100) == pytest.approx(10_000.0)
    assert sm.interpolate_loglog([(2, 4.0)], 4) == pytest.approx(8.0)  # one point: linear
    with pytest.raises(ValueError):
        sm.interpolate_loglog([(0, 1.0)], 3)


def test_imbalance_is_held_at_the_last_measured_dp():
    assert sm.step_at_flat(MEASURED.imbalance_points, 4) == 1.5
    assert sm.step_at_flat(MEASURED.imbalance_points, 1024) == 1.1
    assert sm.step_at_flat(MEASURED.imbalance_points, 1) == 1.5


def test_compute_seconds_from_flops():
    # tokens = 2 x 30 = 60, generated = 40
    out = sm.compute_seconds(TOY, HW)
    assert out["rollout"] == pytest.approx(2e9 * 40 / (1e12 * 0.25))  # 0.32
    assert out["reference"] == pytest.approx(2e9 * 60 / (1e12 * 0.5))  # 0.24
    assert out["train"] == pytest.approx(6e9 * 60 / (1e12 * 0.5))  # 0.72
    ppo = sm.compute_seconds(sm.Workload("p", 1e9, 2, "ppo", 2, 10, 20), HW)
    assert ppo["train"] == pytest.approx(1.44) and ppo["values"] == pytest.approx(0.24)


def test_centralized_edge_sends_everything_through_the_controller():
    # local = 2 samples x 30 tokens x 10 B = 600 B; N = 4: total 2400, through the controller 1800
    edge = sm.centralized_edge_seconds(TOY, HW, MEASURED, 4)
    assert edge["wire"] == pytest.approx(2 * 1800 / 1e9)
    assert edge["copies"] == pytest.approx(2 * 2400 / 1e9)
    assert edge["dispatch"] == pytest.approx(2 * 3 * 1e-3)
    assert edge["staging"] == pytest.approx(2 * 600 / 1e9)


def test_distributed_edge_costs_stay_per_rank():
    edge = sm.distributed_edge_seconds(TOY, HW, MEASURED, 4)
    moved = 600 * 3 / 4
    assert edge["wire"] == pytest.approx(moved / 1e9)
    assert edge["copies"] == pytest.approx(2 * moved / 2e9)
    assert edge["metadata"] == pytest.approx(3 * (2 * 2 * 1e-3 + 8 * 8 / 1e9))
    assert sm.planning_seconds(TOY, MEASURED, 4) == pytest.approx(0.1)  # 8 global samples


def test_param_sync_grows_only_by_latency():
    a, b = sm.param_sync_seconds(TOY, HW, 4), sm.param_sync_seconds(TOY, HW, 16)
    weights = 2e9
    expected_a = 3 * weights * 3 / 4 / 1e9 + 3 * 2 * 2 * math.log2(4) * 1e-3 + weights * 3 / 4 / 1e9
    assert a == pytest.approx(expected_a)
    assert b - a == pytest.approx(3 * weights * (15 / 16 - 3 / 4) / 1e9 + 3 * 2 * 2 * 2 * 1e-3
                                  + weights * (15 / 16 - 3 / 4) / 1e9)


def test_project_adds_the_components_and_efficiency_starts_at_one():
    step = sm.project(TOY, HW, MEASURED, 4, "distributed")
    comp = sum(sm.compute_seconds(TOY, HW).values())
    assert step.compute == pytest.approx(comp)
    assert step.imbalance_loss == pytest.approx(0.72 * 0.5)  # train x (1.5 - 1)
    assert step.total == pytest.approx(step.compute + step.imbalance_loss + step.param_sync + step.data_plane)
    assert step.throughput == pytest.approx(4 * 60 / (step.total * 4))
    rows = sm.scaling_table([TOY], HW, MEASURED, gpu_counts=(2, 4, 8))
    assert [r["efficiency"] for r in rows if r["num_gpus"] == 2] == [1.0, 1.0]
    with pytest.raises(ValueError, match="distributed or centralized"):
        sm.project(TOY, HW, MEASURED, 4, "driver")


def test_centralized_plane_falls_behind_as_gpus_grow():
    fast_planner = sm.Measured(bytes_per_token=21, host_copy_bytes_per_s=2e9, metadata_collectives_per_edge=3,
                               planning_points=((512, 0.01), (16384, 0.2)), imbalance_points=((32, 1.0),))
    rows = sm.scaling_table(sm.WORKLOADS[:1], sm.Hardware(), fast_planner, gpu_counts=(32, 512))
    eff = {(r["mode"], r["num_gpus"]): r["efficiency"] for r in rows}
    assert eff[("centralized", 512)] < eff[("distributed", 512)] < 1.0
