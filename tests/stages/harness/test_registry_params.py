"""What each stage really reads and imports while it runs, against what its StageSpec declares.

Every stage of the small pipeline runs once (in-process, the real runner) with two recorders on:
- an access-recording view of the params: every field read through `ctx.params`, as a dotted key
  (`sft.learning_rate`), however it is reached (attribute, `dataclasses.asdict`, a section passed on);
- every import statement executed (`builtins.__import__` and `importlib.import_module`), lazy ones included.
A read key not covered by `StageSpec.params` would leave the stage current after that key changed (the
fingerprint and DVC's `params:` hash only the declared keys); an imported project module outside the
stage's import closure would do the same for code.
"""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Iterator

import pytest

from stages.harness import imports, runner
from stages.harness.params_loader import load_params
from stages.harness.registry import RUNTIME_KEYS, STAGES, resolve
from tests.conftest import write_params


@contextlib.contextmanager
def recording_reads(params) -> Iterator[set[str]]:
    """Yield the set of dotted keys read from `params` (leaves: values that are not themselves sections)
    while inside. Patches `__getattribute__` of the params dataclasses for the duration, recording only for
    the section objects of this `params` tree; values, pickling and `dataclasses.asdict` are unchanged."""
    paths: dict[int, str] = {}

    def walk(obj, path: str) -> None:
        paths[id(obj)] = path
        for f in dataclasses.fields(obj):
            value = object.__getattribute__(obj, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                walk(value, f"{path}.{f.name}" if path else f.name)

    walk(params, "")
    reads: set[str] = set()
    classes = {type(o) for o in _sections(params)}
    fields = {cls: {f.name for f in dataclasses.fields(cls)} for cls in classes}
    assert not any("__getattribute__" in vars(cls) for cls in classes)

    def getattribute(self, attr):
        value = object.__getattribute__(self, attr)
        path = paths.get(id(self))
        if path is not None and attr in fields[type(self)] and id(value) not in paths:
            reads.add(f"{path}.{attr}" if path else attr)
        return value

    for cls in classes:
        cls.__getattribute__ = getattribute
    try:
        yield reads
    finally:
        for cls in classes:
            del cls.__getattribute__


def _sections(obj) -> list:
    out = [obj]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += _sections(value)
    return out


@contextlib.contextmanager
def recording_imports() -> Iterator[set[str]]:
    """Yield the set of `stages.*` modules named by every import executed while inside (already loaded or not)."""
    found: set[str] = set()
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def record(name: str, globals_=None, fromlist=(), level: int = 0) -> None:
        if level:
            package = (globals_ or {}).get("__package__") or ""
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - level + 1])
            name = f"{base}.{name}" if name else base
        if name.split(".")[0] == "stages":
            found.add(name)
            found.update(f"{name}.{n}" for n in fromlist or () if f"{name}.{n}" in sys.modules)

    def import_(name, globals=None, locals=None, fromlist=(), level=0):
        record(name, globals, fromlist, level)
        return real_import(name, globals, locals, fromlist, level)

    def import_module(name, package=None):
        module = real_import_module(name, package)
        record(module.__name__)
        return module

    builtins.__import__, importlib.import_module = import_, import_module
    try:
        yield found
    finally:
        builtins.__import__, importlib.import_module = real_import, real_import_module


def covered(key: str, declared: tuple[str, ...]) -> bool:
    return any(key == d or key.startswith(d + ".") for d in declared)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """{stage: (params keys read, stages.* modules imported)} from one run of the small pipeline."""
    folder = tmp_path_factory.mktemp("recorded")
    params = load_params(write_params(folder))
    seen = {}
    real_resolve = runner.resolve
    entries = {spec.entry: name for name, spec in STAGES.items()}

    def resolve(target):
        fn = real_resolve(target)
        if target not in entries:  # a share of a sharded stage (run_shard): not recorded
            return fn

        def recorded_run(ctx):
            with recording_reads(ctx.params) as reads, recording_imports() as modules:
                result = fn(ctx)
            seen[entries[target]] = (reads, modules)
            return result
        return recorded_run

    runner.resolve = resolve
    try:
        for name in STAGES:
            assert runner.run_stage(name, params)["executed"]
    finally:
        runner.resolve = real_resolve
    return seen


def test_every_stage_reads_only_the_params_it_declares(recorded):
    undeclared = {name: sorted(k for k in reads if not covered(k, STAGES[name].params + RUNTIME_KEYS))
                  for name, (reads, _) in recorded.items()}
    assert undeclared == {name: [] for name in STAGES}, "declare these keys in the stage's StageSpec.params"
    assert len(recorded["sft"][0]) > 10 and "sft.learning_rate" in recorded["sft"][0]  # the recorder saw reads


def test_every_stage_imports_only_modules_of_its_closure(recorded):
    for name, (_, modules) in recorded.items():
        closure = {m for entry in STAGES[name].runs() for m in imports.closure_modules(entry)}
        assert modules <= closure, f"{name} imported {sorted(modules - closure)}, outside its static closure"
    assert {"stages.metrics", "stages.metrics.report"} <= recorded["evaluate"][1]  # lazy imports are recorded


def test_the_recorder_sees_sections_passed_on_and_asdict(tmp_path):
    params = load_params(write_params(tmp_path))

    def read_lr(section):
        return section.learning_rate

    with recording_reads(params) as reads:
        read_lr(params.sft)
        dataclasses.asdict(params.run.launch)
        params.model  # noqa: B018 (a section alone reads nothing)
    assert reads == {"sft.learning_rate"} | {f"run.launch.{f.name}" for f in dataclasses.fields(params.run.launch)}
    assert resolve(STAGES["sft"].entry)  # untouched afterwards:
    assert "__getattribute__" not in vars(type(params.sft))

