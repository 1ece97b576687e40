"""The pipeline's stages: what each one runs, reads and trains on.

One entry per stage, in pipeline order. Everything else is derived from this table: the
Prefect flow and its tasks (flows/align.py, tasks/stage.py), `python -m stages <stage>`,
`accelerate launch` of the stages that train (stages/harness/launch.py), the work pool
(flows/stage_pool.py) and `dvc.yaml` (stages/harness/dvcgen.py). A stage's code is not listed: it is
the closure of the project modules its entry module imports (`StageSpec.code`, see
`stages.harness.imports`), and that closure is what its fingerprint hashes and `dvc.yaml` depends on.

Adding a stage: its module under `stages/pipeline/` (with `run(ctx)`), one entry here, and
its params section (stages/harness/config.py and params.yaml) if it has new params (docs/architecture.md,
"How to add a stage"). The stages that train are those with `training_rows` (TRAINING_STAGES).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.harness import imports
from stages.harness.artifacts import CODE_ROOT
from stages.harness.config import POLICY_METHODS, TRAINING_SECTIONS, Params
from stages.methods import METHODS
from stages.tools.paths import split_path


@dataclass(frozen=True)
class StageSpec:
    name: str
    entry: str  # "module:function" called with a StageContext, returns the stage's metrics
    upstream: tuple[str, ...]  # stages whose outputs this one reads
    params: tuple[str, ...]  # dotted params keys (sections or leaves) this stage reads
    # "module:function"(ctx, shard, num_shards): computes one share of the stage's independent work into
    # ctx.work (stages.harness.runner.run_shard); the flow fans it out with run.parallel_shards > 1. None: no shares.
    shards: str | None = None
    # "module:function"(params, upstream manifests) -> {"rows", "what", "per_device", "unit", "batch_key"} or
    # None when not counted yet: set for a stage that trains, which `accelerate launch` and the work pool can run.
    training_rows: str | None = None
    # dotted params keys naming the user's files or folders the stage reads (data files, a local model; a list's
    # entries that name files): their content is part of the fingerprint, so editing a data file in place makes
    # the stage stale
    inputs: tuple[str, ...] = ()
    # project modules the stage imports by name ("module:Class" references: stages.methods' trainers), hashed
    # with its code like the modules it imports
    loads: tuple[str, ...] = ()
    # dotted params keys naming functions by import path (policy.grpo.tools): those in this project's modules are
    # the stage's code with these params (a tool in stages/ is hashed and a dvc dep); user modules are the user's,
    # named in the params as the stage reads them
    code_keys: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.entry.partition(":")[0]

    @property
    def trains(self) -> bool:
        return self.training_rows is not None

    def code(self, root: Path = CODE_ROOT, params: Params | None = None) -> tuple[str, ...]:
        """The files (relative to `root`) the stage runs: the import closure of its entry module, of the modules it
        `loads` from this project (a method's trainer in a package of your own is your code, like a reward
        function's module), of RUN_WITH and, with `params`, of the project modules its `code_keys` name."""
        return imports.closures(self.runs(params), root)

    def runs(self, params: Params | None = None) -> tuple[str, ...]:
        """The modules whose import closures are the stage's code (see `code`)."""
        named = [] if params is None else [split_path(path)[0] for key in self.code_keys
                                           for path in params.select((key,)).get(key) or []]
        return tuple(dict.fromkeys((self.module, *(m for m in (*self.loads, *named)
                                                   if m.split(".")[0] in imports.LIBRARY), *RUN_WITH)))


# What stages.harness.runner runs every stage with that shapes its outputs (the seeds drawn before it starts); the
# rest of the harness (runner, launch, registry) decides when a stage runs, not what it computes.
RUN_WITH = ("stages.harness.seeding",)
DATA_FILES = ("data.source", "data.sft", "data.preference", "data.prompts", "data.eval_source", "data.dev_source")
MODEL_LOADING = ("model.dtype", "model.trust_remote_code")  # what loading an upstream model reads
# Read by stages but not declared: where a run writes and what it computes on, not what it computes (the same
# outputs elsewhere count as current; tests/stages/harness/test_registry_params.py checks that nothing else is read).
RUNTIME_KEYS = ("run.output_dir", "run.device", "run.threads",
                # where a run reports (score and evaluate log to the training stages' trackers: stages.trackers)
                "run.report_to", "sft.report_to", "reward.report_to",
                *(f"policy.{m}.report_to" for m in POLICY_METHODS if m != "none"))

# The policy sections that run tools (`ToolKeys`): policy samples episodes that call them, and evaluate answers every
# held-out prompt through the same episodes.
TOOL_SECTIONS = tuple(m.section for m in METHODS.values()
                      if m.policy and "tools" in TRAINING_SECTIONS[m.section].__dataclass_fields__)
TOOL_PATHS = tuple(f"{s}.tools" for s in TOOL_SECTIONS)
TOOL_KEYS = tuple(f"{s}.{key}" for s in TOOL_SECTIONS
                  for key in ("tools", "max_tool_calling_iterations", "tool_timeout", "tool_mode"))

STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in [
        StageSpec(
            name="preprocess",
            entry="stages.pipeline.preprocess:run",
            upstream=(),
            params=("model", "data", "preprocess", "run.seed", "sft.chat_template_path"),
            inputs=(*DATA_FILES, "model.name_or_path", "sft.chat_template_path"),
        ),
        StageSpec(
            name="sft",
            entry="stages.pipeline.sft:run",
            upstream=("preprocess",),
            params=("model", "sft", "run.seed", "run.report_to"),
            inputs=("model.name_or_path", "sft.chat_template_path"),
            training_rows="stages.pipeline.sft:training_rows",
        ),
        StageSpec(
            name="reward",
            entry="stages.pipeline.reward:run",
            upstream=("preprocess", "sft"),
            params=(*MODEL_LOADING, "reward", "run.seed", "run.report_to"),
            inputs=("reward.chat_template_path",),
            training_rows="stages.pipeline.reward:training_rows",
        ),
        StageSpec(
            name="score",
            entry="stages.pipeline.score:run",
            upstream=("preprocess", "sft", "reward"),
            params=(*MODEL_LOADING, "score", "run.seed"),
            inputs=("score.dataset",),
            shards="stages.pipeline.score:run_shard",
        ),
        StageSpec(
            name="reference",
            entry="stages.pipeline.reference:run",
            upstream=("preprocess", "sft", "score"),
            params=(*MODEL_LOADING, "policy.method", "policy.data", "policy.dpo.reference_free",
                    "policy.dpo.precompute_ref_log_probs", "policy.dpo.max_length", "policy.dpo.ld_alpha",
                    # the policy's numerics, which its reference log-probs must share
                    "policy.dpo.mixed_precision", "policy.dpo.lora.enabled", "policy.dpo.lora.quantization"),
        ),
        StageSpec(
            name="policy",
            entry="stages.pipeline.policy:run",
            upstream=("preprocess", "sft", "reward", "score", "reference"),
            params=(*MODEL_LOADING, "policy", "run.seed", "run.report_to"),
            inputs=("policy.dpo.chat_template_path",),
            training_rows="stages.pipeline.policy:training_rows",
            loads=tuple(m.trainer.partition(":")[0] for m in METHODS.values() if m.policy),
            code_keys=TOOL_PATHS,
        ),
        StageSpec(
            name="merge",
            entry="stages.pipeline.merge:run",
            upstream=("preprocess", "sft", "policy"),
            params=("model", "merge", "run.seed"),
            inputs=("model.name_or_path",),
        ),
        StageSpec(
            name="evaluate",
            entry="stages.pipeline.evaluate:run",
            upstream=("preprocess", "sft", "reward", "score", "policy", "merge"),
            params=("model", "evaluate", "run.seed", "policy.method", *TOOL_KEYS),
            # the shipped judge prompt and lm-eval tasks are its code (their modules' CODE_FILES); the user's are inputs
            inputs=("model.name_or_path", "evaluate.lm_eval.tasks", "evaluate.lm_eval.gsm8k_data",
                    "evaluate.judge.prompt_file", "evaluate.judge.model_path"),
            shards="stages.pipeline.evaluate:run_shard",
            code_keys=TOOL_PATHS,
        ),
    ]
}


# Stages that run only when asked for (the nightly deployment, `align run --promote`, `python -m stages <name>`):
# not part of an ordinary run, of `align status` or of dvc.yaml, since they act outside run.output_dir.
ON_REQUEST: dict[str, StageSpec] = {
    "promote": StageSpec(
        name="promote",
        entry="stages.pipeline.promote:run",
        upstream=("merge", "evaluate"),
        # evaluate's and the model's keys: production is re-evaluated when its record came from another eval set
        params=("promote", "evaluate", *MODEL_LOADING, "run.seed"),
    ),
}
ALL_STAGES: dict[str, StageSpec] = {**STAGES, **ON_REQUEST}
TRAINING_STAGES = tuple(s.name for s in STAGES.values() if s.trains)  # each writes a loss curve


def get_stage(name: str) -> StageSpec:
    if name not in ALL_STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(ALL_STAGES)}")
    return ALL_STAGES[name]


def resolve(ref: str) -> Callable[..., Any]:
    """The function a "module:function" reference of a StageSpec names (imports the module)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)
