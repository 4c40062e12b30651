"""The resize benchmark's arithmetic (tests.bench.resize_cost), on a made-up timeline."""

import pytest

from tests.bench.resize_cost import (
    PHASES, fresh_start, median_step_seconds, resize_phases, sample_checks, summarize,
)
from tests.e2e.kubelet import ContainerEvent

pytestmark = pytest.mark.unit

# Steps 1-4 at 2 nodes (attempt 1), 5-6 at 4 (attempt 2); the 2 -> 4 request at t = 103.5, during step 4.
STEP_DONE = {1: 50.0, 2: 60.0, 3: 70.0, 4: 110.0, 5: 140.0, 6: 146.0}
STEP_SECONDS = {1: 12.0, 2: 10.0, 3: 10.0, 4: 11.0, 5: 7.0, 6: 6.0}


def _events(attempt, pods, what_times):
    return [ContainerEvent(t, f"job-node-{pod}", attempt, what)
            for pod in range(pods) for what, t in what_times(pod).items()]


OLD = _events("1", 2, lambda pod: {"started": 10.0 + pod, "ready": 20.0, "exited": 112.0 + 3 * pod})
NEW = _events("2", 4, lambda pod: {"started": 114.0 + pod, "ready": 121.0 + pod})


def test_resize_phases_cut_request_to_next_step_into_parts_that_add_up():
    phases = resize_phases(103.5, 4, STEP_DONE, STEP_SECONDS, OLD, NEW)
    assert phases == pytest.approx({
        "step in flight": 6.5,        # 103.5 -> step 4 logged at 110
        "checkpoint + exit": 2.0,     # -> the first old node exits at 112 (the other at 115)
        "pods recreated": 5.0,        # -> the last new container starts at 117
        "worker start": 7.0,          # -> the last new node Ready at 124
        "resume": 9.0,                # -> step 5 logged at 140, less its own 7 s
        "first step": 7.0,
        "total": 36.5,
    })
    assert sum(phases[p] for p in PHASES) == pytest.approx(phases["total"])


def test_a_request_seen_at_the_boundary_it_follows_waits_for_no_step():
    phases = resize_phases(111.0, 4, STEP_DONE, STEP_SECONDS, OLD, NEW)
    assert phases["step in flight"] == 0.0 and phases["checkpoint + exit"] == pytest.approx(1.0)
    assert phases["total"] == pytest.approx(29.0)


def test_fresh_start_runs_from_the_last_container_start_to_the_first_step():
    start = fresh_start(1, STEP_DONE, STEP_SECONDS, OLD)
    assert start == pytest.approx({"worker start": 9.0, "initialise": 18.0, "first step": 12.0, "total": 39.0})


def test_median_step_leaves_out_each_attempts_first_step():
    steps = {1: 12.0, 2: 10.0, 3: 10.5, 4: 11.0, 5: 7.0, 6: 6.0, 7: 6.5, 8: 9.0, 9: 9.5}
    medians = median_step_seconds(steps, [(2, 1, 4), (4, 5, 7), (2, 8, 9)])
    assert medians == {2: 10.25, 4: 6.25}  # 2 nodes: 10, 10.5, 11, 9.5; 4 nodes: 6, 6.5


def test_target_is_the_step_left_plus_a_fresh_start_and_the_excess_says_what_overran():
    phases = {"step in flight": 9.0, "checkpoint + exit": 2.0, "pods recreated": 1.0, "worker start": 6.0,
              "resume": 5.0, "first step": 2.0, "total": 25.0}
    fresh = {2: {"worker start": 5.0, "initialise": 2.0, "first step": 1.0, "total": 8.0},
             4: {"worker start": 8.0, "initialise": 8.0, "first step": 4.0, "total": 20.0}}
    up, down = summarize([{"from": 2, "to": 4, "phases": phases}, {"from": 4, "to": 2, "phases": phases}],
                         fresh=fresh, medians={2: 10.0, 4: 5.0})
    assert (up["target_seconds"], up["met"], up["dominant"]) == (30.0, True, "step in flight")
    assert (down["target_seconds"], down["met"]) == (13.0, False) and down["ratio"] == pytest.approx(25 / 13)
    assert down["excess"] == {"step in flight": 4.0, "checkpoint + exit": 2.0, "pods recreated": 1.0,
                              "worker start": 1.0, "resume": 3.0, "first step": 1.0}
    assert sum(down["excess"].values()) == 25.0 - 13.0 and down["largest_excess"] == "step in flight"
    assert up["excess"]["resume"] == -3.0 and up["largest_excess"] == "checkpoint + exit"


def test_sample_checks_catch_a_repeated_prompt_and_a_lost_sample():
    good = {1: [3, 3, 7, 7], 2: [1, 1, 9, 9]}
    assert all(sample_checks(good, 2, batch=2, samples_per_prompt=2).values())
    repeated = sample_checks({1: [3, 3, 7, 7], 2: [3, 3, 9, 9]}, 2, batch=2, samples_per_prompt=2)
    assert repeated == {"every step trained once": True, "every step's prompts with all their samples": True,
                        "no prompt trained twice or lost": False}
    lost = sample_checks({1: [3, 3, 7], 2: [1, 1, 9, 9]}, 2, batch=2, samples_per_prompt=2)
    assert not lost["every step's prompts with all their samples"]
    assert not sample_checks({1: [3, 3, 7, 7]}, 2, batch=2, samples_per_prompt=2)["every step trained once"]


def test_targets_row_is_missed_when_one_direction_misses_with_both_figures():
    from tests.bench.notes import resize_target_row

    resizes = [{"from": 2, "to": 4, "phases": {"total": 25.0}, "target_seconds": 30.0, "ratio": 25 / 30, "met": True},
               {"from": 4, "to": 2, "phases": {"total": 25.0}, "target_seconds": 17.0, "ratio": 25 / 17, "met": False}]
    _, measured, status = resize_target_row({"resizes": resizes})
    assert measured == "2 -> 4: 25.0 s vs 30.0 s (0.83x); 4 -> 2: 25.0 s vs 17.0 s (1.47x)"
    assert status == "**missed**"
    assert resize_target_row({})[1:] == ["not run", "not measured"]
