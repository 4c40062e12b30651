"""The worker's resize request: read from the mounted ConfigMap key, agreed over the ranks."""

from __future__ import annotations

import pytest

from distflow.resize import EXIT_LEFT_POOL, EXIT_RESIZE, ResizeRequest, ResizeWatch, read_request, requested_nodes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text, expected", [
    ('{"numNodes": 3}', 3), ("", None), ('{"numNodes": 0}', None), ('{"numNodes": true}', None),
    ('{"numNodes": "3"}', None), ("[3]", None), ('{"numNo', None),
])
def test_request_file_is_read_strictly(tmp_path, text, expected):
    (tmp_path / "resize").write_text(text)
    assert requested_nodes(tmp_path / "resize") == expected


def test_missing_file_is_no_request(tmp_path):
    assert requested_nodes(tmp_path / "resize") is None
    assert ResizeWatch(tmp_path / "resize", 2).should_stop() is False


def test_stop_only_for_another_size_and_when_any_rank_saw_it(tmp_path):
    path = tmp_path / "resize"
    path.write_text('{"numNodes": 2}')
    assert ResizeWatch(path, 2).should_stop() is False
    path.write_text('{"numNodes": 3}')
    assert ResizeWatch(path, 2).should_stop() is True
    # A rank whose volume has not caught up still stops when another rank saw the request.
    flags = []
    late = ResizeWatch(tmp_path / "absent", 2, agree=lambda f: flags.append(f) or max(f, 1))
    assert late.should_stop() is True and flags == [0]
    assert EXIT_RESIZE == 3


def test_distflow_node_exits_3_with_a_termination_message_when_its_workers_stopped_for_a_resize(
        tmp_path, monkeypatch):
    from distflow import cli
    from distflow.resize import StoppedForResize

    config = tmp_path / "spec.yaml"
    config.write_text("apiVersion: distflow.io/v1alpha1\nkind: RLPostTrainJob\nmetadata: {name: j}\n"
                      "spec: {model: {path: tiny}, data: {train: {path: arithmetic}}}\n")
    seen = []

    def stopped(spec, name, spec_dir):
        seen.append(spec_dir)
        raise StoppedForResize("worker 0 stopped at a step boundary for a resize (checkpoint saved)")
    monkeypatch.setattr("distflow.launcher.launch_node", stopped)
    monkeypatch.setenv("DISTFLOW_TERMINATION_LOG", str(tmp_path / "termination-log"))
    assert cli.main(["node", "--config", str(config)]) == EXIT_RESIZE
    assert seen == [tmp_path]  # the request is read next to the spec: the ConfigMap's key resize
    assert (tmp_path / "termination-log").read_text().startswith("StoppedForResize: worker 0 stopped")


@pytest.mark.parametrize("text, expected", [
    ('{"numNodes": 3, "rolloutNodes": 2}', ResizeRequest(3, 2)),
    ('{"numNodes": 3}', ResizeRequest(3, None)),
    # a rolloutNodes that cannot be (no trainer node left, < 1, not a count) is not named
    ('{"numNodes": 3, "rolloutNodes": 3}', ResizeRequest(3, None)),
    ('{"numNodes": 3, "rolloutNodes": 0}', ResizeRequest(3, None)),
    ('{"numNodes": 3, "rolloutNodes": true}', ResizeRequest(3, None)),
    ('{"numNodes": 3, "rolloutNodes": "2"}', ResizeRequest(3, None)),
    ('{"rolloutNodes": 2}', None),
])
def test_request_may_name_the_rollout_pool_size(tmp_path, text, expected):
    (tmp_path / "resize").write_text(text)
    assert read_request(tmp_path / "resize") == expected
    assert requested_nodes(tmp_path / "resize") == (expected.num_nodes if expected else None)  # as before


def test_in_place_only_when_the_trainer_nodes_stay():
    assert ResizeRequest(4, 3).in_place_for(num_nodes=3, rollout_nodes=2)  # 1 trainer node either way
    assert ResizeRequest(3, 2).in_place_for(num_nodes=3, rollout_nodes=2)  # the running sizes
    assert not ResizeRequest(4, 2).in_place_for(num_nodes=3, rollout_nodes=2)  # 2 trainer nodes: a restart
    assert not ResizeRequest(4, None).in_place_for(num_nodes=3, rollout_nodes=2)
    assert not ResizeRequest(4, 3).in_place_for(num_nodes=3, rollout_nodes=None)  # no pools


def test_the_gang_does_not_stop_for_an_in_place_rollout_resize(tmp_path):
    path = tmp_path / "resize"
    path.write_text('{"numNodes": 2, "rolloutNodes": 1}')
    assert ResizeWatch(path, 3, rollout_nodes=2).should_stop() is False
    assert ResizeWatch(path, 3).should_stop() is True  # no pools: a whole-gang resize, as before
    path.write_text('{"numNodes": 4, "rolloutNodes": 2}')  # the trainer pool grows: restart the gang
    assert ResizeWatch(path, 3, rollout_nodes=2).should_stop() is True
    assert EXIT_LEFT_POOL == 4 and EXIT_LEFT_POOL != EXIT_RESIZE


def test_distflow_node_exits_4_when_its_workers_left_the_rollout_pool(tmp_path, monkeypatch):
    from distflow import cli
    from distflow.resize import LeftPool

    config = tmp_path / "spec.yaml"
    config.write_text("apiVersion: distflow.io/v1alpha1\nkind: RLPostTrainJob\nmetadata: {name: j}\n"
                      "spec: {model: {path: tiny}, data: {train: {path: arithmetic}}}\n")

    def left(spec, name, spec_dir):
        raise LeftPool("worker 0 left the rollout pool at a step boundary")
    monkeypatch.setattr("distflow.launcher.launch_node", left)
    monkeypatch.setenv("DISTFLOW_TERMINATION_LOG", str(tmp_path / "termination-log"))
    assert cli.main(["node", "--config", str(config)]) == EXIT_LEFT_POOL
    assert (tmp_path / "termination-log").read_text().startswith("LeftPool: worker 0 left")
