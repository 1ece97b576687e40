"""Tools named in params by import path (`policy.grpo.tools: [mypkg.tools.search, ...]`).

A path is `module:function` (as reward functions take them) or `module.function` (the last dot splits). The
function must be importable where the stage runs; its name, type hints and docstring are the schema the model
sees (TRL's `tools=`), so `resolve_tool` checks that it is a named, non-class callable. Torch-free: params
validation resolves every path before any stage runs.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

from stages.basics import import_user_module


def split_path(path: str) -> tuple[str, str]:
    """("module", "function") of "module:function" or "module.function"; ValueError when neither."""
    module, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module or not name or ":" in name:
        raise ValueError("expected an import path module:function or module.function (e.g. "
                         "stages.builtin.arithmetic_tools.add)")
    return module, name


def resolve_tool(path: str) -> Callable:
    """The function `path` names; ValueError saying why it cannot be a tool (the caller adds the params key)."""
    module_name, name = split_path(path)
    module = import_user_module(module_name)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ValueError(f"{module_name} has no {name!r} (its functions: {', '.join(defined) or 'none'})")
    if inspect.isclass(fn) or not callable(fn) or not hasattr(fn, "__name__"):
        raise ValueError(f"is a {type(fn).__name__}, not a function; a tool is a function with type hints and a "
                         "Google-style docstring (its schema is what the model sees)")
    return fn


def tool_problems(paths: list[str], key: str = "tools") -> list[tuple[str, str]]:
    """(key[i], why) for every path that does not resolve to a tool, and for tools whose names repeat (a call
    names its tool)."""
    problems, names = [], {}
    for i, path in enumerate(paths):
        try:
            names[i] = resolve_tool(path).__name__
        except ValueError as e:
            problems.append((f"{key}[{i}]", f"= {path!r}: {e}"))
    repeated = sorted({n for n in names.values() if list(names.values()).count(n) > 1})
    if repeated:
        problems.append((key, f"= {paths}: tool names {repeated} repeat; a call names its tool, so each needs a "
                         "distinct function name"))
    return problems
