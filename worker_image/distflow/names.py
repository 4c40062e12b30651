"""The names a job spec may use, defined once for both sides.

The spec checks a config against these before any worker starts (and the CRD
lists them as enums); the runtime's registries (``distflow.algorithms``,
``distflow.rewards``) are keyed by them and fail at import if a name has no
function or a function no name (:func:`registry`).
Imports nothing, so the spec and the operator stay free of torch.
"""

from typing import TypeVar

F = TypeVar("F")

ADVANTAGE_ESTIMATORS = (
    "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae",
)
GROUP_ESTIMATORS = frozenset({"grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"})
"""Estimators whose baseline is the other responses to the same prompt (need rollout.n >= 2)."""
POLICY_LOSSES = ("vanilla", "gspo")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
BUILTIN_REWARDS = ("gsm8k", "gsm8k_flexible", "math", "arithmetic", "arithmetic_concise")
"""Reward functions by name (`distflow.rewards.REWARD_FNS`); anything else must be `module:function`."""
TINY_TOKENIZERS = ("auto", "byte", "smollm2")
"""Tokenizers of the tiny random test model `tiny:<tokenizer>` (`tiny` alone: auto)."""
ARITHMETIC_SPLITS = ("train", "eval")
"""Splits of the built-in arithmetic task (`arithmetic:train`, `arithmetic:eval`)."""
BUILTIN_WORKFLOWS = ("grpo", "ppo", "dapo")
NODE_ROLES = ("rollout", "reward", "reference", "old_log_prob", "advantage", "actor", "critic",
              "values", "custom", "reward_shaping", "filter_groups")
NODE_KINDS = ("inference", "train", "compute")


def registry(names: tuple[str, ...], table: dict[str, F], family: str) -> dict[str, F]:
    """``table``, checked at import to map exactly the ``names`` the spec accepts.

    Raises:
        ImportError: a name without a function, or a function under a name the spec rejects.
    """
    if set(table) != set(names):
        raise ImportError(f"{family}: the registry maps {sorted(table)} but distflow.names declares "
                          f"{sorted(names)}; add the name there or the function here")
    return dict(table)
