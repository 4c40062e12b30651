"""The resize benchmark's arithmetic (tests.bench.resize_cost), on a made-up timeline."""

import re

import pytest

from tests.bench.resize_cost import (
    PHASES, LineClock, fresh_start, median_step_seconds, node_events, pods_seconds, resize_phases, sample_checks,
    summarize,
)
from tests.e2e.kubelet import ContainerEvent

pytestmark = pytest.mark.unit

# Steps 1-5 at 2 nodes, 6-7 at 4, all in attempt 1. The 2 -> 4 request at t = 70.5, just after step 3;
# the joiners (nodes 2, 3) are Ready at 85 and 88, so the gang re-forms after step 5 (logged at 92), and
# node 0 logs the re-form at 97. Step 6 is logged at 120 after 8 s of its own: it started at 112.
STEP_DONE = {1: 50.0, 2: 60.0, 3: 70.0, 4: 81.0, 5: 92.0, 6: 120.0, 7: 126.0}
STEP_SECONDS = {1: 12.0, 2: 10.0, 3: 10.0, 4: 11.0, 5: 11.0, 6: 8.0, 7: 6.0}
TIMES = {0: {"started": 10.0, "ready": 20.0, "exited": 200.0}, 1: {"started": 11.0, "ready": 21.0, "exited": 201.0},
         2: {"started": 71.0, "ready": 85.0, "exited": 135.0}, 3: {"started": 72.0, "ready": 88.0, "exited": 134.0}}
EVENTS = [ContainerEvent(t, f"job-node-{rank}", "1", what)
          for rank, times in TIMES.items() for what, t in times.items()]


def test_resize_phases_cut_request_to_first_step_at_the_new_size_into_parts_that_add_up():
    phases = resize_phases(70.5, 5, 97.0, STEP_DONE, STEP_SECONDS)
    assert phases == pytest.approx({
        "trained on": 21.5,             # 70.5 -> step 5 logged at 92 (steps 4 and 5 at 2 nodes)
        "checkpoint + re-form": 5.0,    # -> node 0 logs the re-form at 97
        "resume": 15.0,                 # -> step 6 started at 112 (logged at 120, less its own 8 s)
        "first step": 8.0,
        "total": 49.5,                  # -> step 6 logged at 120
        "without training": 20.0,       # step 5 logged at 92 -> step 6 started at 112
    })
    assert sum(phases[p] for p in PHASES) == pytest.approx(phases["total"])
    assert phases["without training"] == pytest.approx(phases["checkpoint + re-form"] + phases["resume"])


def test_a_request_after_the_step_the_gang_re_forms_after_trains_on_for_no_time():
    phases = resize_phases(93.0, 5, 97.0, STEP_DONE, STEP_SECONDS)
    assert phases["trained on"] == 0.0 and phases["checkpoint + re-form"] == pytest.approx(4.0)
    assert phases["total"] == pytest.approx(27.0) and phases["without training"] == pytest.approx(20.0)


def test_pods_seconds_wait_for_the_last_joiner_ready_or_the_last_leaver_exited():
    assert pods_seconds(70.5, EVENTS, "job", 2, 4) == pytest.approx(17.5)  # node 3 Ready at 88
    assert pods_seconds(126.5, EVENTS, "job", 4, 2) == pytest.approx(8.5)  # node 2 exited at 135


def test_fresh_start_of_the_first_nodes_ignores_the_joiners_that_came_later():
    start = fresh_start(1, STEP_DONE, STEP_SECONDS, node_events(EVENTS, "job", range(2)))
    # the last start at 11, the last Ready at 21, step 1 logged at 50 after its own 12 s
    assert start == pytest.approx({"worker start": 10.0, "initialise": 17.0, "first step": 12.0, "total": 39.0})
    assert node_events(EVENTS, "job", range(2), attempt="2") == []


def test_median_step_leaves_out_the_first_step_at_each_size():
    steps = {1: 12.0, 2: 10.0, 3: 10.5, 4: 11.0, 5: 7.0, 6: 6.0, 7: 6.5, 8: 9.0, 9: 9.5}
    medians = median_step_seconds(steps, [(2, 1, 4), (4, 5, 7), (2, 8, 9)])
    assert medians == {2: 10.25, 4: 6.25}  # 2 nodes: 10, 10.5, 11, 9.5; 4 nodes: 6, 6.5


def test_target_is_the_step_left_plus_a_fresh_start_and_the_excess_says_what_overran():
    met = {"trained on": 15.0, "checkpoint + re-form": 4.0, "resume": 4.0, "first step": 2.0, "total": 25.0}
    missed = {"trained on": 20.0, "checkpoint + re-form": 4.0, "resume": 5.0, "first step": 2.0, "total": 31.0}
    fresh = {2: {"worker start": 5.0, "initialise": 2.0, "first step": 1.0, "total": 8.0},
             4: {"worker start": 8.0, "initialise": 8.0, "first step": 4.0, "total": 20.0}}
    up, down = summarize([{"from": 2, "to": 4, "phases": met}, {"from": 4, "to": 2, "phases": missed}],
                         fresh=fresh, medians={2: 10.0, 4: 5.0})
    # 2 -> 4: 10 s step + 20 s fresh start; shares 18 (10 + 8 worker start), 0, 8, 4
    assert (up["target_seconds"], up["met"], up["dominant"]) == (30.0, True, "trained on")
    assert up["excess"] == {"trained on": -3.0, "checkpoint + re-form": 4.0, "resume": -4.0, "first step": -2.0}
    assert up["largest_excess"] == "checkpoint + re-form" and up["ratio"] == pytest.approx(25 / 30)
    # 4 -> 2: 5 s step + 8 s fresh start; shares 10 (5 + 5 worker start), 0, 2, 1
    assert (down["target_seconds"], down["met"]) == (13.0, False) and down["ratio"] == pytest.approx(31 / 13)
    assert down["excess"] == {"trained on": 10.0, "checkpoint + re-form": 4.0, "resume": 3.0, "first step": 1.0}
    assert sum(down["excess"].values()) == 31.0 - 13.0 and down["largest_excess"] == "trained on"
    assert sum(up["excess"].values()) == 25.0 - 30.0


def test_line_clock_keeps_when_each_match_was_first_seen(tmp_path):
    pattern = re.compile(r"after step (\d+) at (\d+) nodes")
    log = tmp_path / "job-node-0-abc" / "container.log"
    log.parent.mkdir()
    log.write_text("after step 5 at 4 nodes\n")
    clock = LineClock(tmp_path, "job-node-0-*/container.log", pattern)
    clock._read(100.0)
    log.write_text("after step 5 at 4 nodes\nnoise\nafter step 9 at 2 nodes\n")
    clock._read(130.0)
    assert clock.seen_s == {(5, 4): 100.0, (9, 2): 130.0}
    assert clock.wait_for(lambda key: key[1] == 2, timeout_s=1.0) == ((9, 2), 130.0)


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
