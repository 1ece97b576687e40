"""`SFTConfig`: supervised fine-tuning's settings, TRL's names, one declaration (`stages.trainers.sft_trainer`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stages.fields import WARMUP_RATIO, check_fields, deprecated, param, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import (
    TokenizerFields,
    activation_offloading_field,
    num_proc_field,
    pad_to_multiple_of_field,
    router_aux_loss_coef_field,
    truncation_mode_field,
)

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class SFTConfig(MethodConfig, TokenizerFields, TrainingArguments):
    """TrainingArguments plus SFT's settings. `warmup_steps` defaults to a 0.05 share of the steps instead of
    0: AdamW started at the peak rate leaves the tiny model on the loss plateau (docs/decisions.md)."""

    max_length: int = positive(512, "truncate tokenised rows to this many tokens")
    truncation_mode: Literal["keep_start"] = truncation_mode_field()
    shuffle_dataset: bool = param(False, help="shuffle the prepared training rows (before packing) with the seed, "
                                  "besides the sampler's shuffling of every epoch")
    completion_only_loss: bool | None = param(True, help="loss on completion tokens only (prompt tokens masked); "
                                              "null as in TRL: the same (rows without a prompt are all completion)")
    assistant_only_loss: bool = param(False, help="loss on the assistant turns of conversations only (with "
                                      "completion_only_loss, those of the completion), from the template's "
                                      "{% generation %} markers or the turns' positions")
    dataset_text_field: str = param("text", help="column holding raw text in text-only rows")
    dataset_num_proc: int | None = num_proc_field()
    packing: bool = param(False, help="pack rows into max_length sequences, padding-free")
    padding_free: bool = param(False, help="join each batch's rows into one row without padding (sequences kept "
                               "apart by position_ids); on by itself with packing and flash attention")
    pad_to_multiple_of: int | str | None = pad_to_multiple_of_field()
    loss_type: Literal["nll", "dft"] = param("nll", help="nll: token negative log-likelihood; dft: each token's "
                                             "loss weighted by its probability (Dynamic Fine-Tuning, "
                                             "arXiv:2508.05629)")
    packing_strategy: Literal["bfd", "wrapped"] = param("bfd", help="bfd: best-fit decreasing; wrapped: cut")
    eval_packing: bool | None = param(None, help="pack the evaluation rows too (null: as packing)")
    activation_offloading: bool = activation_offloading_field()
    router_aux_loss_coef: float | None = router_aux_loss_coef_field()
    use_chunked_logprobs: bool = param(True, help="loss from the final hidden states through the chunked lm-head "
                                       "kernel (no full logits) where the model allows")
    warmup_steps: float = param(WARMUP_RATIO, help="linear warm-up: steps (>= 1) or a share of all steps (< 1)",
                                check=lambda v: v >= 0, rule="must be >= 0")
    max_seq_length: int | None = deprecated("max_length", "the old name of max_length")

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, SFTConfig)
