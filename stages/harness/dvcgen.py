"""Derive `dvc.yaml` from the stage table, so DVC and Prefect see the same dependencies.

Each DVC stage runs the same command as the Prefect task (`python -m stages <stage>`, with the
`python` of the activated project environment), depends on the same code files (the import
closure of the stage's module, file by file), upstream output folders and the user's input files
named in params.yaml, and lists only the params keys that stage reads. Its DVC-cached outputs are
its folder and its flat `metrics/<stage>.json`; evaluate's headline per model
(`metrics/models/<model>.json`, the declared DVC metrics) are small uncached outputs that git
tracks (see .gitignore), so `dvc metrics diff` and `dvc exp show` compare commits and
experiments. A training stage reporting to DVCLive (`report_to: [dvclive]`, stages/trackers.py) writes
`<stage>/dvclive/` inside its output; its metrics.json and plots are declared at the top level, so `dvc
exp show` and `dvc plots diff` show each stage's training curves (regenerate dvc.yaml after changing
report_to). `tests/test_dvc.py` checks that the committed `dvc.yaml` matches this.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from stages.harness.config import Params
from stages.harness.registry import STAGES, TRAINING_STAGES
from stages.metrics.report import headline_paths

OUTPUT_DIR = "artifacts"  # dvc.yaml describes the default run.output_dir


def dvc_stages(output_dir: str = OUTPUT_DIR, params: Params | None = None) -> dict:
    """`params`: the input files it names (StageSpec.inputs: data files, a local model folder) become deps."""
    out: dict[str, dict[str, Any]] = {}
    for spec in STAGES.values():
        out[spec.name] = {
            "cmd": f"python -m stages {spec.name}",
            "deps": [*spec.code(params=params), *(f"{output_dir}/{u}" for u in spec.upstream),
                     *input_files(spec, params)],
            "params": list(spec.params),
            # the flat metrics file cached like the folder: an uncached plain out would turn off DVC's run-cache
            "outs": [f"{output_dir}/{spec.name}", f"{output_dir}/metrics/{spec.name}.json"],
        }
        if spec.name == "evaluate":  # the headline per model: what `dvc metrics show/diff` and `dvc exp show` print
            out[spec.name]["metrics"] = [m for path in headline_paths(output_dir).values()
                                         for m in uncached(path.as_posix())]
    live = dvclive_stages(params)  # their DVCLive files: top-level metrics and plots (not outs of their own)
    return {"stages": out, **({"metrics": [f"{output_dir}/{s}/dvclive/metrics.json" for s in live]} if live else {}),
            "plots": [*dvc_plots(output_dir), *({f"{output_dir}/{s}/dvclive/plots/metrics": {"x": "step"}}
                                                for s in live)]}


def dvclive_stages(params: Params | None) -> list[str]:
    """The training stages that report to DVCLive with these params (stages/trackers.py)."""
    from stages.trackers import stage_trackers

    return [] if params is None else [s for s in TRAINING_STAGES if "dvclive" in stage_trackers(params, s)]


def input_files(spec, params: Params | None) -> list[str]:
    """The files and folders named by the stage's input keys that exist (a builtin or a hub id is no file)."""
    if params is None:
        return []
    from stages.data.hub import local_paths
    from stages.harness.registry import DATA_FILES

    def files(value) -> list[str]:  # a path, or a list with paths among other names (evaluate.lm_eval.tasks)
        values = value if isinstance(value, list) else [value]
        return [v for v in values if isinstance(v, str) and Path(v).expanduser().exists()]

    return [path for key, v in params.select(spec.inputs).items()
            for path in (local_paths(v) if key in DATA_FILES else files(v))]


def uncached(path: str) -> list[dict]:
    """An output git tracks (small metrics files), so a commit or an experiment carries it."""
    return [{path: {"cache": False}}]


def dvc_plots(output_dir: str = OUTPUT_DIR) -> list:
    """`dvc plots show` of stage evaluate's plot data (see stages/metrics/report.py) and its PNGs."""
    plots = f"{output_dir}/evaluate/plots"
    return [
        {"training_loss": {"x": "step", "y": {f"{plots}/loss_{s}.json": "loss" for s in TRAINING_STAGES},
                           "title": "Training loss per stage"}},
        {f"{plots}/accuracy.json": {"x": "accuracy", "y": "model", "template": "bar_horizontal",
                                    "title": "Held-out accuracy per stage"}},
        *(f"{plots}/{name}.png" for name in ("loss_curves", "reward_distribution", "accuracy")),
    ]


def render_dvc_yaml(output_dir: str = OUTPUT_DIR, params: Params | None = None) -> str:
    header = ("# Generated from stages/harness/registry.py by `python -m stages dvc-yaml > dvc.yaml`; "
              "do not edit by hand.\n")
    return header + yaml.safe_dump(dvc_stages(output_dir, params), sort_keys=False, width=120)
