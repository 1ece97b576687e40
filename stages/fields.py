"""Declared params fields: `param(...)` and its range shorthands, and the checks they carry.

A field declared with `param(default, help=..., check=..., rule=...)` states its default, what it
means and its valid range once. Two readers use the same declaration:

- `stages.harness.config.build` (params.yaml and `--set`), which checks each value as it reads it;
- `check_fields(obj)`, which checks an object built directly in Python, e.g. a trainer config
  (`GRPOConfig(output_dir=..., num_generations=1)`) that never went through params.yaml.

Both report `(dotted key, message)` pairs, so a problem reads the same from either side.
This module imports nothing heavy: params validation stays fast.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import field
from typing import Any, Literal

# Linear warm-up as a share of the steps: the training sections' default (stages.harness.config.STAGE_DEFAULTS) and
# SFTConfig's, where TrainingArguments' would be 0 (docs/decisions.md).
WARMUP_RATIO = 0.05


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


def is_param(f: dataclasses.Field) -> bool:
    """Whether a dataclass field was declared with `param` (TrainingArguments' own fields were not)."""
    return "rule" in f.metadata


def check_fields(obj: Any, cls: type | None = None) -> list[tuple[str, str]]:
    """Range checks and Literal choices of the `param` fields of `obj` (declared on `cls`, default its
    type), nested sections included with their own `validate`: [(dotted key, message)]."""
    cls = cls or type(obj)
    hints = typing.get_type_hints(cls)
    problems: list[tuple[str, str]] = []
    for f in dataclasses.fields(cls):
        if not is_param(f):
            continue
        value, hint = getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            nested = check_fields(value) + list(getattr(value, "validate", lambda: [])())
            problems += [(f"{f.name}.{key}", message) for key, message in dict.fromkeys(nested)]
            continue
        choices = _literal_choices(hint)
        if choices and value not in choices and value is not None:
            problems.append((f.name, f"= {value!r}: expected one of {', '.join(repr(c) for c in choices)}; "
                                     f"{f.metadata['help']}"))
            continue
        check = f.metadata.get("check")
        if check is not None and value is not None and not check(value):
            problems.append((f.name, f"= {value!r}: {f.metadata['rule']} ({f.metadata['help']})"))
    return problems


def _literal_choices(hint: Any) -> tuple:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return tuple(c for a in typing.get_args(hint) if typing.get_origin(a) is Literal for c in typing.get_args(a))


def raise_problems(what: str, problems: list[tuple[str, str]]) -> None:
    """Raise one ValueError naming every problem of a config built in Python (`what`: e.g. "GRPOConfig")."""
    if problems:
        lines = "\n".join(f"  - {key} {message}" for key, message in problems)
        raise ValueError(f"{what}: {len(problems)} problem(s):\n{lines}")


def deprecated(new: str | dict[str, str], help: str) -> Any:
    """An old field name kept for one release: its value moves to `new` (a field name, or for a nested section
    a mapping {old sub-key: new field}) with a FutureWarning naming the new key (`move_deprecated`)."""
    return field(default=None, metadata={"help": f"deprecated: {help}", "deprecated": new, "check": None,
                                         "rule": ""})


def deprecations(cls: type) -> dict[str, str | dict[str, str]]:
    """{old field: new field or {old sub-key: new field}} of a config class."""
    return {f.name: f.metadata["deprecated"] for f in dataclasses.fields(cls) if f.metadata.get("deprecated")}


def move_deprecated(values: dict[str, Any], renames: dict[str, Any], prefix: str = "",
                    defaults: dict[str, Any] | None = None) -> list[str]:
    """Move the deprecated keys of `values` to their new names in place; -> one warning per key moved.

    A key set under both names is an error (ValueError naming both); a nested old section (e.g.
    `generation: {max_new_tokens: 8}`) is flattened to its new fields."""
    messages = []
    for old, new in renames.items():
        value = values.pop(old, None)
        if value is None:
            continue
        if isinstance(new, str):
            moved = {new: value}
        else:
            if dataclasses.is_dataclass(value):  # a section object: its fields left at their defaults say nothing
                value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                         if f.name in new or getattr(value, f.name) != f.default}
            else:
                value = dict(value)
            unknown = sorted(set(value) - set(new))
            if unknown:
                raise ValueError(f"{prefix}{old}.{unknown[0]}: unknown key of the deprecated {prefix}{old} section; "
                                 f"its keys are now flat: {', '.join(f'{k} -> {prefix}{v}' for k, v in new.items())}")
            moved = {new[k]: v for k, v in value.items()}
        for key, v in moved.items():
            if key in values and values[key] not in (None, (defaults or {}).get(key)) and values[key] != v:
                raise ValueError(f"{prefix}{old} (deprecated) and {prefix}{key} are both set: keep {prefix}{key} only")
            values[key] = v
        messages.append(f"{prefix}{old} is deprecated and will be removed in the next release: use "
                        + (f"{prefix}{new}" if isinstance(new, str) else ", ".join(f"{prefix}{v}" for v in moved)))
    return messages
