"""Errors a user can cause. No torch import here."""

from __future__ import annotations


class DistflowConfigError(ValueError):
    """A job spec or local run config that can never work.

    Raised before any worker starts. The message names each offending field by
    its path (``spec.data.trainBatchSize``) and says how to fix it.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid job spec:\n" + "\n".join(f"  - {p}" for p in self.problems))


class LaunchError(RuntimeError):
    """A launcher could not run the job to the end: a cluster it cannot reach, resources it
    cannot get in time, or a worker lost or failed. The message says which and why."""


class UserFunctionError(RuntimeError):
    """A user's function (``data.rewardFn``, a custom workflow node's ``function``) raised while
    the job ran. The message names the function, the sample or node and the step. Retrying
    cannot help (the same input raises again): the job fails with it, like an invalid config,
    and the last complete checkpoint is left as it was."""
