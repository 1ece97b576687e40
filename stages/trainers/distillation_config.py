"""`DistillationConfig`: on-policy distillation's settings, TRL 1.16's names, one declaration
(`stages.trainers.distillation_trainer`). `per_device_train_batch_size` counts prompts (one completion each).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.fields import check_fields, param, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.method_fields import SamplingFields
from stages.trainers.online_options import OnlineOptions
from stages.trainers.pipeline_section import TrainingStage, section, stage_default
from stages.trainers.tool_fields import ToolFields

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class DistillationConfig(MethodConfig, OnlineOptions, SamplingFields, ToolFields, TrainingArguments):
    """The student samples one completion per prompt; the loss is the divergence from the teacher at every
    completion position (`stages.losses.distillation_loss`)."""

    teacher_model_name_or_path: str | None = param(None, help="the teacher's folder or id, when the trainer is not "
                                                   "given teacher_model; it must share the student's tokenizer")
    teacher_model_revision: str | None = param(None, help="revision of the teacher (a hub branch, tag or commit)")
    teacher_model_init_kwargs: dict[str, Any] | None = param(None, help="keyword arguments of from_pretrained for "
                                                             "the teacher (dtype defaults to float32)")
    max_completion_length: int = positive(32, "generation budget per completion (tokens)")
    beta: float = param(1.0, help="the divergence: 1 reverse KL(student || teacher), 0 forward KL(teacher || "
                        "student), between: generalized JSD", check=lambda v: 0 <= v <= 1, rule="must be in [0, 1]")

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, DistillationConfig) + self.online_problems()


@section
class DistillationSection(TrainingStage, DistillationConfig):
    """Section `policy.distillation`: stages.trainers.distillation_config.DistillationConfig plus the pipeline's
    keys, and the pipeline's defaults where they differ from the config's (DistillationSection there, each with why)."""

    learning_rate: float = stage_default(1e-3, "from benchmarks/distillation.py, not tuned on the dev split")
    max_steps: int = stage_default(150, "GRPO's budget")
