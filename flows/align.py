"""The `align` flow: the pipeline as a DAG of cached, versioned stages.

    preprocess -> sft -> reward -> score -> reference -> policy -> merge -> evaluate [-> promote]

(reward: the reward model with its quality gate; score: SFT samples scored into pairs;
reference: the reference log-probs of the DPO pairs, cached apart from the policy's params;
merge: the policy's adapter merged into a full model; promote, with `promote=True` as in the
nightly deployment: the merged model replaces models/production only if it is better.)

Each task finishes "Cached" when its stage's output folder is current (same params, code
and inputs, files intact), so rerunning the flow only executes what changed downstream of
a change. Run it with `align run`, or through the deployments (`align serve`, then
`prefect deployment run align/full`). With `run.parallel_shards` > 1, score's prompt shards and
evaluate's models are first computed by that many shard tasks at once (tasks/shards.py).
"""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from flows.dvc_sync import record_in_dvc_lock
from flows.promote import promote as promote_task
from stages.config import load_params
from tasks.evaluate import evaluate
from tasks.merge import merge
from tasks.policy import policy
from tasks.preprocess import preprocess
from tasks.reference import reference
from tasks.reward import reward
from tasks.score import score
from tasks.sft import sft
from tasks.shards import fan_out


# Runs the shard tasks (run.parallel_shards: that many at once); on a cluster, e.g.
# align.with_options(task_runner=DaskTaskRunner(address=...)) (prefect-dask; README "Scale out").
@flow(name="align", task_runner=ThreadPoolTaskRunner())
def align(params_file: str = "params.yaml", overrides: list[str] | None = None, promote: bool = False
          ) -> dict[str, Any]:
    """Run the pipeline on `params_file` with `overrides` (["sft.learning_rate=1e-4", ...]); `promote`: then the
    promotion gate (stages/promotion.py)."""
    params = load_params(params_file, overrides or [])  # every params problem, before any compute

    runs = {}

    def after(*names: str) -> list[dict]:  # upstream manifests: the DAG edges; a failed one stops here
        return [runs[n].result() for n in names]

    runs["preprocess"] = preprocess(params, return_state=True)
    runs["sft"] = sft(params, after("preprocess"), return_state=True)
    runs["reward"] = reward(params, after("preprocess", "sft"), return_state=True)
    runs["score"] = score(params, fan_out("score", params, after("preprocess", "sft", "reward")), return_state=True)
    runs["reference"] = reference(params, after("preprocess", "sft", "score"), return_state=True)
    runs["policy"] = policy(params, after("preprocess", "sft", "reward", "score", "reference"), return_state=True)
    runs["merge"] = merge(params, after("preprocess", "sft", "policy"), return_state=True)
    runs["evaluate"] = evaluate(params, fan_out("evaluate", params, after("preprocess", "sft", "reward", "score",
                                                                          "policy", "merge")), return_state=True)

    summary = summarise(runs)
    if promote:
        summary["promotion"] = promote_task(params, after("evaluate"))
    record_in_dvc_lock(params_file, params.run.output_dir, overrides,
                       executed=any(s["status"] == "executed" for s in summary["stages"]))
    create_table_artifact(key="align-run", table=summary["stages"], description="stages of this run")
    get_run_logger().info("evaluation: %s", summary["evaluation"])
    return summary


def summarise(runs: dict) -> dict[str, Any]:
    stages = []
    for name, state in runs.items():
        manifest = state.result()
        stages.append({"stage": name, "status": "cached" if state.name == "Cached" else "executed",
                       "fingerprint": manifest["fingerprint"], "wall_time_s": manifest["wall_time_s"]})
    evaluation = runs["evaluate"].result().get("metrics", {}).get("table", [])
    return {"stages": stages, "evaluation": evaluation}
