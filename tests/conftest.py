"""Shared fixtures: isolated Prefect home, small params for fast runs of the real pipeline."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

# Before anything imports prefect: never touch the user's ~/.prefect, never phone home.
_PREFECT_HOME = tempfile.mkdtemp(prefix="align-test-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# Under `pytest -n N` (pytest-xdist; `make test` runs -n auto), each worker gets its share of the cores: torch's
# default of one thread per core would make the workers fight over them (10-60x slower steps, shared/NOTES.md).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from benchmarks.common import deep_update  # noqa: E402,F401 (re-exported for the tests)
from stages.harness.registry import STAGES  # noqa: E402 (after the environment above; imports no Prefect)

STAGE_ORDER = tuple(STAGES)

# Small enough that the whole pipeline runs in seconds on 2 cores; the same code paths.
SMALL = {
    "model": {"builtin": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}},
    "data": {"builtin": {"num_train": 400, "num_preference": 50, "num_eval": 20, "num_dev": 20}},
    "sft": {"max_steps": 4, "per_device_train_batch_size": 16, "logging_steps": 1},
    "reward": {"max_steps": 3, "per_device_train_batch_size": 8, "logging_steps": 1, "min_accuracy": 0.0},
    "score": {"num_prompts": 12, "n": 3, "generation": {"max_new_tokens": 6},  # the small model is never right:
              "reward_functions": ["reward_model"], "reward_weights": None, "min_score": None},  # RM-only pairs
    "policy": {"num_prompts": 16,
               **{m: {"max_steps": 3, "per_device_train_batch_size": 8, "logging_steps": 1}
                  for m in ("dpo", "kto", "online_dpo", "ppo")},
               "grpo": {"num_generations": 2, "max_steps": 3, "per_device_train_batch_size": 4, "logging_steps": 1,
                        "max_completion_length": 6},
               "online_dpo": {"max_steps": 3, "per_device_train_batch_size": 8, "logging_steps": 1,
                              "max_new_tokens": 6},
               "ppo": {"max_steps": 3, "per_device_train_batch_size": 8, "logging_steps": 1,
                       "max_completion_length": 6},
               "rloo": {"num_generations": 2, "max_steps": 3, "per_device_train_batch_size": 4, "logging_steps": 1,
                        "max_completion_length": 6},
               "distillation": {"max_steps": 3, "per_device_train_batch_size": 4, "logging_steps": 1,
                                "max_completion_length": 6}},
    "evaluate": {"max_new_tokens": 4},
}


def write_params(folder: Path, extra: dict | None = None, *, small: bool = True) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    if small:
        deep_update(params, SMALL)
    deep_update(params, {"run": {"output_dir": str(folder / "artifacts")}})
    deep_update(params, extra or {})
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


@pytest.fixture
def small_params(tmp_path) -> Path:
    """A params.yaml with small settings, outputs under tmp_path/artifacts."""
    return write_params(tmp_path)


@pytest.fixture(scope="session")
def built_pipeline(tmp_path_factory):
    """Every stage built once on small settings (for tests that only read outputs)."""
    from stages.harness.params_loader import load_params
    from stages.harness.runner import run_stage

    folder = tmp_path_factory.mktemp("pipeline")
    params = load_params(write_params(folder))
    manifests = {name: run_stage(name, params) for name in STAGE_ORDER}
    return params, manifests
