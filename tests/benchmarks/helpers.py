"""What the benchmark tests share: params as --set arguments."""
from __future__ import annotations

import json


def as_sets(d: dict, prefix: str = "") -> list[str]:
    """A nested params dict (tests.conftest.SMALL) as --set KEY=VALUE arguments (JSON values are YAML)."""
    out = []
    for k, v in d.items():
        out += as_sets(v, f"{prefix}{k}.") if isinstance(v, dict) else ["--set", f"{prefix}{k}={json.dumps(v)}"]
    return out
