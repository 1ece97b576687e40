"""Experiment trackers of a pipeline run: which ones, what each run is called, and what reaches them.

`<stage>.report_to` (sft, reward, policy) names the trackers of a training stage; null inherits
`run.report_to`. The names are transformers' (`TRACKERS`); a tracker whose package is missing is
a params problem (`problems`, called by `Params.validate`), found before any model is built.

Every tracker run of one pipeline run shares its name: `<pipeline run>/<stage>`, where the
pipeline run (`pipeline_run`) is, in this order:
- `$ALIGN_PIPELINE_RUN`: the `align` flow sets it to `align-<flow run name>` for its stages and
  their subprocesses (accelerate launch, shards);
- `align-<experiment>` under `dvc exp run` (DVC sets `$DVC_EXP_NAME` for the stage commands);
- otherwise `align-p<8 hex>`, a hash of the resolved params but `run` (`python -m stages <stage>`, `dvc repro`):
  stages run one by one with the same params land in the same pipeline run.

What each tracker gets:
- MLflow (`MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME`, default experiment `align`): one parent run
  per pipeline run (tag `align.pipeline_run`) holding the resolved params (dotted keys) and the
  `score` / `evaluate` metrics (`log_stage_metrics`), and one nested run per training stage, logged by
  transformers' MLflowCallback (the TrainingArguments and model config as params, the training curves).
- DVCLive: `dvclive/` inside the stage's output (metrics.json, params.yaml, plots/metrics/*.tsv);
  `align dvc-yaml` declares them as top-level metrics and plots, so `dvc exp show` and `dvc plots diff`
  show each stage's curves. A log like tensorboard/ (`stages.harness.artifacts.LOGS`): kept out of the outputs hash.
- TensorBoard: `tensorboard/` inside the stage's output.
- W&B: the run is named `<pipeline run>/<stage>` in the group `<pipeline run>` (project `$WANDB_PROJECT`,
  default `align`); score/evaluate metrics go into a run `<pipeline run>/<stage>` of the same group.
- Trackio, Comet, ClearML: through transformers' own callbacks, with `run_name` `<pipeline run>/<stage>`
  (Trackio's project: `align`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow import ActiveRun

# report_to name -> (module transformers imports, pip requirement)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow==3.17.2"),
    "trackio": ("trackio", "trackio"),
    "dvclive": ("dvclive", "dvclive==3.49.1"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "clearml": ("clearml", "clearml"),
}
EXTRA = {"mlflow", "dvclive"}  # in the project's `trackers` extra
BUILT_HERE = ("tensorboard", "mlflow", "dvclive", "wandb")  # callbacks made by `callbacks`; the rest by transformers
RUN_ENV = "ALIGN_PIPELINE_RUN"
PROJECT = "align"  # MLflow experiment, W&B and Trackio project unless their own variables say otherwise


# --------------------------------------------------------------------------- names and validation


def normalise(value: str | list[str] | None) -> list[str] | None:
    """report_to as a list of names: "mlflow" -> ["mlflow"], "none" / [] -> [], None stays None (inherit)."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value)
    return [] if names in ([], ["none"]) else names


def resolve(section_value: str | list[str] | None, run_value: str | list[str] | None) -> list[str]:
    """The trackers of a training stage: its section's report_to, or run.report_to when that is null."""
    own = normalise(section_value)
    return own if own is not None else (normalise(run_value) or [])


def sections(params) -> dict[str, tuple[str, Any]]:
    """{training stage: (its params key, its section)} of the stages this run trains: sft, reward and the
    policy's method section (policy.<method>; none with policy.method none)."""
    return params.training_sections()


def stage_trackers(params, stage: str) -> list[str]:
    found = sections(params).get(stage)
    return [] if found is None else resolve(found[1].report_to, params.run.report_to)


def pipeline_trackers(params) -> list[str]:
    """Every tracker the training sections of this run report to (where score/evaluate metrics go too). Every
    policy.<method> section counts, so these stages read report_to keys only (registry.RUNTIME_KEYS), not
    policy.method."""
    policy = [getattr(params.policy, f.name) for f in dataclasses.fields(params.policy)  # the method sections
              if f.default_factory is not dataclasses.MISSING]
    found = [params.sft, params.reward, *(s for s in policy if hasattr(s, "report_to"))]
    return sorted({name for s in found for name in resolve(s.report_to, params.run.report_to)})


def problems(params) -> list[tuple[str, str]]:
    """(dotted key, message) for every report_to naming an unknown tracker or one whose package is missing."""
    keys = [("run.report_to", params.run.report_to),
            *((f"{key}.report_to", section.report_to) for key, section in sections(params).values())]
    return [found for key, value in keys for found in problems_of(value, key)]


def problems_of(value: str | list[str] | None, key: str) -> list[tuple[str, str]]:
    names = normalise(value)
    if names is None:
        return []
    out = []
    if "none" in names:
        out.append((key, f"= {value!r}: none cannot be combined with trackers; give [] or none for no tracker"))
    for name in (n for n in names if n != "none"):
        if name not in TRACKERS:
            out.append((key, f"= {value!r}: unknown tracker {name!r}; supported: {', '.join(TRACKERS)}, none"))
        elif importlib.util.find_spec(TRACKERS[name][0]) is None:
            extra = " (or pip install -e '.[trackers]')" if name in EXTRA else ""
            out.append((key, f"includes {name!r} but its package is not installed: pip install "
                        f"{TRACKERS[name][1]}{extra}, or remove {name} from {key}"))
    return out


def pipeline_run(params) -> str:
    """The name every tracker run of this pipeline run shares (see the module docstring)."""
    if os.environ.get(RUN_ENV):
        return os.environ[RUN_ENV]
    if os.environ.get("DVC_EXP_NAME"):
        return f"align-{os.environ['DVC_EXP_NAME']}"
    resolved = params.to_dict()
    resolved["run"] = {"seed": params.run.seed}  # the rest of run says where and how it runs, not what it computes
    for section in (resolved["sft"], resolved["reward"], *resolved["policy"].values()):
        if isinstance(section, dict):  # policy.<method>
            section.pop("report_to", None)
    digest = hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()
    return f"align-p{digest[:8]}"


def run_name(params, stage: str) -> str:
    return f"{pipeline_run(params)}/{stage}"


def tracker_args(ctx, section_name: str, report_to: str | list[str] | None) -> dict[str, Any]:
    """TrainingArguments keywords of the trackers: the ones transformers builds itself (`report_to`; those in
    BUILT_HERE come from `callbacks`), the run's name and Trackio's project."""
    names = resolve(report_to, ctx.params.run.report_to)
    args: dict[str, Any] = {"report_to": [n for n in names if n not in BUILT_HERE] or "none"}
    if set(names) - {"tensorboard", "dvclive"}:  # trackers with named runs (the name reads every param)
        stage = ctx.stage or section_name.partition(".")[0]  # policy.dpo: stage policy
        args.update(run_name=run_name(ctx.params, stage), project=os.environ.get("TRACKIO_PROJECT", PROJECT))
    return args


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"sft": {"lora": {"r": 16}}} -> {"sft.lora.r": 16}; lists stay values."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# --------------------------------------------------------------------------- training callbacks


def callbacks(ctx, stage: str, report_to: str | list[str] | None) -> list:
    """The tracker callbacks of training stage `stage` that are made here (BUILT_HERE), in report_to's order."""
    made = []
    for name in resolve(report_to, ctx.params.run.report_to):
        if name == "tensorboard":
            made.append(_tensorboard_callback(ctx.work / "tensorboard"))
        elif name == "mlflow":
            made.append(_mlflow_callback(ctx.params, stage))
        elif name == "dvclive":
            made.append(_dvclive_callback(ctx.out / "dvclive"))
        elif name == "wandb":
            made.append(_wandb_callback(ctx.params))
    return made


def finish(trainer) -> None:
    """End the tracker runs the callbacks opened (after the stage's last log: its final evaluation)."""
    for cb in trainer.callback_handler.callbacks:
        if hasattr(cb, "finish_stage"):
            cb.finish_stage()


def _tensorboard_callback(log_dir: Path):
    """TensorBoard logs into `log_dir` (transformers' own callback otherwise writes under output_dir/runs);
    training.save_outputs copies them into the stage's output."""
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    return TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(log_dir)))


def _mlflow_callback(params, stage: str):
    from transformers.integrations import MLflowCallback

    class NestedMLflow(MLflowCallback):
        """transformers' MLflowCallback in a run nested under the pipeline run's parent (`mlflow_parent`).

        The nested run is started here with `parent_run_id`; the callback then finds it active and logs the
        TrainingArguments, the model config and every log line into it. It stays open past training (a
        final `trainer.evaluate()` logs into it too) and is ended by `finish_stage`."""

        _stage_run: ActiveRun | None

        def setup(self, args, state, model):
            if state.is_world_process_zero and not self._initialized:
                import mlflow

                active = mlflow.active_run()
                if active is not None and active.data.tags.get("align.role") == "stage":
                    mlflow.end_run("FAILED")  # this thread's previous stage raised before finish_stage
                experiment, parent = mlflow_parent(params)
                self._stage_run = mlflow.start_run(
                    experiment_id=experiment, run_name=args.run_name, nested=True, parent_run_id=parent,
                    tags={"align.pipeline_run": pipeline_run(params), "align.stage": stage, "align.role": "stage"})
                key, section = sections(params)[stage]
                log_params(self._stage_run.info.run_id, flat({key: dataclasses.asdict(section)}))  # policy.dpo.beta
            super().setup(args, state, model)

        def on_train_end(self, args, state, control, **kwargs):
            pass  # finish_stage ends the run

        def finish_stage(self):
            run = getattr(self, "_stage_run", None)
            if run is not None:
                import mlflow

                mlflow.flush_async_logging()
                mlflow.end_run()
                self._stage_run = None

    return NestedMLflow()


def _dvclive_callback(folder: Path):
    from transformers.integrations import DVCLiveCallback

    class StageDVCLive(DVCLiveCallback):
        """transformers' DVCLiveCallback writing into the stage's output folder; DVC declares the files
        (`align dvc-yaml`), so DVCLive itself writes no dvc.yaml and makes no experiment."""

        def setup(self, args, state, model):
            if state.is_world_process_zero and self.live is None:
                from dvclive import Live

                self.live = Live(dir=str(folder), save_dvc_exp=False, dvcyaml=None, report=None)
            super().setup(args, state, model)

        def on_log(self, args, state, control, model=None, logs=None, **kwargs):
            if self.live is not None:
                self.live.step = state.global_step  # the trainer's step on the x-axis, not a count of log calls
            super().on_log(args, state, control, model=model, logs=logs, **kwargs)

        def on_train_end(self, args, state, control, **kwargs):
            pass  # finish_stage ends it, after the final evaluation's log line

        def finish_stage(self):
            if self.live is not None:
                self.live.end()
                self.live = None

    return StageDVCLive()


def _wandb_callback(params):
    from transformers.integrations import WandbCallback

    class GroupedWandb(WandbCallback):
        """transformers' WandbCallback in a run named `<pipeline run>/<stage>`, grouped by the pipeline run."""

        def setup(self, args, state, model, **kwargs):
            if state.is_world_process_zero and self._wandb.run is None:
                self._wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=args.run_name,
                                 group=pipeline_run(params), reinit="finish_previous")
            super().setup(args, state, model, **kwargs)

        def finish_stage(self):
            if self._wandb.run is not None:
                self._wandb.finish()

    return GroupedWandb()


# --------------------------------------------------------------------------- MLflow's parent run


def mlflow_parent(params) -> tuple[str, str]:
    """(experiment id, run id) of the pipeline run's parent run, created with the resolved params when missing."""
    from mlflow import MlflowClient

    client = MlflowClient()
    name = pipeline_run(params)
    experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
    experiment = client.get_experiment_by_name(experiment_name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
    found = client.search_runs([experiment_id], max_results=1, filter_string=(
        f"tags.`align.pipeline_run` = '{name}' and tags.`align.role` = 'pipeline'"))
    if found:
        return experiment_id, found[0].info.run_id
    run = client.create_run(experiment_id, run_name=name, tags={"align.pipeline_run": name, "align.role": "pipeline"})
    log_params(run.info.run_id, flat(params.to_dict()))
    client.set_terminated(run.info.run_id)
    return experiment_id, run.info.run_id


def log_params(run_id: str, values: dict[str, Any]) -> None:
    """`values` as MLflow params (as text, cut to MLflow's length limit), in batches of MLflow's size."""
    from mlflow import MlflowClient
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    items = [Param(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v)) for k, v in sorted(values.items())]
    items = [Param(p.key, p.value[:MAX_PARAM_VAL_LENGTH]) for p in items]
    for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        MlflowClient().log_batch(run_id, params=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])


# --------------------------------------------------------------------------- score / evaluate metrics


def log_stage_metrics(params, stage: str, metrics: dict[str, Any]) -> list[str]:
    """A non-training stage's scalar `metrics` into the pipeline run of every tracker the run uses (MLflow: the
    parent run, keys `<stage>.<metric>`; W&B: a run of the group). Returns the trackers written to."""
    scalars = {f"{stage}.{k}": float(v) for k, v in flat(metrics).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    names = pipeline_trackers(params)
    written = []
    if "mlflow" in names and scalars:
        import time

        from mlflow import MlflowClient
        from mlflow.entities import Metric

        _, parent = mlflow_parent(params)
        now = int(time.time() * 1000)
        items = [Metric(k, v, now, 0) for k, v in sorted(scalars.items())]
        for i in range(0, len(items), 1000):
            MlflowClient().log_batch(parent, metrics=items[i:i + 1000])
        written.append("mlflow")
    if "wandb" in names and scalars:
        import wandb

        run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name(params, stage),
                         group=pipeline_run(params), job_type=stage, reinit="finish_previous")
        run.summary.update(scalars)
        run.finish()
        written.append("wandb")
    return written


# --------------------------------------------------------------------------- tables


def log_table(params, stage: str, name: str, rows: list[dict[str, Any]], *, folder: Path | None = None
              ) -> list[str]:
    """A table (rows of equal keys, e.g. evaluate's completions) into every tracker the run uses: MLflow
    `log_table` on the pipeline run's parent run (`<stage>/<name>.json`, the UI's Evaluation/Artifacts tab), a
    W&B Table in a run of the group, DVCLive (`<folder>/dvclive/<name>.json`, logged as an artifact) and
    TensorBoard text (`<folder>/tensorboard`, a markdown table). Returns the trackers written to."""
    names = pipeline_trackers(params)
    if not rows or not names:
        return []
    columns = list(rows[0])
    data = [[_cell(r.get(c)) for c in columns] for r in rows]
    written = []
    if "mlflow" in names:
        import mlflow

        _, parent = mlflow_parent(params)
        mlflow.MlflowClient().log_table(parent, data={c: [row[i] for row in data] for i, c in enumerate(columns)},
                                        artifact_file=f"{stage}/{name}.json")
        written.append("mlflow")
    if "wandb" in names:
        import wandb

        run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name(params, stage),
                         group=pipeline_run(params), job_type=stage, reinit="finish_previous")
        run.log({f"{stage}/{name}": wandb.Table(columns=list[str | int](columns), data=data)})
        run.finish()
        written.append("wandb")
    if "dvclive" in names and folder is not None:
        from dvclive import Live

        live = Live(dir=str(folder / "dvclive"), save_dvc_exp=False, dvcyaml=None, report=None)
        path = folder / "dvclive" / f"{name}.json"
        path.write_text(json.dumps(rows_of(columns, data), indent=1))
        live.log_artifact(str(path), type="table", desc=f"{stage}: {name}", cache=False)
        live.end()
        written.append("dvclive")
    if "tensorboard" in names and folder is not None:
        from torch.utils.tensorboard import SummaryWriter

        from stages.markdown import table

        with SummaryWriter(log_dir=str(folder / "tensorboard")) as writer:
            writer.add_text(f"{stage}/{name}", table(rows_of(columns, data)))
        written.append("tensorboard")
    return written


def rows_of(columns: list[str], data: list[list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(columns, row, strict=True)) for row in data]


def _cell(value: Any) -> Any:
    """A table cell trackers accept: numbers and text as they are, None as "", anything else as JSON text."""
    if value is None:
        return ""
    if isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value)
