"""DPO's settings: `policy.dpo` in params.yaml and the method fields of `DPOConfig`, declared once.

`DPOConfig` (stages.trainers.dpo) is this class combined with `transformers.TrainingArguments`;
the pipeline's `policy.dpo` section is this class plus the per-method training overrides.
Both run `validate()`, so a value is checked the same way from params.yaml and from Python.
No torch here: params validation stays fast. The objectives named in `loss_type` are imported
(and so checked to exist) when the trainer config is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from stages.fields import check_fields, param, positive



def beta_field() -> Any:
    """`beta` of DPO, KTO and online DPO, declared once."""
    return positive(0.3, "KL strength to the reference; 0.3 chosen on dev for the built-in task "
                    "(benchmarks/RESULTS-alignment-sweep-1.md; TRL's default: 0.1)")


@dataclass
class DPOParams:
    beta: float = beta_field()
    loss_type: str | list[str] = param("sigmoid", help="DPO variant (stages.losses.DPO_LOSSES), sft, a "
                                       "module:function objective, or a list of them combined with loss_weights")
    loss_weights: list[float] | None = param(None, help="weights of the loss_type list (null: all 1.0)")
    label_smoothing: float = param(0.0, help="conservative DPO / robust noise rate", check=lambda v: 0 <= v < 0.5,
                                   rule="must be in [0, 0.5)")
    reference_free: bool = param(False, help="no reference model (its log-probs taken as 0)")
    precompute_ref_log_probs: bool = param(True, help="compute the reference log-probs once before training "
                                           "(the pipeline: in stage `reference`, cached, so a rerun with another "
                                           "beta or loss_type skips them); ignored with reference_free")
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")
    task_weights: dict[str, float] | None = param(None, help="loss scale per value of the rows' `task` column "
                                                  "(multi-task mixtures; tasks not listed: 1.0)")
    balance_column: str | None = param(None, help="draw batches balanced over this column (task, source, prompt)")
    use_chunked_logprobs: bool = param(True, help="log-probs from the final hidden states in chunks, without the "
                                       "full logits, where the model allows")

    @property
    def objective_names(self) -> list[str]:
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    def validate(self) -> list[tuple[str, str]]:
        problems = check_fields(self, DPOParams) + check_objectives(self.objective_names, self.loss_weights)
        bad = {k: v for k, v in (self.task_weights or {}).items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            problems.append(("task_weights", f"= {self.task_weights}: {bad} must be finite numbers >= 0"))
        return problems


def check_objectives(names: list[str], weights: list[float] | None) -> list[tuple[str, str]]:
    """The rules of a `loss_type` list and its `loss_weights`, shared by DPO and online DPO."""
    problems = []
    if not names:
        problems.append(("loss_type", "= []: name at least one loss"))
    if weights is not None:
        if len(weights) != len(names):
            problems.append(("loss_weights", f"= {weights}: {len(weights)} weight(s) for {len(names)} loss "
                             "type(s); give one per entry or null for all 1.0"))
        if any(not (math.isfinite(w) and w >= 0) for w in weights):
            problems.append(("loss_weights", f"= {weights}: each must be a finite number >= 0"))
    return problems
