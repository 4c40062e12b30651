"""Read the pinned requirement files (``requirements.lock``, ``worker_image/requirements-*.lock``).

They are ``uv pip compile`` output: ``name==version`` lines, each with an
optional environment marker (``--universal`` forks by Python version), and
``#`` comments. ``pins`` evaluates the markers for one environment.
"""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"


def pins(path: Path = LOCK, environment: dict[str, str] | None = None) -> dict[str, str]:
    """``{canonical name: version}`` of the lines whose marker holds in ``environment``
    (packaging's marker variables; None: this interpreter's).

    Raises:
        ValueError: a line that is not ``name==version[ ; marker]``, or a package
            pinned twice for one environment.
    """
    out: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise ValueError(f"{path.name}:{number}: {raw!r} is not pinned with ==")
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        name = canonicalize_name(req.name)
        if name in out:
            raise ValueError(f"{path.name}:{number}: {req.name} pinned twice for this environment")
        out[name] = specs[0].version
    return out


def linux_environment(python_version: str) -> dict[str, str]:
    """Marker variables of a Linux x86_64 CPython ``python_version`` (e.g. "3.12"), as in the images."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython"}
