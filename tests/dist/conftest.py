"""Fixtures of the dist tier."""

import json

import pytest


@pytest.fixture
def device_guard(tmp_path, monkeypatch):
    """The job's workers run their steps under ``distflow.device_guard``; the test fails on any
    tensor that a GPU run would find on the wrong device (listed once per place)."""
    report = tmp_path / "device_guard.jsonl"
    monkeypatch.setenv("DISTFLOW_DEVICE_GUARD", str(report))
    yield report
    lines = report.read_text().splitlines() if report.exists() else []
    found = sorted({(v["rule"], v["where"], v["message"]) for v in map(json.loads, lines)})
    assert not found, "tensors on the wrong device:\n" + "\n".join(f"{r}: {w}: {m}" for r, w, m in found)
