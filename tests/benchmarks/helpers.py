"""What the benchmark tests share: a script under benchmarks/ loaded as a module, and params as --set arguments."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_sets(d: dict, prefix: str = "") -> list[str]:
    """A nested params dict (tests.conftest.SMALL) as --set KEY=VALUE arguments (JSON values are YAML)."""
    out = []
    for k, v in d.items():
        out += as_sets(v, f"{prefix}{k}.") if isinstance(v, dict) else ["--set", f"{prefix}{k}={json.dumps(v)}"]
    return out
