"""RL post-training algorithms as pure tensor functions (verl ``core_algos.py`` semantics).

One dict per family maps a name to a function with one signature; an
unknown name is a ValueError listing the choices:

    ADVANTAGES      (AdvantageInputs, AdvantageParams, reducer) -> (advantages, returns)
    POLICY_LOSSES   (old_log_probs, log_probs, advantages, response_mask, PolicyLossParams) -> PolicyLossOutput
    KL_ESTIMATORS   (log_probs, ref_log_probs) -> kl [B, T]
    LOSS_AGG_MODES  names accepted by aggregate_loss

Per-token losses are reduced with ``aggregate_loss`` against the sizes of
the whole global batch, so micro-batches on all dp ranks add up exactly.
Importing this package imports torch; ``import distflow`` does not import it.
"""

from distflow.algorithms.advantages import (
    ADVANTAGES,
    AdvantageFn,
    AdvantageInputs,
    AdvantageParams,
    get_advantage_fn,
)
from distflow.algorithms.aggregation import (
    LOSS_AGG_MODES,
    LossNormalizer,
    Reducer,
    aggregate_loss,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
)
from distflow.algorithms.dynamic_sampling import groups_with_signal, plan_group_selection
from distflow.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    apply_kl_penalty,
    get_kl_estimator,
)
from distflow.algorithms.logits import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits
from distflow.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossFn,
    PolicyLossOutput,
    PolicyLossParams,
    get_policy_loss_fn,
)
from distflow.algorithms.reward_shaping import overlong_penalty
from distflow.algorithms.value_loss import clipped_value_loss, explained_variance

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageFn",
    "AdvantageInputs",
    "AdvantageParams",
    "FixedKLController",
    "KLEstimator",
    "LossNormalizer",
    "PolicyLossFn",
    "PolicyLossOutput",
    "PolicyLossParams",
    "Reducer",
    "aggregate_loss",
    "apply_kl_penalty",
    "clipped_value_loss",
    "entropy_from_logits",
    "explained_variance",
    "get_advantage_fn",
    "get_kl_estimator",
    "get_policy_loss_fn",
    "groups_with_signal",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "plan_group_selection",
]
