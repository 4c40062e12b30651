"""Shared pytest plumbing: tier markers' run rules and the control plane fixtures.

Markers are declared in pyproject.toml. Here: `bench`, `long`, `keda` and `ray` tests
run only when the -m expression names them (OPT_IN_TIERS); `gpu` tests skip without CUDA; `control_plane`
builds (cached) and starts a real control plane once per session, lazily, so
tests that do not ask for it never trigger a build; `report_figure` collects
measured figures that the run's summary lists under "figures".
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]

OPT_IN_TIERS = {
    "bench": "benchmark",
    "long": "long forms: the chaos loops at full size (operator killed x10, API server x5, 100 jobs x 8 nodes), and "
            "runs whose behaviour a shorter default test also checks (~20 min on 2 cores)",
    "keda": "KEDA's operator and metrics server on the test control plane (bash tests/controlplane/build_keda.sh "
            "builds them once)",
    "ray": "Ray launcher tier (a two-node Ray cluster; 4 actors importing torch per run, ~5 min on 2 cores)",
}
"""Tiers that run only when the -m expression names them: too long for the default run."""


def pytest_configure(config: pytest.Config) -> None:
    # Subprocesses the tests start (`python -m distflow.cli ...`) import this checkout's sources too.
    own = [str(REPO / "worker_image"), str(REPO / "operator")]
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in own]
    os.environ["PYTHONPATH"] = os.pathsep.join(own + rest)


@pytest.hookimpl(trylast=True)  # after -m deselection, so torch loads only for selected gpu tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.getoption("markexpr") or ""
    for tier, why in OPT_IN_TIERS.items():
        if tier not in markexpr:
            skip = pytest.mark.skip(reason=f"{why}: run with -m {tier}")
            for item in items:
                if tier in item.keywords:
                    item.add_marker(skip)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _cuda_available():
        skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
        for item in gpu_items:
            item.add_marker(skip_gpu)


FIGURES = pytest.StashKey[list]()


@pytest.fixture
def report_figure(request: pytest.FixtureRequest):
    """``report_figure(line)``: one line of figures a test measured, listed in the run's summary
    (tagged with the test's parameter id, e.g. ``[long]``) and printed at once (seen with -s)."""
    lines = request.config.stash.setdefault(FIGURES, [])
    callspec = getattr(request.node, "callspec", None)
    tag = f"[{callspec.id}] " if callspec is not None else ""

    def report(line: str) -> None:
        lines.append(f"{tag}{line}")
        print(f"\nFIGURE {tag}{line}")

    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(FIGURES, [])
    if lines:
        terminalreporter.write_sep("=", "figures")
        for line in lines:
            terminalreporter.write_line(line)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture(scope="session")
def control_plane_bin_dir() -> Path:
    """Directory with the control plane binaries.

    DISTFLOW_CONTROLPLANE_BIN points at prebuilt binaries; otherwise build.sh
    runs (a no-op when cached). Skips, naming the missing binaries, only when
    the binaries cannot be had.
    """
    from tests.controlplane import cluster

    prebuilt = os.environ.get("DISTFLOW_CONTROLPLANE_BIN")
    if prebuilt:
        bin_dir, why = Path(prebuilt), "DISTFLOW_CONTROLPLANE_BIN"
    else:
        try:
            bin_dir, why = cluster.build_binaries(), "build.sh"
        except (cluster.ControlPlaneError, OSError) as err:
            bin_dir, why = None, f"build.sh failed: {err}"
    missing = cluster.missing_binaries(bin_dir)
    if missing:
        pytest.skip(f"control plane binaries missing: {', '.join(missing)} ({why})")
    return bin_dir


@pytest.fixture(scope="session")
def control_plane(control_plane_bin_dir: Path, pytestconfig: pytest.Config):
    """A running ControlPlane (2 fake GPU nodes, kwok marks pods Running). Components that exited
    on their own during the session (and were started again) are listed under "figures"."""
    from tests.controlplane.cluster import ControlPlane

    with ControlPlane(control_plane_bin_dir, nodes=2) as cp:
        yield cp
        pytestconfig.stash.setdefault(FIGURES, []).extend(
            f"control plane: {gone} (started again)" for gone in cp.restarts)


@pytest.fixture
def k8s_namespace(control_plane, request: pytest.FixtureRequest) -> str:
    """A fresh namespace for one test, with its default ServiceAccount present;
    deleted (without waiting) afterwards."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    control_plane.request("POST", "/api/v1/namespaces",
                          {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
                          expect=(201,))
    deadline = time.monotonic() + 30
    # Pods are rejected until the controller-manager has made "default".
    while control_plane.request(
            "GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")[0] != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {name}: default ServiceAccount never appeared")
        time.sleep(0.1)
    yield name
    control_plane.request("DELETE", f"/api/v1/namespaces/{name}")
