"""Pre-flight: what can be checked of a job before any worker starts.

``distflow validate`` runs it, and so does every launcher (local, env, ray)
before it starts a worker: the plan, the model source, the data files (they
exist, and their first record reads as a prompt), and the user's functions
(the reward function, custom workflow nodes' functions and the multi-turn
tools and environment are imported). Once the model is on disk,
:func:`prompt_length_problems` renders the first prompt of each dataset with
its tokenizer and checks it against ``data.maxPromptLength``.
Each problem is a :class:`DistflowConfigError` naming the field and the fix.
"""

from __future__ import annotations

from pathlib import Path

from distflow.errors import DistflowConfigError
from distflow.spec import JobSpec

BUILTIN_TASKS = ("arithmetic",)


def preflight(spec: JobSpec) -> None:
    """Check the plan, the model source, the data files and the user functions of ``spec``.

    Raises:
        DistflowConfigError: an invalid workflow, a model source no worker could load, a data file
            that is missing, has an unknown extension, is empty, or whose first record does not read
            as a prompt, or a reward / custom node function that cannot be imported.
    """
    from distflow.models import model_source_problem
    from distflow.planner import build_plan

    build_plan(spec)
    if problem := model_source_problem(spec.model.path):
        raise DistflowConfigError(f"spec.{problem}")
    if problems := list(data_problems(spec)) + list(function_problems(spec)):
        raise DistflowConfigError(problems)


def data_problems(spec: JobSpec):
    """``spec.data.<train|eval>.path: ...`` for each data file that no worker could read, and
    ``spec.data.train: ...`` when the training prompts (a file's records, capped at
    ``data.train.size``, or the built-in task's ``size``) are fewer than one batch."""
    from distflow.data.sources import dataset_source

    for name, ds in (("train", spec.data.train), ("eval", spec.data.eval)):
        if ds is None:
            continue
        problems = list(_file_problems(name, ds))
        yield from problems
        if name == "train" and not problems:
            count, batch = dataset_source(ds).num_records, spec.data.train_batch_size
            if count < batch:
                more = ("raise data.train.size" if ds.arithmetic_split is not None or ds.size is not None
                        else "give a file with more records")
                yield (f"spec.data.train: {count} prompts, fewer than one batch (data.trainBatchSize={batch}); "
                       f"lower data.trainBatchSize to at most {count} or {more}")


def _file_problems(name: str, ds):
    """Why ``data.<name>.path`` (a file; a built-in task has none) cannot be read."""
    from distflow.data.sources import DATA_SUFFIXES, data_file_problem

    if ds.arithmetic_split is None:
        field = f"spec.data.{name}.path"
        if Path(ds.path).is_dir():
            yield (f"{field}: {ds.path!r} is a directory; give one .jsonl or .parquet file in it "
                   f"(e.g. --set data.{name}.path={Path(ds.path) / 'train.jsonl'})")
        elif not Path(ds.path).is_file():
            yield (f"{field}: no such file {ds.path!r}; give an existing .jsonl or .parquet file "
                   f"(e.g. --set data.{name}.path=PATH) or a built-in task: {', '.join(BUILTIN_TASKS)}")
        elif Path(ds.path).suffix.lower() not in DATA_SUFFIXES:
            yield (f"{field}: {ds.path!r} is not a .jsonl, .json or .parquet file; "
                   "convert it (one JSON object per line, or parquet)")
        elif problem := data_file_problem(ds.path):
            yield f"{field}: {ds.path!r} {problem}"


def function_problems(spec: JobSpec):
    """``spec.data.rewardFn`` / ``spec.workflow.nodes[i].function`` / ``spec.rollout.multiTurn``'s
    tools and environment: each user function that
    does not import (imported here, so a typo fails now rather than in every worker)."""
    from distflow.multiturn.loading import multi_turn_problems
    from distflow.rewards import load_reward_fn
    from distflow.user_functions import load_user_function

    if spec.data.reward_fn is not None:
        try:
            load_reward_fn(spec.data.reward_fn)
        except ValueError as err:
            yield f"spec.data.rewardFn: {err}"
    for i, node in enumerate(spec.workflow.nodes or ()):
        if node.role == "custom" and node.function:
            try:
                load_user_function(node.function, f"workflow node {node.id!r} function")
            except ValueError as err:
                yield f"spec.workflow.nodes[{i}].function: {err}"
    yield from multi_turn_problems(spec.rollout.multi_turn)


def prompt_length_problems(spec: JobSpec, model_dir: str | Path):
    """``spec.data.maxPromptLength: ...`` when it is too short for the data, judged from each
    dataset's first record rendered as the rollout renders it: the model's chat template, with
    ``data.systemPrompt`` and the tools of ``rollout.multiTurn`` when set.

    Two cases fail before any worker starts: the template alone (an empty user message) takes
    ``maxPromptLength`` tokens or more, so no prompt can fit whatever ``data.truncation`` says;
    or ``data.truncation: error`` and the first record is longer (the workers would scan every
    prompt and stop on the same error minutes later). With ``filter`` or ``left`` an over-long
    first record is not an error: the workers drop or cut such prompts and say how many.
    """
    from distflow.data.records import PromptRecord
    from distflow.data.sources import dataset_source
    from distflow.models import load_tokenizer
    from distflow.stages.rollout import prompt_length

    data = spec.data
    length_of = prompt_length(load_tokenizer(model_dir), spec)
    blank = PromptRecord(uid="blank", messages=({"role": "user", "content": ""},), ground_truth="", data_source="")
    empty = length_of(blank)
    if empty >= data.max_prompt_length:
        extras = [name for name, on in (("data.systemPrompt", data.system_prompt),
                                        ("the tools of rollout.multiTurn", spec.rollout.multi_turn.enable)) if on]
        yield (f"spec.data.maxPromptLength: {data.max_prompt_length} tokens, but the chat template "
               f"{'and ' + ' and '.join(extras) + ' alone take' if extras else 'alone takes'} {empty} tokens, so no prompt "
               f"fits; raise data.maxPromptLength above {empty} plus the length of a question")
        return
    if data.truncation != "error":
        return
    for name, ds in (("train", data.train), ("eval", data.eval)):
        if ds is None:
            continue
        source = dataset_source(ds)
        if source.num_records == 0:
            continue
        length = length_of(source.read([0])[0])
        if length > data.max_prompt_length:
            yield (f"spec.data.maxPromptLength: {data.max_prompt_length} tokens, but the first prompt of "
                   f"data.{name} renders to {length} tokens (chat template included) and data.truncation is "
                   f"error; raise data.maxPromptLength to at least {length}, or set data.truncation: filter "
                   "(drop over-long prompts) or left (keep their last tokens)")


def check_prompt_lengths(spec: JobSpec, model_dir: str | Path) -> None:
    """:func:`prompt_length_problems`, raised.

    Raises:
        DistflowConfigError: listing each problem.
    """
    if problems := list(prompt_length_problems(spec, model_dir)):
        raise DistflowConfigError(problems)
