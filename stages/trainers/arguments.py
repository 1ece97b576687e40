"""The `TrainingArguments` base of every method config, real or light.

Each method config (`stages/trainers/<method>_config.py`) is one dataclass declared on
`training_arguments()`: transformers' `TrainingArguments` when imported normally, as TRL's
configs are, and `LightTrainingArguments` (transformers' own fields, names, defaults and help, read
from transformers' source with `ast`, no torch) when params validation executes the same module a
second time (`light_module`). Why, what it costs and what it measured: docs/architecture.md,
"Configs read without torch".
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.fields import param

_light = False  # True while `light_module` executes a config module

# TrainingArguments fields whose default transformers computes at import (optim: fused AdamW on new torch).
# The light class holds None for them; `real_kwargs` leaves a None out, so transformers picks its own.
COMPUTED_DEFAULTS = ("optim",)


def training_arguments() -> type:
    """The base class of a method config: the light stand-in inside `light_module`, else transformers'."""
    if _light:
        return LightTrainingArguments
    from transformers import TrainingArguments

    return TrainingArguments


def is_light(config: Any) -> bool:
    return isinstance(config, LightTrainingArguments)


@functools.cache
def _transformers_fields() -> tuple[tuple[str, str, Any, str], ...]:
    """(name, annotation, default, help) of every TrainingArguments field, from transformers' source."""
    spec = importlib.util.find_spec("transformers")
    source = Path(spec.submodule_search_locations[0], "training_args.py").read_text(encoding="utf-8")
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "TrainingArguments")
    out = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call)):
            continue
        kw = {k.arg: k.value for k in node.value.keywords}
        help_ = ""
        if isinstance(kw.get("metadata"), ast.Dict):
            meta = dict(zip((ast.literal_eval(k) for k in kw["metadata"].keys), kw["metadata"].values, strict=True))
            help_ = ast.literal_eval(meta["help"]) if "help" in meta else ""
        if "default_factory" in kw:
            default: Any = dataclasses.MISSING if ast.unparse(kw["default_factory"]) != "list" else []
        else:
            try:
                default = ast.literal_eval(kw["default"])
            except ValueError:
                default = None  # computed at import (COMPUTED_DEFAULTS)
        out.append((node.target.id, ast.unparse(node.annotation), default, " ".join(str(help_).split())))
    return tuple(out)


@functools.cache
def _enum_values(module: str, name: str) -> tuple[str, ...]:
    """The string values of enum `name` in transformers' `module`, read from its source."""
    spec = importlib.util.find_spec("transformers")
    source = Path(spec.submodule_search_locations[0], f"{module}.py").read_text(encoding="utf-8")
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name)
    return tuple(ast.literal_eval(n.value) for n in cls.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str))


def _checks() -> dict[str, tuple[Any, str]]:
    """Range checks of the common TrainingArguments keys, so params validation catches them torch-free
    (transformers checks the rest when the stage builds its config, before any model)."""
    schedulers = _enum_values("trainer_utils", "SchedulerType")
    return {
        "learning_rate": (lambda v: v > 0, "must be > 0"),
        "num_train_epochs": (lambda v: v > 0, "must be > 0"),
        "max_steps": (lambda v: v == -1 or v > 0, "must be -1 or > 0"),
        "per_device_train_batch_size": (lambda v: v > 0, "must be > 0"),
        "per_device_eval_batch_size": (lambda v: v > 0, "must be > 0"),
        "gradient_accumulation_steps": (lambda v: v > 0, "must be > 0"),
        "warmup_steps": (lambda v: v >= 0, "must be >= 0 (steps, or a share of all steps when < 1)"),
        "weight_decay": (lambda v: v >= 0, "must be >= 0"),
        "max_grad_norm": (lambda v: v >= 0, "must be >= 0 (0: no clipping)"),
        "save_steps": (lambda v: v > 0, "must be > 0"),
        "logging_steps": (lambda v: v > 0, "must be > 0"),
        "lr_scheduler_type": (lambda v: v in schedulers, "must be one of " + ", ".join(schedulers)),
    }


def _light_type(annotation: str) -> Any:
    """A type the params loader can check for a TrainingArguments annotation (enums and classes -> str/dict)."""
    names = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "None": type(None)}
    parts = []
    for part in (p.strip() for p in annotation.replace("Optional[", "").replace("]", "").split("|")):
        base = part.split("[")[0]
        if base == "list":
            parts.append(list[str])
        elif base in names:
            parts.append(names[base])
        elif base in ("Literal",):
            parts.append(bool)
        else:  # enums (IntervalStrategy, SchedulerType, ...), ParallelismConfig: given by name in params.yaml
            parts.append(str if base.endswith(("Strategy", "Type", "Names", "Option")) else dict)
    parts = list(dict.fromkeys(parts))
    out = parts[0]
    for p in parts[1:]:
        out = out | p
    return out


def as_declared(value: Any, kind: Any) -> Any:
    """An int default of a float field as a float, so a default and the same value read back from YAML (which the
    loader coerces to float) are equal and serialise alike (fingerprints hash the JSON)."""
    import typing

    kinds = set(typing.get_args(kind)) or {kind}
    if isinstance(value, int) and not isinstance(value, bool) and float in kinds and int not in kinds:
        return float(value)
    return value


def _build_light_class() -> type:
    fields, checks = [], _checks()
    for name, annotation, default, help_ in _transformers_fields():
        check, rule = checks.get(name, (None, ""))
        meta = {"help": help_, "transformers": True, "check": check, "rule": rule}
        kind = _light_type(annotation)
        f = (dataclasses.field(default_factory=list, metadata=meta) if isinstance(default, list)
             else dataclasses.field(default=as_declared(default, kind), metadata=meta))
        fields.append((name, kind | None if name in COMPUTED_DEFAULTS else kind, f))
    cls = dataclasses.make_dataclass("LightTrainingArguments", fields, namespace={
        "__doc__": "transformers.TrainingArguments' fields and defaults, without torch (params validation).",
        "__post_init__": lambda self: None,
    })
    cls.__module__ = __name__
    return cls


LightTrainingArguments = _build_light_class()
TRAINING_ARGUMENT_NAMES = frozenset(f.name for f in dataclasses.fields(LightTrainingArguments))


@functools.cache
def light_module(name: str) -> types.ModuleType:
    """Config module `name` loaded a second time on LightTrainingArguments, as module `<name>_light`."""
    global _light
    origin = importlib.util.find_spec(name).origin
    spec = importlib.util.spec_from_file_location(f"{name}_light", origin)
    module = importlib.util.module_from_spec(spec)
    _light = True
    try:
        sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
        spec.loader.exec_module(module)
    finally:
        _light = False
    return module


def real_kwargs(config: Any, cls: type) -> dict[str, Any]:
    """Keyword arguments of `cls` (a real config class) from a light config or section with its fields."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    out = {}
    for f in dataclasses.fields(config):
        if f.name in names and not f.metadata.get("deprecated"):
            value = getattr(config, f.name)
            if value is None and f.name in COMPUTED_DEFAULTS:
                continue
            out[f.name] = value
    return out


def settle(config: Any) -> None:
    """Move a config's deprecated fields to their new names, with a FutureWarning each (Python API)."""
    import warnings

    from stages.fields import deprecations, move_deprecated

    renames = deprecations(type(config))
    if not any(getattr(config, old) is not None for old in renames):
        return
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for message in move_deprecated(values, renames, f"{type(config).__name__}.", defaults):
        warnings.warn(message, FutureWarning, stacklevel=4)
    for name, value in values.items():
        setattr(config, name, value)
    for old in renames:
        setattr(config, old, None)


def check(config: Any) -> None:
    """Raise one ValueError naming every problem of a config built in Python (none for a light config: the
    params loader collects the problems of every section with their dotted keys)."""
    from stages.fields import raise_problems

    if not is_light(config):
        from stages.trainers.trl_compat import unsupported_trl_fields

        inherited = {f: getattr(config, f) for f in TRAINING_ARGUMENT_NAMES}
        refused = [(key, f"= {inherited[key]!r}: {message.split(': ', 1)[1]}")
                   for key, message in unsupported_trl_fields(type(config), inherited)]
        raise_problems(type(config).__name__, config.validate() + refused)


def _json_dict(value: Any) -> bool:
    return isinstance(value, dict)


@dataclass
class ModelLoadingFields:
    """TRL's model-loading fields, on every method config (through `MethodConfig` below)."""

    model_init_kwargs: dict | None = param(
        None, help="keyword arguments of from_pretrained when the trainer loads the model from a path (dtype, "
        "attn_implementation, revision, ...; dtype defaults to float32); a model passed as an object must be "
        "loaded with them already", check=_json_dict, rule="must be a mapping of from_pretrained keyword arguments")
    trust_remote_code: bool = param(False, help="run the Python code a model folder ships when loading it and its "
                                    "tokenizer (only for a model whose code you have read)")


class MethodConfig(ModelLoadingFields):
    """Mixin of every method config, before TrainingArguments in its bases: TRL's model-loading fields
    (`model_init_kwargs`, `trust_remote_code`); in `__post_init__`, deprecated names moved (`settle`), then
    transformers' own checks, then the method's (`check`)."""

    def __post_init__(self):
        settle(self)
        super().__post_init__()
        check(self)


def refuses_trl_fields(cls: type) -> type:
    """Class decorator of a method config: a TRL 1.16 field we do not support (`stages.trainers.trl_compat`)
    given as a keyword is refused with why, instead of dataclasses' bare TypeError; one we inherit from
    TrainingArguments (use_liger_kernel) is refused by `check` when set."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        from stages.trainers.trl_compat import unsupported_trl_fields

        unknown = {k: v for k, v in kwargs.items() if k not in cls.__dataclass_fields__}
        problems = unsupported_trl_fields(cls.__name__, unknown)
        if problems:
            raise TypeError(f"{cls.__name__}: " + "; ".join(message for _, message in problems))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls
