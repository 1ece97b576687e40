"""Off-policy correction shared by the online trainers that sample with a separate sampler (GRPO, PPO).

When completions come from weights other than the policy's (a vLLM server that is not synced, a
stale buffer), the sampler's own per-token log-probs (`Generations.logprobs`) come back with them,
and each token's policy-gradient term is weighted by the truncated importance ratio
min(π/μ, `vllm_importance_sampling_cap`) (`stages.losses.truncated_importance_weights`). The
two settings are declared once in `stages.trainers.method_fields`; the warning is
`OffPolicyWarning.warn_off_policy`, once per run.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class OffPolicyWarning:
    """Mixin for a Trainer whose args carry `vllm_importance_sampling_cap`, `tis_warn` and `sampling`:
    `warn_off_policy(logs)` warns once per run, by name, when the logged `tis/mean_ratio` departs from 1 by more
    than `tis_warn`."""

    _tis_warned = False
    args: Any  # the Trainer's
    state: Any

    def warn_off_policy(self, logs: dict[str, float]) -> None:
        ratio, a = logs.get("tis/mean_ratio"), self.args
        if self._tis_warned or ratio is None or not abs(ratio - 1) > a.tis_warn:
            return
        self._tis_warned = True
        method = type(self).__name__.removesuffix("Trainer")
        server = ", whose weights are not synced from the trainer" if a.sampling.backend == "vllm" else ""
        cap = a.vllm_importance_sampling_cap
        fix = (f"the vllm_importance_sampling_cap = {cap} correction is applied" if cap is not None else
               "vllm_importance_sampling_cap is null, so the gradient is NOT corrected: set it (2.0)")
        logger.warning("%s off-policy: tis/mean_ratio = %.3f at step %d departs from 1 by more than tis_warn = %s "
                       "(tis/frac_capped = %.3f): the sampler (backend %s%s) does not sample the policy's "
                       "distribution; %s. Sync the sampler's weights, and check that its log-probs are those it "
                       "samples from (vLLM: --logprobs-mode processed_logprobs; top_p / top_k truncate)",
                       method, ratio, self.state.global_step, a.tis_warn, logs.get("tis/frac_capped", 0.0),
                       a.sampling.backend, server, fix)
