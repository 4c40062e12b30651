"""The packages the GPU machine lacks, as a folder to carry there and put on ``PYTHONPATH``.

    python -m tests.bench.gpu_wheels                  # -> .gpu-site/ (ignored by git)

The GPU machine has torch, transformers, tokenizers, safetensors and pyyaml but
no pydantic, which ``distflow.spec`` needs, and no network. This downloads the
wheels of pydantic and its dependencies at the versions of requirements.lock
(``pip download --only-binary=:all: --no-deps`` for manylinux x86_64, cached
under ``$DISTFLOW_CACHE/gpu-wheels``) and unpacks them into one folder.
pydantic-core is compiled: its wheel is fetched for each of ``PYTHON_VERSIONS``
and this interpreter's, and all are unpacked side by side, so its package holds
one ``_pydantic_core.cpython-3XX-*.so`` per version and the importing Python
loads its own; the pure-Python files are the same in every wheel.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.bench._common import REPO_ROOT

PACKAGES = ("pydantic", "pydantic-core", "typing-extensions", "annotated-types", "typing-inspection")
PYTHON_VERSIONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
DEFAULT_DEST = REPO_ROOT / ".gpu-site"


def locked_versions(lock: Path = REPO_ROOT / "requirements.lock") -> dict[str, str]:
    """``{name: version}`` of ``PACKAGES`` in the lock file (one unconditional pin each).

    Raises:
        ValueError: a package has no unconditional ``name==version`` line.
    """
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, rest = line.partition("==")
        if sep and name in PACKAGES and ";" not in rest:
            pins[name] = rest.strip()
    missing = [p for p in PACKAGES if p not in pins]
    if missing:
        raise ValueError(f"requirements.lock pins no single version of {missing}")
    return pins


def download(python_version: str, cache: Path) -> list[Path]:
    """The locked wheels for CPython ``python_version`` on manylinux x86_64, from the cache or the index."""
    folder = cache / f"cp{python_version.replace('.', '')}"
    pins = locked_versions()
    wanted = {f"{name.replace('-', '_')}-{version}-" for name, version in pins.items()}
    cached = sorted(folder.glob("*.whl"))
    if all(any(path.name.startswith(prefix) for path in cached) for prefix in wanted):
        return cached  # all there: no index needed (the rehearsal runs offline once cached)
    abi = f"cp{python_version.replace('.', '')}"
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps",
                    "--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
                    "--abi", "none", *platforms, "--platform", "any", "--dest", str(folder),
                    *(f"{name}=={version}" for name, version in pins.items())], check=True)
    return sorted(folder.glob("*.whl"))


def build_site(dest: Path, python_versions: tuple[str, ...], cache: Path) -> Path:
    """``dest`` holding the unpacked wheels for every version in ``python_versions``."""
    dest.mkdir(parents=True, exist_ok=True)
    for version in dict.fromkeys(python_versions):
        for wheel in download(version, cache):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(dest)
    return dest


def wheel_cache() -> Path:
    """Where downloaded wheels are kept: ``$DISTFLOW_CACHE/gpu-wheels`` (see ``model_cache_dir``)."""
    from distflow.models import model_cache_dir

    return model_cache_dir() / "gpu-wheels"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=str(DEFAULT_DEST))
    parser.add_argument("--python-versions", default=",".join(PYTHON_VERSIONS),
                        help="the GPU machine's Python versions (this interpreter's is always added)")
    args = parser.parse_args()
    this = f"{sys.version_info.major}.{sys.version_info.minor}"
    versions = (*args.python_versions.split(","), this)
    print(build_site(Path(args.dest), versions, wheel_cache()))


if __name__ == "__main__":
    main()
