"""Reading params: `params.yaml`, `--set` overrides and deprecated keys, into the schema of `stages.harness.config`.

`load_params` reads the file, applies `--set key=value` overrides (from the command line or
from Prefect flow parameters), moves deprecated keys to their new names (a warning each),
builds the sections and checks every value, then runs the preflight checks that open the
user's files (`stages.harness.preflight`). All problems are collected and reported together, each
with its full dotted key and how to fix it, before any compute starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml

from stages.fields import deprecations, move_deprecated
from stages.harness.config import PIPELINE_KEYS, TRAINING_SECTIONS, Params, PolicyParams
from stages.trainers.arguments import TRAINING_ARGUMENT_NAMES


class ParamsError(ValueError):
    """Every problem found in a params file, one per line, each with its dotted key."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s) in params; nothing was run or written:\n{lines}")



def load_params(path: str | Path = "params.yaml", overrides: list[str] | dict[str, Any] | None = None, *,
                preflight: bool = True, rows: bool = False) -> Params:
    """Read, override and validate params; raise ParamsError listing every problem.

    `preflight`: also run the checks that open the user's data files and model folder (`stages.harness.preflight`);
    `align status` skips them (it reads no file but the params). `rows`: also check the rows of the data files
    and the held-out pairs the reward gate will judge (`stages.data.row_checks`), whatever else is wrong, so
    one message names every problem; the entries that start a run pass it."""
    path = Path(path)
    source = str(path)
    if not path.exists():
        raise ParamsError(source, ["file not found; run from the project root or pass --params PATH"])
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ParamsError(source, [f"not valid YAML: {e}"]) from None
    if not isinstance(raw, dict):
        raise ParamsError(source, [f"top level must be a mapping of sections, got {type(raw).__name__}"])
    problems = apply_overrides(raw, overrides or [])
    problems += move_deprecated_keys(raw) + pipeline_key_problems(raw)
    params, more = build(Params, raw, "")
    problems += more
    if not problems:  # promote.metric names a column this evaluate configuration produces
        from stages.evaluation.columns import promote_metric_problems

        problems += [f"{k} {msg}" for k, msg in promote_metric_problems(params.promote.metric, params.evaluate)]
    if not problems and preflight:
        from stages.harness.preflight import preflight_problems

        problems += preflight_problems(params)
    if rows:
        from stages.data.row_checks import check_rows

        problems += check_rows(params)
    if problems:
        raise ParamsError(source, list(dict.fromkeys(problems)))  # a file two checks read is named once
    return params


def _sections(raw: dict[str, Any]):
    """(dotted name, raw mapping, section class) of every training section present in `raw`."""
    for dotted, cls in TRAINING_SECTIONS.items():
        node = raw
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            yield dotted, node, cls


def move_deprecated_keys(raw: dict[str, Any]) -> list[str]:
    """Move deprecated keys to their new names (a FutureWarning naming both); -> problems (a key set twice).

    Besides each section's deprecated fields, the training keys that `policy` once shared among its
    methods (`policy.learning_rate`, `policy.lora`, ...) move into the section of `policy.method`, the one
    method they reached."""
    problems: list[str] = []
    policy = raw.get("policy")
    if isinstance(policy, dict):
        own = {f.name for f in dataclasses.fields(PolicyParams)}
        method = policy.get("method", PolicyParams.method)
        for key in [k for k in policy if k not in own and k in TRAINING_SECTIONS["policy.dpo"].__dataclass_fields__]:
            value = policy.pop(key)
            if method in own and isinstance(policy.setdefault(method, {}), dict):
                policy[method][key] = value
            warnings.warn(f"policy.{key} is deprecated and will be removed in the next release: set "
                          f"policy.{method}.{key} (applied there)", FutureWarning, stacklevel=3)
    for dotted, node, cls in list(_sections(raw)):
        try:
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}  # a key at its default is not "set"
            for message in move_deprecated(node, deprecations(cls), f"{dotted}.", defaults):
                warnings.warn(message, FutureWarning, stacklevel=3)
        except ValueError as e:
            problems.append(str(e))
    return problems


def pipeline_key_problems(raw: dict[str, Any]) -> list[str]:
    """TrainingArguments keys the pipeline sets itself may not be set in a section to another value than their
    default (they would be ignored); a resolved params file (a launched stage's) lists them at their defaults."""
    return [f"{dotted}.{key} = {node[key]!r}: set by the pipeline from {where.replace('<section>', dotted)}; remove it "
            "here" for dotted, node, cls in _sections(raw) for key, where in PIPELINE_KEYS.items()
            if key in node and key in cls.__dataclass_fields__ and node[key] != cls.__dataclass_fields__[key].default]


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
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
            hint = (f"did you mean {close[0]}?" if close else f"known keys here: {', '.join(sorted(fields))}"
                    if len(fields) <= 30 else "`align params` lists this section's keys (every TrainingArguments "
                    "key is one)")
            trl = _trl_problem(cls, prefix, key)
            problems.append(trl or f"{prefix}{key}: unknown key; {hint}")
    if hasattr(cls, "CONFIG"):  # a training section: TrainingArguments keys TRL users set that we do not support
        problems += [p for key in raw if key in TRAINING_ARGUMENT_NAMES and key in fields
                     and raw[key] != fields[key].default and (p := _trl_problem(cls, prefix, key))]
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


def _trl_problem(cls: type, prefix: str, key: str) -> str | None:
    """The error for a TRL 1.16 field of a training section's config that we do not support, or None."""
    from stages.trainers.trl_compat import unsupported_message, unsupported_reason

    name = getattr(cls, "CONFIG", ":").partition(":")[2]
    if not name or unsupported_reason(name, key) is None:
        return None
    return unsupported_message(f"{prefix}{key}", key)


def coerce(value: Any, hint: Any) -> tuple[bool, Any, str]:
    """Check `value` against a type hint; ints are accepted for floats. Returns (ok, value, expected)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return value in args, value, "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None, "null"
        expected = []
        for alternative in (a for a in args if a is not type(None)):
            ok, coerced, what = coerce(value, alternative)
            if ok:
                return True, coerced, what
            expected.append(what)
        return False, value, " or ".join(expected + (["null"] if type(None) in args else []))
    if origin is dict:
        key_type, value_type = args
        expected = f"a mapping of {key_type.__name__} to {value_type.__name__}"
        if not isinstance(value, dict):
            return False, value, expected
        results = {k: coerce(v, value_type) for k, v in value.items()}
        ok = all(isinstance(k, key_type) for k in value) and all(r[0] for r in results.values())
        return ok, {k: r[1] for k, r in results.items()}, expected
    if origin is list:
        (item,) = args
        if not isinstance(value, list):
            return False, value, f"a list of {item.__name__}"
        results = [coerce(v, item) for v in value]
        return all(r[0] for r in results), [r[1] for r in results], f"a list of {item.__name__}"
    if hint is dict:
        return isinstance(value, dict), value, "a mapping"
    if hint is type(None):
        return value is None, value, "null"
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
