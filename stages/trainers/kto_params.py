"""KTO's settings: `policy.kto` in params.yaml and the method fields of `KTOConfig`, declared once.

See `stages.trainers.dpo_params` for how the params section and the trainer config share them.
"""
from __future__ import annotations

from dataclasses import dataclass

from stages.fields import check_fields, param, positive
from stages.trainers.dpo_params import beta_field


@dataclass
class KTOParams:
    beta: float = beta_field()
    desirable_weight: float = positive(1.0, "loss weight of desirable rows")
    undesirable_weight: float = positive(1.0, "loss weight of undesirable rows")
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")
    use_chunked_logprobs: bool = param(True, help="log-probs from the final hidden states in chunks, without the "
                                       "full logits, where the model allows")

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, KTOParams)
