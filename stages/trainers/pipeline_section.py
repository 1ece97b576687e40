"""A method's params section (`sft`, `reward`, `policy.<method>`): its trainer config as the pipeline runs it.

Each `stages/trainers/<method>_config.py` declares, below its config, the section explicitly:

    @section
    class DPOSection(TrainingStage, DPOConfig):
        learning_rate: float = stage_default(5e-5, "why the pipeline starts elsewhere than DPOConfig")

So the section is the config (every field and default as the Python API has them), the pipeline's own keys
(`TrainingStage`: mixed precision, LoRA, ...; `RewardKeys` for the methods that score samples; `ToolKeys` for
those that run tools), and, written once beside the key with the reason, each default where the pipeline starts
from another value than the Python API: `STAGE_DEFAULTS` for every section, the section's own `stage_default`
fields for one method. A section declares
no key of its own: `section` refuses one that neither its config nor the pipeline's keys declare.

Torch-free: params validation reads the sections from the config modules executed on the light TrainingArguments
(`stages.trainers.arguments` says why).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, dataclass_transform

from stages.fields import WARMUP_RATIO, deprecated, fraction, param, positive
from stages.reward_function_names import REWARD_BUILTINS, VERIFIED_FIRST
from stages.trainers.arguments import MethodConfig, as_declared

# The defaults every section starts from where they differ from TrainingArguments' (the Python API's), each with
# its reason: key -> (value, why).
STAGE_DEFAULTS: dict[str, tuple[Any, str]] = {
    "lr_scheduler_type": ("cosine", "decays to 0 over the run (TrainingArguments: linear)"),
    "warmup_steps": (WARMUP_RATIO, "a share of the steps (docs/decisions.md: the high-lr recipes reach their "
                     "ceiling more often with it)"),
    "save_steps": (200, "checkpoints often enough to resume a crashed stage without losing much"),
    "save_total_limit": (2, "keeps the disk bounded; a resumed stage needs the last checkpoint only"),
    "logging_steps": (20, "short runs log enough points for their curves"),
    "report_to": (None, "null: run.report_to, the run's trackers (stages/trackers.py)"),
    "per_device_train_batch_size": (32, "the built-in task's rows are short; 32 fills a step on CPU"),
    "per_device_eval_batch_size": (64, "evaluation keeps no activations for a backward"),
    "num_train_epochs": (1.0, "one pass; sft and reward set their own"),
}
# What a key means in a section where the pipeline reads it differently from transformers.
STAGE_HELP = {"report_to": "trackers of this stage: tensorboard, mlflow, dvclive, wandb, trackio, comet_ml, clearml, "
                           "none, or a list (null: run.report_to)"}


def stage_default(value: Any, why: str) -> Any:
    """The pipeline's default of a key its config (or TrainingArguments, or the pipeline's keys) declares, where
    it differs from the Python API's; `why` says why (it goes into the field's metadata)."""
    return dataclasses.field(default=value, metadata={"stage_default": why})


@dataclass
class LoraParams:
    """LoRA / QLoRA adapters for a training stage (off by default: full fine-tuning)."""

    enabled: bool = param(False, help="train LoRA adapters instead of all weights")
    r: int = positive(16, "adapter rank")
    alpha: float = positive(32, "scaling numerator (scale = alpha / r)")
    dropout: float = fraction(0.05, "dropout on the adapter input")
    target_modules: list[str] = param(default_factory=lambda: ["all-linear"],
                                      help="module names to adapt (e.g. q_proj, v_proj), or all-linear")
    modules_to_save: list[str] = param(default_factory=list, help="modules trained in full and saved with the "
                                       "adapter (e.g. embed_tokens, lm_head)")
    quantization: Literal["none", "4bit", "8bit"] = param("none", help="QLoRA: load the base in 4 or 8 bits "
                                                          "(bitsandbytes, CUDA only)")

    def validate(self) -> list[tuple[str, str]]:
        if self.quantization != "none" and not self.enabled:
            return [("quantization", f"= {self.quantization!r} with lora.enabled = false: a quantized base trains "
                     "only through adapters (QLoRA); set lora.enabled: true, or quantization: none")]
        return []


@dataclass
class TrainingStage:
    """The keys every training section adds to its method config: how the pipeline loads and runs the model.

    The trainer config (`stages/trainers/<method>_config.py`) is the rest of the section: every
    `TrainingArguments` key and the method's own. The pipeline sets a few `TrainingArguments` keys itself
    (`stages.harness.config.PIPELINE_KEYS`: the seed, the output folder, the device, the autocast)."""

    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = param(
        "auto", help="autocast of the forward, fp32 master weights: auto (bf16 on GPUs that have it, no on CPU) | "
        "no | bf16 (GPU or CPU) | fp16 (GPU only)")
    gradient_checkpointing_every: int = positive(1, "with gradient_checkpointing: every k-th decoder block only")
    lora: LoraParams = param(default_factory=LoraParams, help="LoRA / QLoRA adapters")
    warmup_ratio: float | None = deprecated("warmup_steps", "the old name of warmup_steps (a share of the steps "
                                            "when < 1)")


def check_reward_functions(names: list[str], weights: list[float] | None) -> list[tuple[str, str]]:
    """Config-time checks of a reward_functions / reward_weights pair (imports happen in the stage)."""
    problems = []
    if not names:
        problems.append(("reward_functions", "= []: name at least one (" + ", ".join(REWARD_BUILTINS)
                         + ", or a dotted path module:function)"))
    for i, name in enumerate(names):
        if name not in REWARD_BUILTINS and (":" not in name or not all(name.partition(":")[::2])):
            problems.append((f"reward_functions[{i}]", f"= {name!r}: neither a built-in ("
                             f"{', '.join(REWARD_BUILTINS)}) nor a dotted path module:function"))
    if weights is not None and len(weights) != len(names):
        problems.append(("reward_weights", f"= {weights}: {len(weights)} weight(s) for {len(names)} reward "
                         "function(s); give one weight per function or null for all 1.0"))
    return problems


@dataclass
class RewardKeys:
    """The reward functions a method that samples builds by name (the trainer's reward_funcs; their weights: the
    config's reward_weights). Default: the verifiable reward decides, the reward model breaks ties."""

    if TYPE_CHECKING:  # declared by the config this mixin comes before
        reward_weights: list[float] | None

    reward_functions: list[str] = param(default_factory=lambda: list(VERIFIED_FIRST), help=(
        "reward functions: built-ins (" + ", ".join(REWARD_BUILTINS) + ") or module:function dotted paths (the "
        "trainer's reward_funcs)"))

    def validate(self) -> list[tuple[str, str]]:
        return super().validate() + check_reward_functions(  # type: ignore[misc]
            self.reward_functions, self.reward_weights)


@dataclass
class ToolKeys:
    """The tools a method that runs multi-turn episodes imports by path (the trainer's `tools=`; how they run: the
    config's max_tool_calling_iterations, tool_timeout, tool_mode). Each path is resolved when params are
    validated, so a bad one stops the run before any stage."""

    tools: list[str] = param(default_factory=list, help=(
        "tools the model may call while it samples: import paths module:function or module.function of functions "
        "with type hints and a docstring (the trainer's tools=; e.g. stages.builtin.arithmetic_tools.add); [] : none"))

    def validate(self) -> list[tuple[str, str]]:
        from stages.tools.paths import tool_problems

        return super().validate() + tool_problems(self.tools)  # type: ignore[misc]


S = TypeVar("S", bound=type)


@dataclass_transform(field_specifiers=(dataclasses.field,))
def section(cls: S) -> S:
    """Class decorator of a section (`class DPOSection(TrainingStage, DPOConfig)`): a dataclass whose own fields
    are `stage_default`s of keys its bases declare (help and checks kept from there), with STAGE_DEFAULTS for the
    keys it does not set itself; `CONFIG` names its config ("module:Class")."""
    declared: dict[str, dataclasses.Field[Any]] = {}
    for base in reversed(cls.__mro__[1:]):
        declared.update(getattr(base, "__dataclass_fields__", {}))
    own = dict(cls.__dict__.get("__annotations__", {}))
    defaults = {k: (v, why) for k, (v, why) in STAGE_DEFAULTS.items() if k not in own}
    for key in own:
        given = cls.__dict__.get(key)
        if key not in declared or not isinstance(given, dataclasses.Field) or "stage_default" not in given.metadata:
            raise TypeError(f"{cls.__name__}.{key}: a section declares no key of its own; give the pipeline's "
                            "default of a key its config or TrainingStage declares as stage_default(value, why), "
                            "and a new key on the config")
        inherited = STAGE_DEFAULTS[key][0] if key in STAGE_DEFAULTS else declared[key].default
        if given.default == inherited:
            raise TypeError(f"{cls.__name__}.{key} = {given.default!r} is the default it has already; drop it (one "
                            "default per key)")
        defaults[key] = (given.default, given.metadata["stage_default"])
    annotations = {}
    for key, (value, why) in defaults.items():
        inherited = declared[key]
        meta = {**inherited.metadata, "help": STAGE_HELP.get(key, inherited.metadata.get("help", "")),
                "stage_default": why}
        annotations[key] = inherited.type
        setattr(cls, key, dataclasses.field(default_factory=functools.partial(list, value), metadata=meta)
                if isinstance(value, list) else dataclasses.field(default=as_declared(value, inherited.type),
                                                                   metadata=meta))
    cls.__annotations__ = annotations
    config = next(b for b in cls.__mro__[1:] if issubclass(b, MethodConfig) and "Section" not in b.__name__)
    cls.CONFIG = f"{config.__module__.removesuffix('_light')}:{config.__name__}"  # type: ignore[attr-defined]
    return cast(S, dataclass(cls))
