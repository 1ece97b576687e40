"""Off-policy correction shared by the online trainers that sample with a separate sampler (GRPO, PPO).

When completions come from weights other than the policy's (a vLLM server that is not synced, a
stale buffer), the sampler's own per-token log-probs (`Generations.logprobs`) come back with them,
and each token's policy-gradient term is weighted by the truncated importance ratio
min(π/μ, `tis_cap`) (`stages.losses.truncated_importance_weights`). The two params are declared
here once (`tis_cap_field`, `tis_warn_field`) and used by each method's params dataclass; the
warning is `OffPolicyWarning.warn_off_policy`, once per run. No torch is imported here.
"""
from __future__ import annotations

import logging
from typing import Any

from stages.fields import param, positive

logger = logging.getLogger(__name__)


def tis_cap_field() -> Any:
    return param(2.0, help="off-policy correction: each token's policy-gradient term is weighted min(pi/mu, tis_cap), "
                 "pi the policy at sampling time, mu the sampler's own log-prob (truncated importance sampling; 2.0 "
                 "as in the literature); null: no correction", check=lambda v: v >= 1,
                 rule="must be >= 1 (a cap below 1 would down-weight on-policy tokens, whose ratio is 1), or null to "
                 "turn the correction off")


def tis_warn_field() -> Any:
    return positive(0.1, "warn when the logged tis/mean_ratio departs from 1 by more than this: on policy it is 1 to "
                    "float rounding, and E_mu[pi/mu] = 1 for any sampler covering the policy's support, so a larger "
                    "departure means the sampler truncates the distribution (top-p/top-k, raw instead of processed "
                    "log-probs) or the ratios are so heavy-tailed that the capped gradient is biased")


class OffPolicyWarning:
    """Mixin for a Trainer whose args carry `tis_cap`, `tis_warn` and `generation`: `warn_off_policy(logs)`
    warns once per run, by name, when the logged `tis/mean_ratio` departs from 1 by more than `tis_warn`."""

    _tis_warned = False

    def warn_off_policy(self, logs: dict[str, float]) -> None:
        ratio, a = logs.get("tis/mean_ratio"), self.args
        if self._tis_warned or ratio is None or not abs(ratio - 1) > a.tis_warn:
            return
        self._tis_warned = True
        method = type(self).__name__.removesuffix("Trainer")
        server = ", whose weights are not synced from the trainer" if a.generation.backend == "vllm" else ""
        fix = (f"the tis_cap = {a.tis_cap} correction is applied" if a.tis_cap is not None else
               "tis_cap is null, so the gradient is NOT corrected: set tis_cap (2.0)")
        logger.warning("%s off-policy: tis/mean_ratio = %.3f at step %d departs from 1 by more than tis_warn = %s "
                       "(tis/frac_capped = %.3f): the sampler (backend %s%s) does not sample the policy's "
                       "distribution; %s. Sync the sampler's weights, and check that its log-probs are those it "
                       "samples from (vLLM: --logprobs-mode processed_logprobs; top_p / top_k truncate)",
                       method, ratio, self.state.global_step, a.tis_warn, logs.get("tis/frac_capped", 0.0),
                       a.generation.backend, server, fix)
