"""GRPO kernels: group advantages, the clipped policy loss, per-token logprobs."""
from muajax.rl.advantages import ADVANTAGE_SCALES, group_advantages
from muajax.rl.logprobs import logprobs_and_entropy, token_entropy, token_logprobs
from muajax.rl.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    METRIC_SUM_KEYS,
    RATIO_LEVELS,
    finalize_policy_metrics,
    kl_estimate,
    policy_loss,
    policy_loss_terms,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "METRIC_SUM_KEYS",
    "RATIO_LEVELS",
    "finalize_policy_metrics",
    "group_advantages",
    "kl_estimate",
    "logprobs_and_entropy",
    "policy_loss",
    "policy_loss_terms",
    "token_entropy",
    "token_logprobs",
]
