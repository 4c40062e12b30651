"""The chaos loop's parts: one job run as its own launcher process, killed (or not) by ``distflow.chaos``.

``python -m tests.dist._chaos DIR SECTIONS_JSON`` runs ``tiny_job_spec(DIR, "job", **sections)``
through the local launcher, as ``distflow run`` would.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from distflow.chaos import EVENTS

REPO = Path(__file__).resolve().parents[2]
JOB = {"trainer": {"totalSteps": 4}, "checkpoint": {"saveEverySteps": 1, "keepLast": 2}}


@dataclass
class Attempt:
    returncode: int
    output: str


def run_job(job_dir: Path, chaos: str | None = None, tally: Path | None = None, timeout_s: float = 600,
            sections: dict | None = None) -> Attempt:
    """One launcher process (its own session, so every worker it left behind can be waited for),
    running ``tiny_job_spec(job_dir, "job", **sections)`` (default: ``JOB``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTFLOW_CHAOS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "worker_image"), str(REPO / "operator"), str(REPO)])
    if chaos:
        env["DISTFLOW_CHAOS"] = chaos
    if tally:
        env["DISTFLOW_CHAOS_TALLY"] = str(tally)
    job_dir.mkdir(parents=True, exist_ok=True)
    log = job_dir / "launcher.log"
    with log.open("a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.dist._chaos", str(job_dir), json.dumps(sections or JOB)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        finally:
            _reap_session(proc.pid)
    return Attempt(returncode, log.read_text())


def _reap_session(pgid: int, grace_s: float = 30.0) -> None:
    """Wait until no process of the launcher's session is left (workers die by their parent-death
    signal); SIGKILL what is still there after ``grace_s``, like a node going away."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_tally(tally_dir: Path) -> dict[int, dict[str, int]]:
    """``{rank: {event: count}}`` of an uninterrupted run."""
    return {int(p.stem.removeprefix("tally_rank")): json.loads(p.read_text()) for p in tally_dir.glob("tally_rank*.json")}


@dataclass
class Trial:
    target: str
    event: str
    rank: int
    count: int
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def chaos(self) -> str:
        return f"rank={self.rank},event={self.event},count={self.count},target={self.target}"


def draw_trials(num_trials: int, seed: int, tally: dict[int, dict[str, int]]) -> list[Trial]:
    """Every event kind with both targets in turn; rank and moment drawn with ``seed``."""
    rng = random.Random(seed)
    trials = []
    for i in range(num_trials):
        event = EVENTS[i % len(EVENTS)]
        target = ("worker", "launcher")[(i // len(EVENTS)) % 2]
        ranks = [r for r in sorted(tally) if tally[r].get(event, 0) > 0]
        rank = rng.choice(ranks)
        trials.append(Trial(target, event, rank, rng.randint(1, tally[rank][event])))
    return trials


def main(argv: list[str]) -> int:
    from distflow.launcher import launch_local
    from tests.dist._jobs import tiny_job_spec

    job_dir, sections = Path(argv[0]), json.loads(argv[1])
    spec = tiny_job_spec(job_dir, "job", **sections)
    launch_local(spec, "chaos", progress=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
