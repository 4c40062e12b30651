"""requirements.lock agrees with pyproject.toml, and the venv .ci/setup made with the lock.

pyproject.toml holds ranges (lower bounds: the oldest versions the code runs
with); requirements.lock (universal, one pin per package and Python version,
markers select) holds what setup, CI and the images install. A pin outside its
range means the lock is stale or a bound is wrong; an installed version other
than the pin means the environment was not made from the lock.
"""

from __future__ import annotations

import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own dependency provides it
    import tomli as tomllib

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LOCKED_EXTRAS = ("runtime", "operator", "dev", "bench", "ray")
SETUP_EXTRAS = ("runtime", "operator", "dev", "ray")  # what .ci/setup-venv installs
# .ci/setup writes this into .venv's site-packages: it marks a venv made from the lock.
SETUP_MARKER = "_distflow_cached_venv.pth"


def lock_pins(text: str, env: dict[str, str]) -> dict[str, Version]:
    """The lock's pins whose markers hold in ``env``: {canonical name: version}.

    Raises:
        AssertionError: a package is pinned twice for ``env`` (the markers overlap).
    """
    pins: dict[str, Version] = {}
    for line in text.splitlines():
        if not line.strip() or line[0] in "# \t":
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        (spec,) = req.specifier
        assert spec.operator == "==", line
        name = canonicalize_name(req.name)
        assert name not in pins, f"{name} pinned twice for this Python: {line}"
        pins[name] = Version(spec.version)
    return pins


def declared_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """pyproject's dependencies and the named extras that apply to this interpreter."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [(Requirement(r), "") for r in project["dependencies"]]
    declared += [(Requirement(r), e) for e in extras for r in project["optional-dependencies"][e]]
    env = default_environment()
    return [r for r, extra in declared if r.marker is None or r.marker.evaluate({**env, "extra": extra})]


@pytest.fixture(scope="module")
def pins() -> dict[str, Version]:
    return lock_pins((REPO / "requirements.lock").read_text(), default_environment())


def test_markers_pick_the_pin_for_the_running_python():
    text = ("# header\ntorch==2.14.1 ; python_full_version < '3.11'\n    # via distflow\n"
            "torch==2.15.0 ; python_full_version >= '3.11'\npyyaml==6.0.4\n")
    env = {**default_environment(), "python_version": "3.10", "python_full_version": "3.10.14"}
    assert lock_pins(text, env) == {"torch": Version("2.14.1"), "pyyaml": Version("6.0.4")}
    env = {**env, "python_version": "3.12", "python_full_version": "3.12.3"}
    assert lock_pins(text, env) == {"torch": Version("2.15.0"), "pyyaml": Version("6.0.4")}


def test_every_declared_requirement_is_pinned_inside_its_range(pins):
    requirements = declared_requirements(LOCKED_EXTRAS)
    assert len(requirements) > 20  # the parse found pyproject's lists
    missing = sorted(r.name for r in requirements if canonicalize_name(r.name) not in pins)
    assert not missing, f"not in requirements.lock (recompile it as its header says): {missing}"
    outside = [f"{r} but locked {pins[canonicalize_name(r.name)]}" for r in requirements
               if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    assert not outside, f"requirements.lock pins outside pyproject's ranges: {outside}"


def test_the_setup_venv_has_exactly_the_locked_versions(pins):
    if not (Path(sysconfig.get_paths()["purelib"]) / SETUP_MARKER).exists():
        pytest.skip("not running in a venv made by .ci/setup")
    wrong = []
    for req in declared_requirements(SETUP_EXTRAS):
        try:
            installed = Version(metadata.version(req.name))
        except metadata.PackageNotFoundError:
            installed = None
        if installed != pins[canonicalize_name(req.name)]:
            wrong.append(f"{req.name} {installed} (lock: {pins[canonicalize_name(req.name)]})")
    # Dependencies of dependencies too: whatever is installed and locked must be at its pin.
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in pins and Version(dist.version) != pins[name]:
            wrong.append(f"{name} {dist.version} (lock: {pins[name]})")
    assert not wrong, f"installed versions differ from requirements.lock (rerun .ci/setup): {sorted(set(wrong))}"
