"""Another project's controllers run as local processes next to the test control plane.

:class:`Addon` holds what Kueue (kueue.py) and KEDA (keda.py) share: a work
directory under the control plane's, the project's CRDs applied server-side,
processes logging to ``<name>.log`` there (with the parent-death signal), waits
that fail with the log tail when a process exits, and a stop by pid.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.controlplane.cluster import ControlPlane, ControlPlaneError, _openssl, _pdeathsig_hook, _terminate

STOP_TIMEOUT_S = 15.0


def issue_local_cert(directory: Path, ca_dir: Path, common_name: str, key_usage: str = "serverAuth") -> None:
    """tls.{crt,key} in ``directory`` for IP 127.0.0.1 and localhost, signed by ca_dir/ca.{crt,key}
    (EC P-256); ``key_usage`` is the extendedKeyUsage ("serverAuth,clientAuth" for mutual TLS)."""
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={common_name}", cwd=directory)
    (directory / "tls.ext").write_text(f"basicConstraints=CA:FALSE\nextendedKeyUsage={key_usage}\n"
                                       "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", str(ca_dir / "ca.crt"), "-CAkey", str(ca_dir / "ca.key"),
             "-set_serial", str(time.time_ns()), "-days", "365", "-extfile", "tls.ext", "-out", "tls.crt",
             cwd=directory)


class Addon:
    """A context manager: ``start()`` on enter (stopping again if it fails), ``stop()`` on exit.

    Subclasses set ``name`` and implement ``start`` (calling ``prepare`` first) and may extend ``stop``.
    """

    name = "addon"

    def __init__(self, control_plane: ControlPlane, start_timeout_s: float = 120.0) -> None:
        assert control_plane.workdir is not None
        self.cp, self.start_timeout_s = control_plane, start_timeout_s
        self.workdir = control_plane.workdir / self.name
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        raise NotImplementedError

    def prepare(self) -> Path:
        """A fresh work directory; returns its ``certs`` subdirectory (created)."""
        shutil.rmtree(self.workdir, ignore_errors=True)
        certs = self.workdir / "certs"
        certs.mkdir(parents=True)
        return certs

    def apply_crds(self, files: list[Path]) -> None:
        """Apply (server-side) and wait until every CRD is Established."""
        args = [a for f in files for a in ("-f", str(f))]
        out = self.cp.kubectl("apply", "--server-side", *args, timeout_s=120)
        if out.returncode != 0:
            raise ControlPlaneError(f"{self.name} CRDs: {out.stderr}")
        names = [f"crd/{yaml.safe_load(f.read_text())['metadata']['name']}" for f in files]
        self.cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names, check=True, timeout_s=90)

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=self.workdir,
                preexec_fn=_pdeathsig_hook())  # noqa: PLW1509

    def wait(self, what: str, ready: Callable[[], bool]) -> None:
        """Poll ``ready`` until ``start_timeout_s``.

        Raises:
            ControlPlaneError: a process exited, or the time ran out (with the log tail).
        """
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ControlPlaneError(f"{name} exited with code {proc.returncode}:\n{self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.2)
        logs = "\n".join(self.log_tail(name) for name in self.procs)
        raise ControlPlaneError(f"{self.name} {what} not ready after {self.start_timeout_s:.0f} s:\n{logs}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        log = self.workdir / f"{name}.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""

    def stop(self) -> None:
        """Stop every process, the last started first, by pid."""
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                _terminate(proc, STOP_TIMEOUT_S)
