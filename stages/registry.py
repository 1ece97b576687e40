"""The pipeline's stages: what each one runs, reads and depends on.

One entry per stage. The Prefect flow, `python -m stages <stage>` and `dvc.yaml` are all
derived from this table, so a stage's upstream outputs, the params it reads and the code
it depends on are declared exactly once. Adding a stage = one module under
`stages/pipeline/`, one entry here, one thin task under `tasks/`, one line in the flow.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageSpec:
    name: str
    entry: str  # "module:function" called with a StageContext, returns the stage's metrics
    upstream: tuple[str, ...]  # stages whose outputs this one reads
    params: tuple[str, ...]  # dotted params keys (sections or leaves) this stage reads
    code: tuple[str, ...]  # repo-relative files/folders whose content is part of the fingerprint

    @property
    def summary(self) -> str:
        return f"{self.name} <- {', '.join(self.upstream) or '(sources)'}"


# Everything a stage's outputs depend on; a change in any of these files makes it stale.
MODEL_CODE = ("stages/models.py", "stages/builtin")
DATA_CODE = ("stages/data",)
TRAINING_CODE = ("stages/pipeline/training.py", "stages/trainers", "stages/losses.py", "stages/kernels.py",
                 "stages/utils.py", "stages/rewards.py")
GENERATION_CODE = ("stages/generation", "stages/rewards.py", "stages/trainers/reward.py")
MODEL_LOADING = ("model.dtype", "model.trust_remote_code")

STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in [
        StageSpec(
            name="preprocess",
            entry="stages.pipeline.preprocess:run",
            upstream=(),
            params=("model", "data", "preprocess", "run.seed"),
            code=("stages/pipeline/preprocess.py", *DATA_CODE, *MODEL_CODE),
        ),
        StageSpec(
            name="sft",
            entry="stages.pipeline.sft:run",
            upstream=("preprocess",),
            params=("model", "sft", "run.seed"),
            code=("stages/pipeline/sft.py", *TRAINING_CODE, *DATA_CODE, *MODEL_CODE),
        ),
        StageSpec(
            name="reward",
            entry="stages.pipeline.reward:run",
            upstream=("preprocess", "sft"),
            params=(*MODEL_LOADING, "reward", "run.seed"),
            code=("stages/pipeline/reward.py", *TRAINING_CODE, *DATA_CODE, *MODEL_CODE),
        ),
        StageSpec(
            name="score",
            entry="stages.pipeline.score:run",
            upstream=("preprocess", "sft", "reward"),
            params=(*MODEL_LOADING, "score", "run.seed"),
            code=("stages/pipeline/score.py", "stages/pipeline/prompts.py", "stages/utils.py", *GENERATION_CODE,
                  *DATA_CODE, *MODEL_CODE),
        ),
        StageSpec(
            name="reference",
            entry="stages.pipeline.reference:run",
            upstream=("preprocess", "sft", "score"),
            params=(*MODEL_LOADING, "policy.method", "policy.data", "policy.dpo.reference_free",
                    "policy.dpo.precompute_ref_log_probs", "policy.dpo.max_length"),
            code=("stages/pipeline/reference.py", "stages/pipeline/prompts.py", "stages/trainers/dpo.py",
                  "stages/trainers/logprobs.py", "stages/kernels.py", *DATA_CODE, *MODEL_CODE),
        ),
        StageSpec(
            name="policy",
            entry="stages.pipeline.policy:run",
            upstream=("preprocess", "sft", "reward", "score", "reference"),
            params=(*MODEL_LOADING, "policy", "run.seed"),
            code=("stages/pipeline/policy.py", "stages/pipeline/prompts.py", *TRAINING_CODE, "stages/generation",
                  "stages/rewards.py", *DATA_CODE, *MODEL_CODE),
        ),
        StageSpec(
            name="merge",
            entry="stages.pipeline.merge:run",
            upstream=("preprocess", "sft", "policy"),
            params=("model", "merge", "run.seed"),
            code=("stages/pipeline/merge.py", "stages/merge.py", *DATA_CODE, *MODEL_CODE),
        ),
        StageSpec(
            name="evaluate",
            entry="stages.pipeline.evaluate:run",
            upstream=("preprocess", "sft", "reward", "score", "policy", "merge"),
            params=("model", "evaluate", "run.seed"),
            code=("stages/pipeline/evaluate.py", "stages/metrics", "stages/merge.py", "stages/utils.py",
                  *GENERATION_CODE, *DATA_CODE, *MODEL_CODE),
        ),
    ]
}


def get_stage(name: str) -> StageSpec:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    return STAGES[name]


def downstream_of(name: str) -> list[str]:
    """`name` and every stage that (transitively) reads its outputs, in pipeline order."""
    hit = {name}
    for stage in STAGES.values():
        if hit & set(stage.upstream):
            hit.add(stage.name)
    return [s for s in STAGES if s in hit]
