"""`distflow` command line.

    distflow run CONFIG [--set path=value ...] [--no-resume]   train on this machine
    distflow run CONFIG --ray auto|HOST:PORT                    train on an existing Ray cluster
    distflow plan CONFIG                                        print the plan every worker runs
    distflow validate CONFIG                                    check a config or RLPostTrainJob
    distflow model convert [SOURCE]                             GGUF -> safetensors, once, cached
    distflow node --config PATH                                 what a pod runs (env launcher; fields
                                                                this image does not know: a warning)

Exit codes: 0 done, 1 training failed, 2 invalid config (nothing started) or a user function
that raised (retrying cannot help: the operator fails the job at once), 3 stopped at a step
boundary for a resize the operator asked for (checkpoint saved; ``distflow node`` only).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from distflow.errors import DistflowConfigError, LaunchError, UserFunctionError
from distflow.launcher import EXIT_FAILED, EXIT_INVALID_CONFIG, EXIT_OK
from distflow.resize import EXIT_LEFT_POOL, EXIT_RESIZE, LeftPool, StoppedForResize
from distflow.spec import JobSpec, load_job_spec, load_rendered_spec


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distflow", description="distflow: distributed RL post-training of LLMs "
                                "(GRPO, PPO, DAPO); the same job on this machine or on Kubernetes (RLPostTrainJob). "
                                "Start with: distflow run examples/quickstart.yaml")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("run", "train on this machine (local launcher)"),
                       ("plan", "print the execution plan"),
                       ("validate", "validate a config or an RLPostTrainJob manifest")):
        c = sub.add_parser(name, help=text)
        c.add_argument("config", help="local run config or RLPostTrainJob YAML")
        c.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                       help="override a spec field (the value read as YAML), e.g. --set data.train.path=train.jsonl; "
                            "a number picks a list item: --set rollout.multiTurn.tools.0.function=m:f")
        if name == "run":
            once = c.add_mutually_exclusive_group()
            once.add_argument("--no-resume", action="store_true",
                              help="start over: move the previous run's checkpoints and logs aside (<name>.previous)")
            once.add_argument("--resume", action="store_true",
                              help="continue from the latest checkpoint (the default when one exists; "
                                   "also where the config says checkpoint.resume: never)")
            c.add_argument("--ray", metavar="ADDRESS", default=None,
                           help="run the workers as actors on this Ray cluster: auto (Ray's discovery), "
                                "HOST:PORT or ray://HOST:10001 (default: spec.ray.address, else this machine)")
    node = sub.add_parser("node", help="run this pod's workers (env launcher)")
    node.add_argument("--config", required=True, help="the job spec mounted from the ConfigMap")
    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True)
    conv = msub.add_parser("convert", help="convert a GGUF model to safetensors in the cache")
    conv.add_argument("source", nargs="?", default="smollm2", help="smollm2 (default) or gguf:<file>")
    return p


def _load(args) -> JobSpec:
    return load_job_spec(args.config, args.overrides)


def cmd_run(args) -> int:
    from distflow.launcher import job_name_for, launch_local

    spec = _load(args)
    if args.resume and spec.checkpoint.resume != "auto":
        spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"resume": "auto"})})
    address = args.ray or spec.ray.address
    if address:
        from distflow.ray_launcher import launch_ray

        launch_ray(spec, job_name_for(args.config), address, resume=not args.no_resume)
    else:
        launch_local(spec, job_name_for(args.config), resume=not args.no_resume)
    if (summary := run_summary(spec)) is not None:
        print(summary)
    return EXIT_OK


def run_summary(spec: JobSpec) -> str | None:
    """The run's last line, from its metrics.jsonl: the held-out score before and after training,
    or without a held-out set (``data.eval: null``) the step reached and where its output lies;
    None when there is no metrics file here (on Ray, rank 0 writes it on its own Ray node: the
    driver sees it only where ``trainer.logDir`` is shared)."""
    from distflow.metrics import read_jsonl

    metrics = Path(spec.trainer.log_dir) / "metrics.jsonl"
    records = read_jsonl(metrics) if metrics.is_file() else []
    evals = [r["eval/score"] for r in records if "eval/score" in r]
    if evals:
        return (f"eval score: before {evals[0]:.3f} -> after {evals[-1]:.3f} "
                f"({len(evals)} evaluations; metrics in {metrics})")
    steps = [int(r["training/step"]) for r in records if r.get("training/step")]
    if not steps:
        return None
    saved = f", checkpoints in {spec.checkpoint.dir}" if spec.checkpoint.dir else ""
    last, total = max(steps), spec.trainer.total_steps
    reached = f"step {last} of {total}" if last <= total else f"step {last}, past trainer.totalSteps ({total})"
    return f"trained to {reached}; metrics in {metrics}{saved} (no held-out score: data.eval is not set)"


def cmd_plan(args) -> int:
    from distflow.planner import build_plan

    print(build_plan(_load(args)).describe())
    return EXIT_OK


def cmd_validate(args) -> int:
    from fsspec.utils import get_protocol

    from distflow.checkpoint_origin import check_resume
    from distflow.models import model_cache_dir, resolved_model_dir
    from distflow.preflight import check_prompt_lengths, preflight

    spec = _load(args)
    preflight(spec)
    if (model_dir := resolved_model_dir(spec.model.path, model_cache_dir())) is not None:
        check_prompt_lengths(spec, model_dir)  # only when the model is on disk: validate converts nothing
    if spec.checkpoint.dir and get_protocol(spec.checkpoint.dir) == "file":  # an object store is not probed here
        # What `distflow run` refuses at its start: a checkpoint made from another model or workflow
        # (the model's shape is compared there, once the model is resolved).
        check_resume(spec, None)
    for warning in resize_warnings(spec) + ignored_async_warnings(spec):
        print(f"distflow: warning: {warning}", file=sys.stderr)
    workers = f"{spec.world_size} workers"
    if spec.async_.enable:
        rollout = spec.async_.rollout_pool.num_nodes * spec.cluster.procs_per_node
        workers += (f": {spec.world_size - rollout} train, {rollout} generate in the rollout pool, "
                    f"async.maxStaleness {spec.async_.max_staleness};")
    else:
        workers += ","
    workflow = "custom" if spec.workflow.nodes else spec.workflow.name or "grpo"
    print(f"{args.config}: valid ({workers} workflow {workflow})")
    return EXIT_OK


def resize_warnings(spec) -> list[str]:
    """What a valid spec loses when it is resized: bounds (``cluster.minNodes``/``maxNodes``) say the job
    may be resized (kubectl scale, an autoscaler), so every size between them should be one the API
    server accepts, and a resize resumes from the step's checkpoint, which needs ``checkpoint.dir`` on
    storage every node pod reads (a mounted volume or an object store)."""
    from fsspec.utils import get_protocol

    cluster = spec.cluster
    if cluster.min_nodes is None and cluster.max_nodes is None:
        return []
    if cluster.min_nodes == cluster.max_nodes == cluster.num_nodes:  # the bounds pin the size
        return []
    warnings = []
    if refused := refused_sizes(spec):
        sizes = ", ".join(f"{size} ({reason})" for size, reason in refused)
        warnings.append(f"cluster.minNodes/maxNodes allow sizes the spec refuses, so kubectl scale or an "
                        f"autoscaler asking for them is refused: {sizes}; narrow the bounds or change those "
                        f"fields")
    directory = spec.checkpoint.dir
    if not directory:
        warnings.append("cluster.minNodes/maxNodes let the job be resized (kubectl scale, an autoscaler), but "
                        "without checkpoint.dir a resize starts the training over at step 0; set checkpoint.dir "
                        "(a volume every node pod mounts)")
    elif get_protocol(directory) == "file" and not _mounted(spec.template, directory):  # an object store is shared
        warnings.append(f"checkpoint.dir: {directory!r} is on no volume of template.persistentVolumeClaims or "
                        f"template.volumeMounts, so on Kubernetes each node pod writes its own and a resize or "
                        f"restart (new pods) starts over; mount a volume every node pod shares there (a "
                        f"ReadWriteMany PVC) or use an object store URL (s3://bucket/prefix)")
    return warnings


def refused_sizes(spec: JobSpec, most: int = 64) -> list[tuple[int, str]]:
    """The node counts between ``cluster.minNodes`` (1 if unset) and ``cluster.maxNodes`` that the
    spec refuses (a resize to them is refused at the API server or by the operator), each with the
    first problem's field: ``[(size, field)]``. Empty without ``maxNodes`` or beyond ``most`` sizes."""
    from distflow.spec.loading import parse_spec

    cluster = spec.cluster
    if cluster.max_nodes is None or cluster.max_nodes - (cluster.min_nodes or 1) >= most:
        return []
    data = spec.model_dump(exclude_unset=True)  # the user's fields: a default dumped reads as set
    data.setdefault("cluster", {})
    refused = []
    for size in range(cluster.min_nodes or 1, cluster.max_nodes + 1):
        if size == cluster.num_nodes:
            continue
        data["cluster"]["numNodes"] = size
        try:
            parse_spec(data)
        except DistflowConfigError as err:
            refused.append((size, err.problems[0].split(":", 1)[0].removeprefix("spec.")))
    return refused


def ignored_async_warnings(spec) -> list[str]:
    """The ``async`` settings a job without ``async.enable`` ignores (it trains synchronously)."""
    section = spec.async_
    given = sorted(section.model_fields_set - {"enable"})
    if section.enable or not given:
        return []
    fields = ", ".join(f"async.{type(section).model_fields[name].alias or name}" for name in given)
    return [f"{fields}: ignored, as async.enable is false (the job trains synchronously); set async.enable: true "
            f"for two pools, or remove them"]


WORKER_WORKDIR = "/home/distflow"
"""The worker image's working directory (worker_image/Dockerfile): where a relative path in the pod lies."""
PER_POD_VOLUMES = ("emptyDir", "hostPath", "configMap", "secret", "downwardAPI", "projected", "ephemeral")
"""Volume types whose contents each pod has to itself (or cannot write): no place for shared checkpoints."""


def _mounted(template, directory: str) -> bool:
    """Whether ``directory`` (a path in the node container, relative to the worker image's working
    directory) is under a writable mount of storage the node pods share: one of ``template``'s
    PVCs, or a ``volumeMounts`` entry whose volume is not of a per-pod type (``PER_POD_VOLUMES``)."""
    import posixpath

    per_pod = {v.get("name") for v in template.volumes if isinstance(v, dict) and any(t in v for t in PER_POD_VOLUMES)}
    mounts = [pvc.mount_path for pvc in template.persistent_volume_claims if not pvc.read_only]
    mounts += [m["mountPath"] for m in template.volume_mounts
               if isinstance(m, dict) and isinstance(m.get("mountPath"), str) and not m.get("readOnly")
               and m.get("name") not in per_pod]
    path = posixpath.normpath(posixpath.join(WORKER_WORKDIR, directory.removeprefix("file://")))
    return any(path == posixpath.normpath(m) or path.startswith(posixpath.normpath(m).rstrip("/") + "/")
               for m in mounts if m)


def cmd_node(args) -> int:
    from distflow.launcher import job_name_for, launch_node

    spec, warnings = load_rendered_spec(args.config)
    for warning in warnings:
        print(f"distflow: warning: {warning}", file=sys.stderr)
    launch_node(spec, job_name_for(args.config), spec_dir=Path(args.config).parent)
    return EXIT_OK


def cmd_model(args) -> int:
    from distflow.models import model_cache_dir, resolve_model

    try:
        print(resolve_model(args.source, model_cache_dir()))
    except ValueError as err:  # an unknown source or a missing file: the message says which
        raise DistflowConfigError(f"model {args.source!r}: {err}") from None
    return EXIT_OK


COMMANDS = {"run": cmd_run, "plan": cmd_plan, "validate": cmd_validate, "node": cmd_node,
            "model": cmd_model}


def _termination_message(text: str) -> None:
    """Write why the node failed where the kubelet copies it into the container status.

    Only when DISTFLOW_TERMINATION_LOG names the file (the operator sets it to
    the container's terminationMessagePath), so local runs write nothing.
    """
    path = os.environ.get("DISTFLOW_TERMINATION_LOG")
    if path:
        try:
            with open(path, "w") as f:
                f.write(text[-4000:])
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    if not sys.stderr.isatty():
        # tqdm's bars (the model conversion's, transformers' loading) redraw with carriage returns:
        # noise in a log file or `kubectl logs`. Read when tqdm is imported, which happens later.
        os.environ.setdefault("TQDM_DISABLE", "1")
    args = _parser().parse_args(argv)
    in_pod = args.command == "node"
    try:
        return COMMANDS[args.command](args)
    except DistflowConfigError as err:
        print(f"distflow: {err}", file=sys.stderr)
        if in_pod:
            _termination_message(f"InvalidConfig: {err}")
        return EXIT_INVALID_CONFIG
    except UserFunctionError as err:
        print(f"distflow: {err}", file=sys.stderr)
        if in_pod:
            _termination_message(f"UserFunctionError: {err}")
        return EXIT_INVALID_CONFIG
    except StoppedForResize as err:
        print(f"distflow: {err}", file=sys.stderr)
        _termination_message(f"StoppedForResize: {err}")
        return EXIT_RESIZE
    except LeftPool as err:
        print(f"distflow: {err}", file=sys.stderr)
        _termination_message(f"LeftPool: {err}")
        return EXIT_LEFT_POOL
    except LaunchError as err:  # the message says what failed where; the driver's traceback adds nothing
        print(f"distflow: {err}", file=sys.stderr)
        if in_pod:
            _termination_message(f"Failed: {err}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_FAILED
    except Exception as err:
        if not in_pod:
            raise
        traceback.print_exc()
        _termination_message(f"{type(err).__name__}: {err}")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
