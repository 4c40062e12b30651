"""Resize cost: a job scaled 2 -> 4 -> 2 nodes in place, seconds from the scale request to a step at the new size.

The control plane is the e2e tier's (real kube-apiserver, etcd, scheduler, kwok
nodes), the operator runs in-process, and the e2e tier's kubelet runs each pod
as a local process: the real runtime, SmolLM2-135M-Instruct on CPU, one worker
of one thread per node, GRPO on small-number arithmetic (4 prompts x 4 samples
a step, so 2 and 4 nodes both divide the batch). The job starts at 2 nodes;
just after step 3 is logged its scale subresource is patched to 4 (what
`kubectl scale` does), three steps after the gang re-formed at 4 back to 2, and
it runs to step 14.

Both resizes are in place (``distflow.gang_resize``): for the grow the operator
creates the pods of nodes 2 and 3 at once, in the same attempt, and the gang
trains on at 2 nodes while they start; at the first step boundary after they
are Ready it saves that step's checkpoint, and the same worker processes re-form
the world with them and resume the checkpoint at 4 nodes. For the shrink the
gang re-forms at the next step boundary and nodes 2 and 3 exit (code 4). A
request made just after a step is logged is the worst case for the shrink: the
gang finishes the step it has just begun first.

Each resize's cost, request -> first step at the new size logged, is cut into
phases that add up to it (step K: the step the gang re-formed after):

- trained on: request -> step K logged (the steps trained at the old size
  meanwhile; for the grow, while the new pods start and become Ready);
- checkpoint + re-form: -> node 0 logs that the gang re-forms (step K's
  checkpoint saved, the new world announced);
- resume: -> step K+1 logged, less its own time (the old world closed, the new
  one formed, the worker built again, the checkpoint loaded at the new size);
- first step: step K+1's own time (``timing_s/step``).

Also per resize: the seconds without training (step K logged -> step K+1
started: checkpoint + re-form and resume), the seconds until the new pods were
Ready (grow) or the leaving ones had exited (shrink), and the operator's
``status.lastResize.costSeconds`` (request -> new pods running, or leaving pods
gone).

The target (issue 27) is "under one step time plus worker start", read here as
the median step time at the size being left plus a fresh start at the new size:
from the last of its pods' container starts to its first step logged, as a job
that had never run would take (the job's own start for 2 nodes, a fresh 4-node
job of one step for 4). Each phase's share of it: trained on, the median step
and the fresh start's worker start (the joiners start meanwhile); checkpoint +
re-form, none; resume, the fresh start's initialisation; first step, its first
step. So the excess of the phases over their shares adds up to cost - target.

Times: the request and the steps on this process's clock (each step when its
line appears in metrics.jsonl, polled every 20 ms; the re-form when its line
appears in node 0's container log, polled every 50 ms); container starts,
readiness and exits as the kubelet saw them (within one of its 0.25 s passes).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.bench._common import median
from tests.e2e.kubelet import ContainerEvent

PHASES = ("trained on", "checkpoint + re-form", "resume", "first step")
"""The parts of a resize's cost, in order; they add up to its total."""
FRESH_PHASES = ("worker start", "initialise", "first step")
"""The parts of a fresh start (last container start -> first step logged)."""
JOB = "resize-cost"


@dataclass(frozen=True)
class Settings:
    total_steps: int = 14
    """Room for the grow to wait several steps for its joiners and still leave steps after the shrink."""
    scale_up_after: int = 3
    """The 2 -> 4 request is made once this step is logged."""
    steps_at_4: int = 3
    """The 4 -> 2 request is made once this many steps after the re-form at 4 nodes are logged."""
    train_batch_size: int = 4
    samples_per_prompt: int = 4
    max_response_length: int = 8
    model: str = "smollm2"


def node_events(events: Iterable[ContainerEvent], job: str, ranks: Iterable[int],
                attempt: str = "1") -> list[ContainerEvent]:
    """The events of the node pods of ``job`` of these ranks in ``attempt``."""
    pods = {f"{job}-node-{rank}" for rank in ranks}
    return [e for e in events if e.pod in pods and e.attempt == attempt]


def _last(events: Sequence[ContainerEvent], what: str) -> float:
    return max(e.time_s for e in events if e.what == what)


def resize_phases(requested_s: float, reformed_after: int, reformed_s: float, step_done_s: dict[int, float],
                  step_seconds: dict[int, float]) -> dict[str, float]:
    """Seconds of each of ``PHASES``, their ``total`` and the seconds ``without training`` (step
    ``reformed_after`` logged -> the next step started: checkpoint + re-form and resume, when the
    request came before that step was logged) for one resize.

    Args:
        requested_s: when the scale subresource was patched (``time.time()``).
        reformed_after: the step K the gang re-formed after.
        reformed_s: when node 0's line saying so was seen.
        step_done_s: step -> when its metrics line was seen.
        step_seconds: step -> its ``timing_s/step``.
    """
    done = max(step_done_s[reformed_after], requested_s)
    first = reformed_after + 1
    started = step_done_s[first] - step_seconds[first]
    parts = [done - requested_s, reformed_s - done, started - reformed_s, step_seconds[first]]
    return {**dict(zip(PHASES, parts, strict=True)), "total": step_done_s[first] - requested_s,
            "without training": started - step_done_s[reformed_after]}


def pods_seconds(requested_s: float, events: Sequence[ContainerEvent], job: str, from_nodes: int,
                 to_nodes: int) -> float:
    """Seconds from the request until the last new node pod was Ready (a grow) or the last leaving
    one's container had exited (a shrink); ``events``: the attempt's, as the kubelet saw them."""
    grow = to_nodes > from_nodes
    changed = node_events(events, job, range(min(from_nodes, to_nodes), max(from_nodes, to_nodes)))
    return _last(changed, "ready" if grow else "exited") - requested_s


def fresh_start(first_step: int, step_done_s: dict[int, float], step_seconds: dict[int, float],
                events: Sequence[ContainerEvent]) -> dict[str, float]:
    """Seconds of each of ``FRESH_PHASES`` and their ``total`` for a gang that starts from nothing:
    the last of its containers' starts (``events``: its pods' only) -> its first step (``first_step``)
    logged."""
    started, ready = _last(events, "started"), _last(events, "ready")
    parts = [ready - started, step_done_s[first_step] - ready - step_seconds[first_step], step_seconds[first_step]]
    return {**dict(zip(FRESH_PHASES, parts, strict=True)), "total": step_done_s[first_step] - started}


def median_step_seconds(step_seconds: dict[int, float], spans: Sequence[tuple[int, int, int]]) -> dict[int, float]:
    """Median ``timing_s/step`` per size over ``spans`` (size, first step, last step), each span's
    first step left out (the first of a worker process, or of a worker built again after a re-form)."""
    per_size: dict[int, list[float]] = {}
    for size, first, last in spans:
        per_size.setdefault(size, []).extend(step_seconds[k] for k in range(first + 1, last + 1))
    return {size: median(values) for size, values in per_size.items()}


def sample_checks(ids: dict[int, list[int]], total_steps: int, batch: int,
                  samples_per_prompt: int) -> dict[str, bool]:
    """What the trained sample ids say: every step once, each of its prompts with all its samples,
    no prompt in two steps (the run fits in one epoch)."""
    prompts = [set(ids[k]) for k in sorted(ids)]
    return {
        "every step trained once": sorted(ids) == list(range(1, total_steps + 1)),
        "every step's prompts with all their samples": all(
            len(set(v)) == batch and all(v.count(p) == samples_per_prompt for p in set(v)) for v in ids.values()),
        "no prompt trained twice or lost": sum(map(len, prompts)) == len(set().union(*prompts)) == total_steps * batch,
    }


FRESH_SHARE = {"resume": "initialise", "first step": "first step"}
"""The phase of a fresh start that is each resize phase's share of the target (trained on's is the
median step plus the fresh start's worker start; checkpoint + re-form has none)."""


def summarize(resizes: Sequence[dict], fresh: dict[int, dict[str, float]], medians: dict[int, float]) -> list[dict]:
    """Each resize ({from, to, phases, ...}) with its target (median step at ``from`` + fresh start at
    ``to``), its cost over that target, the phase that cost most (``dominant``), and per phase how much
    longer it took than its share of the target (``excess``: they add up to cost - target), the largest
    of which is ``largest_excess``."""
    out = []
    for r in resizes:
        start = fresh[r["to"]]
        target = medians[r["from"]] + start["total"]
        share = {"trained on": medians[r["from"]] + start["worker start"],
                 **{p: start[counterpart] for p, counterpart in FRESH_SHARE.items()}}
        excess = {p: r["phases"][p] - share.get(p, 0.0) for p in PHASES}
        cost = r["phases"]["total"]
        out.append({**r, "target_seconds": target, "ratio": cost / target, "met": cost <= target,
                    "dominant": max(PHASES, key=lambda p: r["phases"][p]), "excess": excess,
                    "largest_excess": max(PHASES, key=lambda p: excess[p])})
    return out


class _Poller:
    """A thread that calls ``_read(now)`` every ``poll_s`` seconds while the ``with`` block runs."""

    def __init__(self, poll_s: float):
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=type(self).__name__)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._read(time.time())
            self._stop.wait(self.poll_s)

    def _read(self, now: float) -> None:
        raise NotImplementedError

    def _wait(self, found: Callable[[], object], timeout_s: float, what: str) -> object:
        """``found()`` once it is not None; raises TimeoutError (with ``what``) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (value := found()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(self.poll_s)
        return value


class StepClock(_Poller):
    """When each step's line appears in ``log_dir/metrics.jsonl``, with its ``timing_s/step``. Keeps
    the first sighting of a step should a resume rewrite the file."""

    def __init__(self, log_dir: Path, poll_s: float = 0.02):
        super().__init__(poll_s)
        self.path = Path(log_dir) / "metrics.jsonl"
        self.done_s: dict[int, float] = {}
        self.step_seconds: dict[int, float] = {}

    def _read(self, now: float) -> None:
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a line being written
                continue
            step = int(record.get("training/step", 0))
            if step and "timing_s/step" in record and step not in self.done_s:
                self.done_s[step] = now
                self.step_seconds[step] = float(record["timing_s/step"])

    def wait_for(self, step: int, timeout_s: float, what=lambda: "") -> float:
        """When ``step`` was logged; raises TimeoutError (with ``what()``) after ``timeout_s``."""
        return self._wait(lambda: self.done_s.get(step), timeout_s,
                          f"step {step} not logged within {timeout_s} s\n{what()}")


class LineClock(_Poller):
    """When each match of ``pattern`` (its groups, integers) first appears in the files
    ``directory.glob(glob)`` (a container log, whose pod directory may not exist yet)."""

    def __init__(self, directory: Path, glob: str, pattern: re.Pattern, poll_s: float = 0.05):
        super().__init__(poll_s)
        self.directory, self.glob, self.pattern = Path(directory), glob, pattern
        self.seen_s: dict[tuple[int, ...], float] = {}

    def _read(self, now: float) -> None:
        for path in self.directory.glob(self.glob):
            for m in self.pattern.finditer(path.read_text(errors="replace")):
                self.seen_s.setdefault(tuple(map(int, m.groups())), now)

    def wait_for(self, wanted: Callable[[tuple[int, ...]], bool], timeout_s: float,
                 what=lambda: "") -> tuple[tuple[int, ...], float]:
        """The first match ``wanted`` takes and when it was seen; raises TimeoutError after ``timeout_s``."""
        return self._wait(lambda: next(((k, t) for k, t in list(self.seen_s.items()) if wanted(k)), None),
                          timeout_s, f"no {self.pattern.pattern!r} as wanted within {timeout_s} s\n{what()}")


def _job(s: Settings, name: str, tmp_path: Path, num_nodes: int, total_steps: int) -> dict:
    from tests.e2e.harness import job_doc

    doc = job_doc(name, tmp_path, total_steps, model=s.model)
    spec = doc["spec"]
    spec["data"].update({"trainBatchSize": s.train_batch_size, "maxPromptLength": 64,
                         "maxResponseLength": s.max_response_length, "rewardFn": "arithmetic_concise",
                         "systemPrompt": "You are a calculator. Reply with the number only."})
    spec["rollout"]["n"] = s.samples_per_prompt
    spec["actor"]["microBatchSize"] = s.train_batch_size * s.samples_per_prompt
    spec["algorithm"] = {"useKlLoss": False}
    spec["cluster"].update({"numNodes": num_nodes, "maxNodes": 4})
    spec["checkpoint"]["saveEverySteps"] = 0  # only the resizes (and the last step) save
    return doc


def _resize(cluster, api, clock: StepClock, reforms: LineClock, kubelet, after_step: int,
            to_nodes: int) -> tuple[float, dict, int, float]:
    """Patch the scale subresource once ``after_step`` is logged. Returns the request time, the job's
    lastResize once the operator is done, and the step the gang re-formed after and when node 0 said so."""
    from tests.e2e.harness import JOB_TIMEOUT_S
    from tests.operator._helpers import dump, wait_for

    clock.wait_for(after_step, JOB_TIMEOUT_S, what=kubelet.log_tails)
    requested = time.time()
    code, body = cluster.request("PATCH", f"{api.jobs}/{JOB}/scale", {"spec": {"replicas": to_nodes}},
                                 content_type="application/merge-patch+json")
    assert code == 200, body
    (step, _), reformed = reforms.wait_for(lambda key: key[0] >= after_step and key[1] == to_nodes,
                                           JOB_TIMEOUT_S, what=kubelet.log_tails)
    last = wait_for(lambda: (api.status(JOB).get("lastResize") or {}).get("to") == to_nodes
                    and api.status(JOB)["lastResize"], JOB_TIMEOUT_S, 0.5,
                    what=lambda: f"resized to {to_nodes} ({dump(api.status(JOB))}\n{kubelet.log_tails()})")
    return requested, last, step, reformed


def _checks(s: Settings, logs: Path, status: dict, kubelet, reformed: Iterable[tuple[int, ...]],
            lasts: Sequence[dict]) -> dict[str, bool]:
    """What the resized job trained and how its pods ended; ``reformed``: (step, nodes) of each
    re-form node 0 logged, ``lasts``: the job's lastResize after each resize."""
    from distflow import sample_ids
    from tests.e2e.harness import trained_steps

    checks = sample_checks(sample_ids.read(logs), s.total_steps, s.train_batch_size, s.samples_per_prompt)
    checks["every step logged once"] = trained_steps(logs) == list(range(1, s.total_steps + 1))
    checks["the gang re-formed in place twice, at 4 then 2 nodes"] = \
        [nodes for _, nodes in sorted(reformed)] == [4, 2] and all(last.get("inPlace") for last in lasts)
    checks["attempt 1 throughout, no restart or disruption counted"] = (
        status["attempt"], status["restarts"], status["disruptions"]) == (1, 0, 0)
    exits = sorted((e.attempt, e.pod, e.exit_code) for e in kubelet.exits if e.pod.startswith(f"{JOB}-node-"))
    checks["nodes 0 and 1 exit 0, nodes 2 and 3 exit 4 (left the gang)"] = exits == [
        ("1", f"{JOB}-node-{rank}", 0 if rank < 2 else 4) for rank in range(4)]
    return checks


def _resized_job(s: Settings, cluster, namespace: str, kubelet, tmp_path: Path) -> dict:
    """The 2 -> 4 -> 2 job: its timings and what it trained."""
    from tests.e2e.harness import JOB_TIMEOUT_S, REFORMED, apply_job, wait_finished
    from tests.operator._helpers import Api

    api = Api(cluster, namespace)
    logs = tmp_path / "logs"
    with (StepClock(logs) as clock,
          LineClock(kubelet.workdir, f"{JOB}-node-0-*/container.log", REFORMED) as reforms):
        apply_job(cluster, namespace, _job(s, JOB, tmp_path, 2, s.total_steps))
        up = _resize(cluster, api, clock, reforms, kubelet, s.scale_up_after, 4)
        down = _resize(cluster, api, clock, reforms, kubelet, up[2] + s.steps_at_4, 2)
        status = wait_finished(api, JOB, kubelet, timeout_s=2 * JOB_TIMEOUT_S)
    events = node_events(kubelet.events, JOB, range(4))
    resizes = []
    for requested, last, reformed_after, reformed_s in (up, down):
        phases = resize_phases(requested, reformed_after, reformed_s, clock.done_s, clock.step_seconds)
        resizes.append({"from": last["from"], "to": last["to"], "reformed_after": reformed_after,
                        "steps_trained_on": reformed_after - max(k for k, t in clock.done_s.items() if t <= requested),
                        "phases": phases,
                        "pods_seconds": pods_seconds(requested, events, JOB, last["from"], last["to"]),
                        "operator_cost_seconds": last["costSeconds"]})
    spans = [(2, 1, up[2]), (4, up[2] + 1, down[2]), (2, down[2] + 1, s.total_steps)]
    return {"resizes": resizes, "checks": _checks(s, logs, status, kubelet, reforms.seen_s,
                                                     (up[1], status["lastResize"])),
            "spans": spans, "step_seconds": clock.step_seconds,
            "fresh_2": fresh_start(1, clock.done_s, clock.step_seconds, node_events(events, JOB, range(2))),
            "status": {k: status[k] for k in ("attempt", "restarts", "disruptions")}}


def _fresh_job(s: Settings, cluster, namespace: str, kubelet, tmp_path: Path, num_nodes: int) -> dict:
    """A job that starts at ``num_nodes`` and trains one step: its fresh start."""
    from tests.e2e.harness import apply_job, wait_finished
    from tests.operator._helpers import Api

    name = f"fresh-{num_nodes}"
    with StepClock(tmp_path / "logs") as clock:
        apply_job(cluster, namespace, _job(s, name, tmp_path, num_nodes, 1))
        wait_finished(Api(cluster, namespace), name, kubelet)
    return fresh_start(1, clock.done_s, clock.step_seconds, node_events(kubelet.events, name, range(num_nodes)))


def _control_plane_bin_dir() -> Path:
    from tests.controlplane import cluster

    prebuilt = os.environ.get("DISTFLOW_CONTROLPLANE_BIN")
    bin_dir = Path(prebuilt) if prebuilt else cluster.build_binaries()
    missing = cluster.missing_binaries(bin_dir)
    if missing:
        raise RuntimeError(f"control plane binaries missing: {', '.join(missing)} (run bash .ci/setup --tests)")
    return bin_dir


def run(s: Settings = Settings()) -> dict:
    from tests.e2e.harness import e2e_control_plane, job_namespace
    from tests.e2e.kubelet import LocalKubelet
    from tests.operator._helpers import operator_kubeconfig, operator_running

    with (tempfile.TemporaryDirectory(prefix="distflow-resize-bench-") as tmp,
          e2e_control_plane(_control_plane_bin_dir()) as cluster, job_namespace(cluster, "resize-bench") as ns):
        work = Path(tmp)
        with (operator_running(operator_kubeconfig(cluster, ns, work), ns, PROGRESS_INTERVAL="0.3"),
              LocalKubelet(cluster, ns, work / "kubelet") as kubelet):
            job = _resized_job(s, cluster, ns, kubelet, work / "resized")
            fresh = {2: job.pop("fresh_2"), 4: _fresh_job(s, cluster, ns, kubelet, work / "fresh", 4)}
    medians = median_step_seconds(job["step_seconds"], job["spans"])
    return {"settings": asdict(s), "resizes": summarize(job["resizes"], fresh, medians),
            "fresh_start": {str(k): v for k, v in fresh.items()},
            "median_step_seconds": {str(k): v for k, v in medians.items()},
            "step_seconds": {str(k): v for k, v in sorted(job["step_seconds"].items())},
            "checks": job["checks"], "status": job["status"]}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1, default=float))
