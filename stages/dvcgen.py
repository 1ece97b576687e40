"""Derive `dvc.yaml` from the stage table, so DVC and Prefect see the same dependencies.

Each DVC stage runs the same command as the Prefect task (`python -m stages <stage>`),
depends on the same code files (the import closure of the stage's module, file by file) and
upstream output folders, and lists only the params keys that stage reads. `tests/test_dvc.py`
checks that the committed `dvc.yaml` matches this.
"""
from __future__ import annotations

import yaml

from stages.registry import STAGES

OUTPUT_DIR = "artifacts"  # dvc.yaml describes the default run.output_dir


def dvc_stages(output_dir: str = OUTPUT_DIR) -> dict:
    out = {}
    for spec in STAGES.values():
        out[spec.name] = {
            "cmd": f"python -m stages {spec.name}",
            "deps": [*spec.code(), *(f"{output_dir}/{u}" for u in spec.upstream)],
            "params": list(spec.params),
            "outs": [f"{output_dir}/{spec.name}"],
            "metrics": [{f"{output_dir}/metrics/{spec.name}.json": {"cache": False}}],
        }
    return {"stages": out, "plots": dvc_plots(output_dir)}


def dvc_plots(output_dir: str = OUTPUT_DIR) -> list:
    """`dvc plots show` of stage evaluate's plot data (see stages/metrics/report.py) and its PNGs."""
    plots = f"{output_dir}/evaluate/plots"
    return [
        {"training_loss": {"x": "step", "y": {f"{plots}/loss_{s}.json": "loss" for s in ("sft", "reward", "policy")},
                           "title": "Training loss per stage"}},
        {f"{plots}/accuracy.json": {"x": "model", "y": "accuracy", "template": "bar_horizontal",
                                    "title": "Held-out accuracy per stage"}},
        *(f"{plots}/{name}.png" for name in ("loss_curves", "reward_distribution", "accuracy")),
    ]


def render_dvc_yaml(output_dir: str = OUTPUT_DIR) -> str:
    header = "# Generated from stages/registry.py by `python -m stages dvc-yaml > dvc.yaml`; do not edit by hand.\n"
    return header + yaml.safe_dump(dvc_stages(output_dir), sort_keys=False, width=120)
