"""SFT's settings: the method fields of `SFTConfig` and of params.yaml's `sft` section, declared once.

`SFTConfig` (stages.trainers.sft) is this class combined with `transformers.TrainingArguments`;
the `sft` section is this class plus the shared training settings and what only the pipeline
has (streaming, a formatting function by import path, online evaluation, ...). The choices of
`packing_strategy` are the keys of `stages.data.packing.PACKING_STRATEGIES` (a test keeps them
equal; this module imports no torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stages.fields import check_fields, param, positive


@dataclass
class SFTParams:
    max_seq_length: int = positive(512, "truncate tokenised rows to this many tokens")
    completion_only_loss: bool = param(True, help="loss on completion tokens only (prompt tokens masked)")
    assistant_only_loss: bool = param(False, help="loss on every assistant turn of multi-turn conversations only "
                                      "(needs {% generation %} markers in the chat template)")
    dataset_text_field: str = param("text", help="column holding raw text in text-only rows")
    packing: bool = param(False, help="pack rows into max_seq_length sequences, padding-free")
    packing_strategy: Literal["bfd", "wrapped"] = param("bfd", help="bfd: best-fit decreasing; wrapped: cut")
    use_chunked_logprobs: bool = param(True, help="loss from the final hidden states through the chunked lm-head "
                                       "kernel (no full logits) where the model allows")

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, SFTParams)
