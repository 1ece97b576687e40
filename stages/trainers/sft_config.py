"""`SFTConfig`: supervised fine-tuning's settings, TRL's names, one declaration (`stages.trainers.sft_trainer`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

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
from stages.trainers.pipeline_section import TrainingStage, section, stage_default
from stages.trainers.trl_compat import TRL_VERSION

TrainingArguments = training_arguments()

DATASET_KWARGS = ("skip_prepare_dataset",)  # the keys of SFTConfig.dataset_kwargs (TRL 1.16's)


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
    dataset_kwargs: dict[str, bool] | None = param(
        None, help="options of dataset preparation (TRL's); the one key is skip_prepare_dataset: true uses the rows "
        "as given: they hold input_ids, and optionally completion_mask / assistant_masks / labels (-100 where no "
        "loss); no tokenising, shuffling or packing", check=lambda v: isinstance(v, dict),
        rule="must be a mapping, e.g. {skip_prepare_dataset: true}")
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

    @property
    def skip_prepare_dataset(self) -> bool:
        """dataset_kwargs' skip_prepare_dataset: the rows are used as given (already tokenised)."""
        return bool((self.dataset_kwargs or {}).get("skip_prepare_dataset", False))

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, SFTConfig) + dataset_kwargs_problems(self.dataset_kwargs)


def dataset_kwargs_problems(value: Any) -> list[tuple[str, str]]:
    """Unknown keys of SFTConfig.dataset_kwargs, or a skip_prepare_dataset that is not a bool."""
    if not isinstance(value, dict):
        return []  # check_fields reports it
    problems = []
    unknown = sorted(set(value) - set(DATASET_KWARGS))
    if unknown:
        problems.append(("dataset_kwargs", f"= {value!r}: unknown key(s) {unknown} in SFTConfig.dataset_kwargs; "
                         f"TRL {TRL_VERSION}'s only key is skip_prepare_dataset (true: the rows already hold "
                         "input_ids and are used as given); remove the others"))
    skip = value.get("skip_prepare_dataset", False)
    if not isinstance(skip, bool):
        problems.append(("dataset_kwargs", f"= {value!r}: SFTConfig.dataset_kwargs.skip_prepare_dataset must be "
                         "true or false"))
    return problems

@dataclass
class SFTStage:
    """The keys of section `sft` beyond SFTConfig's."""

    if TYPE_CHECKING:  # declared by SFTConfig, which this mixin comes before in SFTSection
        max_steps: int
        packing: bool

    formatting_func: str | None = param(None, help="module:function turning a row into a training text")
    streaming: bool = param(False, help="stream the training rows instead of loading them (needs max_steps > 0)")
    eval_samples: int = positive(32, "validation prompts of the online evaluation (eval_steps)")

    def validate(self) -> list[tuple[str, str]]:
        problems = super().validate()
        if self.streaming and self.max_steps <= 0:
            problems.append(("max_steps", f"= {self.max_steps}: streaming has no length; set sft.max_steps > 0"))
        if self.streaming and self.packing:
            problems.append(("packing", "= true: packing needs the whole dataset; turn off sft.streaming or packing"))
        if self.formatting_func is not None and ":" not in self.formatting_func:
            problems.append(("formatting_func", f"= {self.formatting_func!r}: expected module:function"))
        return problems


@section
class SFTSection(SFTStage, TrainingStage, SFTConfig):
    """Section `sft`: stages.trainers.sft_config.SFTConfig plus the pipeline's keys, and the
    pipeline's defaults where they differ from the config's (SFTSection there, each with why)."""

    learning_rate: float = stage_default(3e-3, "the built-in 1M-parameter model learns at this rate (docs/methods.md); "
                                               "set yours for a real model")
    num_train_epochs: float = stage_default(3.0, "SFTConfig's own (the sections share 1.0); 2 left one seed unable "
                                                 "to add after a written carry (docs/methods.md)")
