"""Typed params: `params.yaml` loaded into one dataclass per section.

`params.yaml` is the single source of truth for every stage. `load_params` reads it,
applies `--set key=value` overrides (from the command line or from Prefect flow
parameters), and validates everything before any compute starts. All problems
(unknown keys, wrong types, out-of-range values, unknown method names) are collected
and reported together, each with its full dotted key and how to fix it.

Adding a section for a new stage: write a dataclass whose fields use `param(...)`,
add it to `Params`, and give it a section in `params.yaml`.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import yaml


class ParamsError(ValueError):
    """Every problem found in a params file, one per line, each with its dotted key."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s) in params; nothing was run or written:\n{lines}")


def param(default: Any = dataclasses.MISSING, *, help: str, check: Callable[[Any], bool] | None = None,
          rule: str = "", default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with a help text and an optional range check (`rule` says the fix)."""
    meta = {"help": help, "check": check, "rule": rule}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def positive(default: float | int, help: str) -> Any:
    return param(default, help=help, check=lambda v: v > 0, rule="must be > 0")


def non_negative(default: float | int, help: str) -> Any:
    return param(default, help=help, check=lambda v: v >= 0, rule="must be >= 0")


def fraction(default: float, help: str, *, open_right: bool = True) -> Any:
    if open_right:
        return param(default, help=help, check=lambda v: 0 <= v < 1, rule="must be in [0, 1)")
    return param(default, help=help, check=lambda v: 0 <= v <= 1, rule="must be in [0, 1]")


# --------------------------------------------------------------------------- sections


@dataclass
class TinyModelConfig:
    """Size of the built-in `builtin:tiny` Llama model (used only when model.name_or_path is builtin:tiny)."""

    hidden_size: int = positive(128, "width of the residual stream")
    num_layers: int = positive(4, "decoder layers")
    num_heads: int = positive(4, "attention heads; must divide hidden_size")
    intermediate_size: int = positive(384, "MLP width")
    vocab_size: int = param(384, help="BPE vocabulary size, special tokens included",
                            check=lambda v: 300 <= v <= 65536, rule="must be in [300, 65536] (bytes + merges)")
    seed: int = param(0, help="seed of the random initialisation")

    def validate(self) -> list[tuple[str, str]]:
        if self.hidden_size % self.num_heads:
            return [("num_heads", f"= {self.num_heads}: must divide hidden_size ({self.hidden_size})")]
        return []


@dataclass
class ModelConfig:
    name_or_path: str = param("builtin:tiny", help="builtin:tiny, a local Hugging Face model directory, or a hub id")
    dtype: Literal["float32", "bfloat16", "float16"] = param("float32", help="weights dtype for training and eval")
    trust_remote_code: bool = param(False, help="allow custom modelling code from the model directory")
    builtin: TinyModelConfig = param(default_factory=TinyModelConfig, help="size of builtin:tiny")


@dataclass
class ArithmeticConfig:
    """The built-in verifiable task `builtin:arithmetic` (used only when data.source is builtin:arithmetic)."""

    num_train: int = positive(6000, "SFT demonstrations")
    num_preference: int = positive(3000, "preference pairs (correct chosen, wrong rejected)")
    num_eval: int = positive(300, "held-out evaluation prompts, never seen in training")
    digits: int = param(2, help="digits per operand", check=lambda v: 1 <= v <= 9, rule="must be in [1, 9]")
    error_rate: float = fraction(0.7, "fraction of carry-needing sums whose demonstration drops the carry",
                                 open_right=False)
    reasoning: bool = param(True, help="answers carry a <think>...</think> block with the column sums")
    seed: int = param(0, help="seed of the task generator")


@dataclass
class DataConfig:
    source: str = param("builtin:arithmetic", help="builtin:arithmetic, or a local .jsonl/.json/.parquet/.csv file "
                        "or datasets.save_to_disk directory")
    eval_source: str | None = param(None, help="held-out eval prompts with references; default: carved from source")
    on_bad_rows: Literal["error", "skip"] = param("error", help="error: stop at the first bad row; "
                                                  "skip: drop bad rows and count them in the manifest")
    builtin: ArithmeticConfig = param(default_factory=ArithmeticConfig, help="the built-in task")


@dataclass
class PreprocessConfig:
    max_length: int = positive(512, "drop rows whose prompt + completion is longer (tokens)")
    dedup: bool = param(True, help="drop exact duplicate rows")
    validation_fraction: float = fraction(0.05, "share of SFT rows held out for validation loss")
    eval_fraction: float = fraction(0.1, "share of rows held out for evaluation when data.eval_source is unset")
    streaming: bool = param(False, help="one pass in constant memory for corpora larger than RAM (.jsonl best): "
                            "rows are split by a hash of their content instead of a shuffle")


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


@dataclass
class TrainingParams:
    """What every training stage section shares (the trainer, checkpoints, tracking, adapters)."""

    learning_rate: float = positive(3e-3, "peak learning rate")
    num_train_epochs: float = positive(2.0, "passes over the training rows")
    max_steps: int = param(-1, help="stop after this many optimizer steps (-1: use num_train_epochs)",
                           check=lambda v: v == -1 or v > 0, rule="must be -1 or > 0")
    per_device_train_batch_size: int = positive(32, "rows per device per micro-batch")
    gradient_accumulation_steps: int = positive(1, "micro-batches per optimizer step")
    warmup_ratio: float = fraction(0.05, "share of steps with linear warm-up")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = param(
        "cosine", help="learning-rate schedule")
    save_steps: int = positive(200, "checkpoint every N steps (a crashed run resumes from the last one)")
    logging_steps: int = positive(20, "log every N optimizer steps")
    report_to: list[str] = param(default_factory=lambda: ["tensorboard"],
                                 help="trackers: tensorboard, wandb, mlflow ([] for none)")
    lora: LoraParams = param(default_factory=LoraParams, help="LoRA / QLoRA adapters")


@dataclass
class SFTParams(TrainingParams):
    weight_decay: float = non_negative(0.0, "AdamW weight decay")
    max_seq_length: int = positive(512, "truncate tokenised rows to this many tokens")
    completion_only_loss: bool = param(True, help="loss on completion tokens only (prompt tokens masked)")
    assistant_only_loss: bool = param(False, help="loss on every assistant turn of multi-turn conversations only "
                                      "(needs {% generation %} markers in the chat template)")
    dataset_text_field: str = param("text", help="column holding raw text in text-only rows")
    formatting_func: str | None = param(None, help="module:function turning a row into a training text")
    packing: bool = param(False, help="pack rows into max_seq_length sequences, padding-free")
    packing_strategy: Literal["bfd", "wrapped"] = param("bfd", help="bfd: best-fit decreasing; wrapped: cut")
    streaming: bool = param(False, help="stream the training rows instead of loading them (needs max_steps > 0)")
    gradient_checkpointing: bool = param(False, help="recompute activations in backward to save memory")
    gradient_checkpointing_every: int = positive(1, "checkpoint every k-th decoder block only (1: all)")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = param("auto", help="auto: bf16 on GPUs that have it")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.streaming and self.max_steps <= 0:
            problems.append(("max_steps", f"= {self.max_steps}: streaming has no length; set sft.max_steps > 0"))
        if self.streaming and self.packing:
            problems.append(("packing", "= true: packing needs the whole dataset; turn off sft.streaming or packing"))
        if self.formatting_func is not None and ":" not in self.formatting_func:
            problems.append(("formatting_func", f"= {self.formatting_func!r}: expected module:function"))
        return problems


@dataclass
class PolicyParams(TrainingParams):
    """Preference optimisation after SFT (KTO, Online DPO, PPO and GRPO join later)."""

    learning_rate: float = positive(1e-4, "peak learning rate (DPO wants ~10-50x less than SFT)")
    num_train_epochs: float = positive(1.0, "passes over the preference pairs")
    method: Literal["dpo", "none"] = param("dpo", help="dpo: offline preference optimisation on preference pairs; "
                                           "none: skip (evaluate then reports base and SFT only)")
    beta: float = positive(0.1, "KL strength to the reference (the SFT model)")
    loss_type: Literal["sigmoid", "hinge", "ipo", "robust", "kto_pair", "bco_pair", "sppo_hard", "nca_pair",
                       "apo_zero", "apo_down"] = param("sigmoid", help="DPO loss variant (stages.losses.dpo_loss)")
    label_smoothing: float = param(0.0, help="conservative DPO / robust noise rate", check=lambda v: 0 <= v < 0.5,
                                   rule="must be in [0, 0.5)")
    reference_free: bool = param(False, help="no reference model (its log-probs taken as 0)")
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")


@dataclass
class EvaluateParams:
    max_new_tokens: int = positive(32, "generation budget per prompt")
    batch_size: int = positive(300, "prompts per generate call")
    max_samples: int = param(-1, help="evaluate on at most N held-out prompts (-1: all)",
                             check=lambda v: v == -1 or v > 0, rule="must be -1 or > 0")
    answer_regex: str | None = param(r"(-?\d+)\s*$", help="regex whose first group is the answer in both completion "
                                     "and reference (null: compare whole stripped texts)")
    baseline: bool = param(True, help="also evaluate the untrained base model as a baseline row")

    def validate(self) -> list[tuple[str, str]]:
        import re

        if self.answer_regex is None:
            return []
        try:
            re.compile(self.answer_regex)
        except re.error as e:
            return [("answer_regex", f"= {self.answer_regex!r}: not a valid regular expression ({e})")]
        return []


@dataclass
class ScheduleConfig:
    cron: str = param("0 3 * * *", help="cron expression of the nightly deployment")
    timezone: str = param("UTC", help="IANA timezone of the cron expression, e.g. Europe/Paris")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if len(self.cron.split()) != 5:
            problems.append(("cron", f"= {self.cron!r}: needs 5 fields (minute hour day month weekday)"))
        try:
            import zoneinfo

            zoneinfo.ZoneInfo(self.timezone)
        except Exception:
            problems.append(("timezone", f"= {self.timezone!r}: unknown timezone; use an IANA name like UTC"))
        return problems


@dataclass
class RunConfig:
    seed: int = param(0, help="global seed for training and sampling")
    output_dir: str = param("artifacts", help="where stage outputs go (one folder per stage)")
    device: Literal["auto", "cpu", "cuda"] = param("auto", help="auto: cuda when available")
    schedule: ScheduleConfig = param(default_factory=ScheduleConfig, help="nightly deployment schedule")


@dataclass
class Params:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    sft: SFTParams = field(default_factory=SFTParams)
    policy: PolicyParams = field(default_factory=PolicyParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def select(self, keys: tuple[str, ...]) -> dict[str, Any]:
        """The values of dotted `keys` (sections or leaves), for fingerprints and manifests."""
        d = self.to_dict()
        out = {}
        for key in keys:
            node = d
            for part in key.split("."):
                node = node[part]
            out[key] = node
        return out


# --------------------------------------------------------------------------- loading


def load_params(path: str | Path = "params.yaml", overrides: list[str] | dict[str, Any] | None = None) -> Params:
    """Read, override and validate params; raise ParamsError listing every problem."""
    path = Path(path)
    source = str(path)
    if not path.exists():
        raise ParamsError(source, ["file not found; run from the project root or pass --params PATH"])
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ParamsError(source, [f"not valid YAML: {e}"]) from None
    if not isinstance(raw, dict):
        raise ParamsError(source, [f"top level must be a mapping of sections, got {type(raw).__name__}"])
    problems = apply_overrides(raw, overrides or [])
    params, more = build(Params, raw, "")
    problems += more
    if problems:
        raise ParamsError(source, problems)
    return params


def parse_overrides(overrides: list[str] | dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`["sft.learning_rate=1e-4"]` or `{"sft.learning_rate": 1e-4}` -> ({dotted: value}, problems)."""
    if isinstance(overrides, dict):
        return dict(overrides), []
    parsed, problems = {}, []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. sft.learning_rate=1e-4")
            continue
        try:
            parsed[key.strip()] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            parsed[key.strip()] = text
    return parsed, problems


def apply_overrides(raw: dict[str, Any], overrides: list[str] | dict[str, Any]) -> list[str]:
    parsed, problems = parse_overrides(overrides)
    for key, value in parsed.items():
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {} if node.get(part) is None else node[part]
            if not isinstance(node[part], dict):
                problems.append(f"--set {key}: {part!r} is a value, not a section")
                break
            node = node[part]
        else:
            node[parts[-1]] = value
    return problems


def build(cls: type, raw: Any, prefix: str) -> tuple[Any, list[str]]:
    """Instantiate dataclass `cls` from `raw`, collecting every problem with its dotted key."""
    problems: list[str] = []
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return cls(), [f"{prefix.rstrip('.') or 'params'} = {raw!r}: must be a mapping of keys"]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            near = ", ".join(sorted(fields))
            problems.append(f"{prefix}{key}: unknown key; known keys here: {near}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        key, value, hint = f"{prefix}{name}", raw[name], hints[name]
        if dataclasses.is_dataclass(hint):
            values[name], more = build(hint, value, key + ".")
            problems += more
            continue
        ok, value, expected = coerce(value, hint)
        if not ok:
            problems.append(f"{key} = {raw[name]!r}: expected {expected}; {f.metadata.get('help', '')}".rstrip("; "))
            continue
        check = f.metadata.get("check")
        if check is not None and value is not None and not check(value):
            problems.append(f"{key} = {raw[name]!r}: {f.metadata['rule']} ({f.metadata['help']})")
            continue
        values[name] = value
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if validate is not None and not problems:
        problems += [f"{prefix}{k} {msg}" for k, msg in validate()]
    return obj, problems


def coerce(value: Any, hint: Any) -> tuple[bool, Any, str]:
    """Check `value` against a type hint; ints are accepted for floats. Returns (ok, value, expected)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return value in args, value, "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None, "null"
        inner = [a for a in args if a is not type(None)]
        ok, value, expected = coerce(value, inner[0])
        return ok, value, expected + " or null"
    if origin is list:
        (item,) = args
        if not isinstance(value, list):
            return False, value, f"a list of {item.__name__}"
        results = [coerce(v, item) for v in value]
        return all(r[0] for r in results), [r[1] for r in results], f"a list of {item.__name__}"
    if hint is bool:
        return isinstance(value, bool), value, "true or false"
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                return False, value, "a number"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value, "a number"
    if hint is str:
        return isinstance(value, str), value, "a string"
    raise TypeError(f"unsupported param type {hint!r}")
