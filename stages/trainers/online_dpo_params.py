"""Online DPO's settings: `policy.online_dpo` in params.yaml and the method fields of `OnlineDPOConfig`.

See `stages.trainers.dpo_params` for how the params section and the trainer config share them.
"""
from __future__ import annotations

from dataclasses import dataclass

from stages.fields import check_fields, param, positive
from stages.trainers.dpo_params import beta_field, check_objectives
from stages.trainers.generation_params import GenerationParams


@dataclass
class OnlineDPOParams:
    beta: float = beta_field()
    loss_type: str | list[str] = param("sigmoid", help="DPO variant (stages.losses.DPO_LOSSES), sft, a "
                                       "module:function objective, or a list of them combined with loss_weights")
    loss_weights: list[float] | None = param(None, help="weights of the loss_type list (null: all 1.0)")
    generation: GenerationParams = param(default_factory=GenerationParams, help="sampling of the two completions")
    reward_weights: list[float] | None = param(None, help="one weight per reward function (null: all 1.0)")
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")
    use_chunked_logprobs: bool = param(True, help="log-probs from the final hidden states in chunks, without the "
                                       "full logits, where the model allows")

    @property
    def objective_names(self) -> list[str]:
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, OnlineDPOParams) + check_objectives(self.objective_names, self.loss_weights)
