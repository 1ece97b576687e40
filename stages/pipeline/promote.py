"""Stage `promote` (on request: the nightly deployment, `align run --promote`, `python -m stages promote`):
the newly merged model replaces production only if it is better.

    models/                       (promote.models_dir)
      releases/<version>/         a copy of every promoted model folder (never modified)
      production -> releases/<version>    the stable pointer (a symlink; from_pretrained("models/production"))
      production.json             what production is: version, metrics, lineage, when, eval_key
      history.jsonl               one line per decision: promoted (with the previous production) or kept

`run(ctx)` is the stage: `run_gate(params)` reads stage evaluate's table and stage merge's model, compares the
candidate row (`promote.candidate`, default merged) with production on `promote.metric`
(higher is better) and promotes only when it is better by more than `promote.min_improvement`.
"Better" is the one-sided lower bound of the improvement at `promote.confidence`, so a lead a few eval
prompts could give does not promote: on a share metric (accuracy, format) Newcombe's bound
(`stages.gates`); on an lm-eval column (`lm_eval.<task>.<metric>`) the difference less z times the
two stderrs lm-eval reports; on `judge.lc_win_rate` the judge (`evaluate.judge`) compares the candidate's
completions with production's itself, and the improvement is that LC win rate − 1/2 with its bootstrap
bound. `decision.json` and history.jsonl record the metric, the improvement, the bound and the method.
Production's value is its recorded one when it was measured on the same evaluation
(`eval_key`: the eval data and evaluate settings); otherwise production is re-evaluated on
the current eval set first. A candidate identical to production (same content hash) is a
no-op, so an unchanged nightly run promotes nothing. With `promote.hub.model_id` set and
HF_TOKEN in the environment, the promoted folder (model card and lineage.json included) is uploaded;
the token is read from the environment only and never written anywhere. The stage's own output
(`decision.json`, sealed by its manifest like every stage's) records the decision; its fingerprint
covers the promote params and merge's and evaluate's outputs, so an unchanged nightly run finds it
current and judges nothing twice (`python -m stages promote --force` judges again).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stages.gates import count_of, difference_lower, z_value
from stages.harness import artifacts, model_card
from stages.harness.runner import output_dir

POINTER, RECORD, HISTORY, RELEASES = "production", "production.json", "history.jsonl", "releases"
COLUMN = {"rouge": "rougeL", "length": "mean_completion_tokens"}  # promote.metric -> evaluate table column
TOKEN_ENV = "HF_TOKEN"


class PromotionError(ValueError):
    pass


@dataclass
class Decision:
    promote: bool
    reason: str
    metric: str
    candidate: float | None
    production: float | None
    # the improvement candidate - production (for the judge: its LC win rate against production - 1/2) and the
    # one-sided lower bound at promote.confidence that decided; None where the values themselves were compared
    improvement: float | None = None
    lower_bound: float | None = None
    confidence: float | None = None
    method: str = "values"  # values | newcombe (shares) | stderr (lm-eval) | judge (LC win rate, bootstrap)


def column(metric: str) -> str:
    return COLUMN.get(metric, metric)


SHARES = ("accuracy", "format")  # metrics that are a share of the eval prompts: judged with a confidence bound


def decide(candidate: float | None, production: float | None, *, metric: str, min_improvement: float,
           n_candidate: int | None = None, n_production: int | None = None, confidence: float = 0.5,
           se_candidate: float | None = None, se_production: float | None = None) -> Decision:
    """Promote when there is no production value, or the candidate is better by more than `min_improvement`
    (higher is better).

    "Better" is the one-sided lower bound of candidate − production at `confidence` where the table gives
    what it takes: for a share metric (SHARES) measured on known counts (the table's `n`), Newcombe's bound
    (`stages.gates.difference_lower`); for an lm-eval metric with its stderrs, difference − z·√(se_c² + se_p²).
    Otherwise (and at confidence 0.5) the values themselves."""
    if candidate is None:
        return Decision(False, f"the candidate has no {metric} value; nothing to compare", metric, None, production)
    if production is None:
        return Decision(True, f"no production model yet; {metric} = {candidate}", metric, candidate, None)
    difference = candidate - production
    lower, method = None, "values"
    if confidence > 0.5 and metric in SHARES and n_candidate and n_production:
        lower, method = difference_lower(count_of(candidate, n_candidate), n_candidate,
                                         count_of(production, n_production), n_production, confidence), "newcombe"
        basis = f"on {n_candidate} prompts against production's {production} on {n_production}"
    elif confidence > 0.5 and se_candidate is not None and se_production is not None:
        lower = difference - z_value(confidence) * math.sqrt(se_candidate ** 2 + se_production ** 2)
        lower, method = lower, "stderr"
        basis = f"(stderr {se_candidate:.3g}) against production's {production} (stderr {se_production:.3g})"
    if lower is not None:
        judged = (f"{metric} {candidate} {basis} (difference {difference:+.4g}; one-sided {confidence:.0%} lower "
                  f"bound {lower:+.4g})")
        extra = dict(improvement=round(difference, 6), lower_bound=round(lower, 6), confidence=confidence,
                     method=method)
        if lower > min_improvement:
            return Decision(True, f"{judged} beats production by more than {min_improvement}", metric, candidate,
                            production, **extra)
        return Decision(False, f"{judged}: not shown better by more than {min_improvement} at {confidence:.0%} "
                        "confidence; production kept (more eval prompts narrow the bound; promote.confidence "
                        "0.5 compares the values themselves)", metric, candidate, production, **extra)
    if difference > min_improvement:
        return Decision(True, f"{metric} {candidate} beats production's {production} by "
                        f"{difference:.4g} > {min_improvement}", metric, candidate, production,
                        improvement=round(difference, 6))
    return Decision(False, f"{metric} {candidate} does not beat production's {production} by more than "
                    f"{min_improvement} (difference {difference:+.4g}); production kept",
                    metric, candidate, production, improvement=round(difference, 6))


def decide_by_judge(lc: float, lower: float, *, metric: str, min_improvement: float, confidence: float) -> Decision:
    """The judge compared the candidate with production itself: the improvement is its LC win rate − 1/2, and
    it is promoted when the one-sided lower bound of that (the bootstrap's) is above `min_improvement`."""
    judged = (f"{metric} {lc:.4g} against production (one-sided {confidence:.0%} lower bound {lower:.4g}; "
              f"improvement over a tie {lc - 0.5:+.4g}, lower bound {lower - 0.5:+.4g})")
    extra = dict(improvement=round(lc - 0.5, 6), lower_bound=round(lower - 0.5, 6), confidence=confidence,
                 method="judge")
    if lower - 0.5 > min_improvement:
        return Decision(True, f"{judged} beats production by more than {min_improvement}", metric, lc, 0.5, **extra)
    return Decision(False, f"{judged}: not shown better by more than {min_improvement}; production kept", metric,
                    lc, 0.5, **extra)


def stderr_of(row: dict[str, Any], col: str) -> float | None:
    """An lm-eval column's stderr in the same row (None for other columns or when lm-eval gave none)."""
    if not col.startswith("lm_eval."):
        return None
    from stages.evaluation.lm_eval import stderr_column

    value = row.get(stderr_column(col))
    return float(value) if isinstance(value, (int, float)) else None


def current(models_dir: str | Path) -> dict[str, Any] | None:
    """production.json, or None when nothing was promoted yet."""
    record = Path(models_dir) / RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def gate(candidate_dir: str | Path, candidate_metrics: dict[str, Any], models_dir: str | Path, *, metric: str,
         min_improvement: float, eval_key: str, lineage: dict[str, Any] | None = None,
         stages: dict[str, dict[str, str]] | None = None,
         evaluate_production: Callable[[str], dict[str, Any]] | None = None, confidence: float = 0.5,
         judge_production: Callable[[str], tuple[float, float]] | None = None) -> dict[str, Any]:
    """Decide, promote if better, record the decision in history.jsonl; returns the decision and production.

    evaluate_production(path) -> table row: re-measures production when its record was made on
    another evaluation (eval_key differs); without it the recorded value is used (and said so).
    `confidence`: see `decide` (the rows' `n` are the counts).
    judge_production(path) -> (LC win rate, its one-sided lower bound): for metric judge.lc_win_rate, the
    judge's comparison of the candidate's completions with production's (`decide_by_judge`).
    """
    from stages.adapter_merge import model_identity

    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    prod = current(models_dir)
    identity = model_identity(candidate_dir)
    col = column(metric)
    now = datetime.now(UTC).isoformat()
    note = ""
    if prod is not None and prod.get("hash") == identity:
        decision = Decision(False, f"the candidate is the production model ({prod['version']}); nothing to do",
                            metric, candidate_metrics.get(col), prod["metrics"].get(col))
    elif prod is not None and col.startswith("judge."):
        if judge_production is None:
            raise PromotionError(f"promote.metric = {metric}: the judge compares the candidate with production "
                                 "itself; set evaluate.judge")
        lc, lower = judge_production(str(models_dir / POINTER))
        decision = decide_by_judge(lc, lower, metric=metric, min_improvement=min_improvement, confidence=confidence)
    else:
        production_value = production_n = None
        production_row: dict[str, Any] = {}
        if prod is not None:
            production_row = prod["metrics"]
            production_value, production_n = prod["metrics"].get(col), prod["metrics"].get("n")
            if prod.get("eval_key") != eval_key:
                if evaluate_production is not None:
                    production_row = evaluate_production(str(models_dir / POINTER))
                    production_value, production_n = production_row.get(col), production_row.get("n")
                    note = " (production re-evaluated on the current eval set)"
                else:
                    note = " (production's value was recorded on another eval set)"
        decision = decide(candidate_metrics.get(col), production_value, metric=metric,
                          min_improvement=min_improvement, n_candidate=candidate_metrics.get("n"),
                          n_production=production_n, confidence=confidence,
                          se_candidate=stderr_of(candidate_metrics, col), se_production=stderr_of(production_row, col))
        decision.reason += note
    event = {"at": now, "event": "promoted" if decision.promote else "kept", **asdict(decision),
             "candidate_hash": identity, "production_version": prod["version"] if prod else None}
    if decision.promote:
        record = release(candidate_dir, models_dir, metrics=candidate_metrics, lineage=lineage, stages=stages,
                         eval_key=eval_key,
                         identity=identity, at=now)
        event.update(version=record["version"], previous=prod)
        prod = record
    with open(models_dir / HISTORY, "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")
    return {"decision": asdict(decision), "production": prod, "event": event["event"]}


def release(candidate_dir: str | Path, models_dir: Path, *, metrics: dict[str, Any], lineage: dict | None,
            stages: dict[str, dict[str, str]] | None = None,
            eval_key: str, identity: str, at: str) -> dict[str, Any]:
    """Copy the model to releases/<version>, repoint `production` at it, rewrite production.json (atomically)."""
    version = f"{at[:19].replace(':', '').replace('-', '')}-{identity.split(':')[-1][:12]}"
    releases = models_dir / RELEASES
    releases.mkdir(parents=True, exist_ok=True)
    final = releases / version
    if not final.is_dir():  # the same version name is the same content (time to the second + content hash)
        tmp = releases / f".{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(candidate_dir, tmp, ignore=shutil.ignore_patterns("manifest.json"))
        model_card.promoted(tmp, row=metrics, lineage_record=lineage, version=version,  # README.md, lineage.json
                            stages=stages)
        os.replace(tmp, final)
    link_tmp = models_dir / f".{POINTER}.tmp"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    link_tmp.symlink_to(Path(RELEASES) / version, target_is_directory=True)
    os.replace(link_tmp, models_dir / POINTER)  # atomic: readers see the old or the new model, never none
    record = {"version": version, "path": str(final), "hash": identity, "promoted_at": at, "metrics": metrics,
              "eval_key": eval_key, "lineage": lineage}
    record_tmp = models_dir / f".{RECORD}.tmp"
    record_tmp.write_text(json.dumps(record, indent=2))
    os.replace(record_tmp, models_dir / RECORD)
    return record


def push_to_hub(model_dir: str | Path, model_id: str | None, *, private: bool = True, env=os.environ
                ) -> dict[str, Any]:
    """Push the promoted folder as it is (weights, tokenizer, model card README.md, lineage.json) with
    huggingface_hub's upload_folder when configured; else say why not.

    The token comes from `env[HF_TOKEN]` and is passed to the call only (never logged or recorded).
    """
    if not model_id:
        return {"pushed": False, "reason": "promote.hub.model_id is not set"}
    token = env.get(TOKEN_ENV)
    if not token:
        return {"pushed": False, "reason": f"{TOKEN_ENV} is not in the environment; set it to push to {model_id}"}
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(model_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(Path(model_dir).resolve()), repo_id=model_id,
                      commit_message=f"align: promote {Path(model_dir).resolve().name}")
    return {"pushed": True, "model_id": model_id}


# --------------------------------------------------------------------------- the pipeline's gate


def eval_key(evaluate_manifest: dict[str, Any]) -> str:
    """What a table value depends on: the eval data and the evaluate settings (not the plots)."""
    params = {k: v for k, v in evaluate_manifest["params"].items()}
    if isinstance(params.get("evaluate"), dict):
        params["evaluate"] = {k: v for k, v in params["evaluate"].items() if k not in ("plots", "baseline")}
    return artifacts.hash_json({"data": evaluate_manifest["inputs"]["preprocess"]["outputs_hash"], "params": params})


def run_gate(params, *, env=os.environ, log=None) -> dict[str, Any]:
    """The gate on the pipeline's outputs: stage evaluate's table, the candidate row's model folder."""
    from stages.adapter_merge import is_adapter  # torch: loaded when the gate runs

    pr = params.promote
    evaluate_dir = output_dir(params, "evaluate")
    ok, why = artifacts.verify(evaluate_dir)
    if not ok:
        raise PromotionError(f"promotion needs stage evaluate's output at {evaluate_dir} ({why}); run the pipeline")
    manifest = artifacts.read_manifest(evaluate_dir)
    split = manifest["params"].get("evaluate", {}).get("split", "eval")
    if split != "eval":  # dev figures are what tuning selected on: only the unseen eval split may promote
        raise PromotionError(f"evaluate.split = {split}: stage evaluate scored the {split} split, which is for model "
                             "selection; the promotion gate compares on eval: rerun with --set evaluate.split=eval")
    table = {r["model"]: r for r in json.loads((evaluate_dir / "metrics.json").read_text())}
    if pr.candidate not in table:
        raise PromotionError(f"promote.candidate = {pr.candidate!r}: not a row of the evaluate table "
                             f"({', '.join(table)})")
    folder = output_dir(params, {"merged": "merge"}.get(pr.candidate, pr.candidate)) / "model"
    if pr.candidate == "base" or not folder.is_dir() or is_adapter(folder):
        raise PromotionError(f"promote.candidate = {pr.candidate!r}: {folder} is not a full model folder; "
                             "promote merged (stage merge's model)")
    lineage_file = output_dir(params, "merge") / "lineage.json"
    lineage = json.loads(lineage_file.read_text()) if pr.candidate == "merged" and lineage_file.is_file() else None
    result = gate(folder, table[pr.candidate], pr.models_dir, metric=pr.metric, min_improvement=pr.min_improvement,
                  eval_key=eval_key(manifest), lineage=lineage, stages={
                      s: {"fingerprint": m["fingerprint"], "outputs_hash": m["outputs"]["hash"]}
                      for s, m in (("merge", artifacts.read_manifest(output_dir(params, "merge")) or {}),
                                   ("evaluate", manifest)) if m},
                  evaluate_production=lambda path: evaluate_production(params, path), confidence=pr.confidence,
                  judge_production=lambda path: judge_production(params, path))
    result["hub"] = (push_to_hub(Path(pr.models_dir) / POINTER, pr.hub.model_id, private=pr.hub.private, env=env)
                     if result["event"] == "promoted" else {"pushed": False, "reason": "nothing promoted"})
    result["report"] = str(evaluate_dir / "report.md")
    if log is not None:
        log.info("promotion: %s: %s", result["event"], result["decision"]["reason"])
    return result


def eval_rows(params) -> list[dict[str, Any]]:
    from stages.data import read_jsonl

    e = params.evaluate
    rows = read_jsonl(output_dir(params, "preprocess") / "eval.jsonl")
    return rows[: e.max_samples] if e.max_samples > 0 else rows


def production_outputs(params, path: str, rows: list[dict[str, Any]]):
    from stages.models import pick_device
    from stages.pipeline import evaluate as ev

    e = params.evaluate
    model, tokenizer = ev.load_model(path, None, dtype=params.model.dtype, device=pick_device(params.run.device),
                                     trust_remote_code=params.model.trust_remote_code)
    return ev.generate_outputs(model, tokenizer, rows, ev.sampling_params(e, params.run.seed), batch_size=e.batch_size)


def evaluate_production(params, path: str) -> dict[str, Any]:
    """The production model's table row on the current eval set (metrics that need no reward model; with an
    lm-eval promote.metric, evaluate.lm_eval's tasks too)."""
    import re
    import tempfile

    from stages.pipeline import evaluate as ev

    e = params.evaluate
    rows = eval_rows(params)
    out = production_outputs(params, path, rows)
    metrics = [m for m in e.metrics if m not in ("reward", "win_rate")]
    pattern = re.compile(e.answer_regex) if e.answer_regex else None
    row = ev.row_metrics(rows, out, metrics, pattern, None, None)[0]
    if column(params.promote.metric).startswith("lm_eval.") and e.lm_eval.tasks:
        from stages.evaluation import lm_eval
        from stages.models import pick_device

        le = e.lm_eval
        with tempfile.TemporaryDirectory() as folder:
            specs = lm_eval.task_specs(le.tasks, folder=Path(folder), gsm8k_data=le.gsm8k_data,
                                       eval_file=output_dir(params, "preprocess") / "eval.jsonl")
            row.update(lm_eval.evaluate_model(path, specs, dtype=params.model.dtype,
                                              device=pick_device(params.run.device), num_fewshot=le.num_fewshot,
                                              limit=le.limit, batch_size=le.batch_size,
                                              apply_chat_template=le.apply_chat_template, seed=params.run.seed))
    return row


def judge_production(params, path: str) -> tuple[float, float]:
    """(LC win rate, its one-sided lower bound at promote.confidence) of the candidate's completions (stage
    evaluate's predictions) against the production model's, by evaluate.judge, both orders asked."""
    from stages.data import read_jsonl
    from stages.evaluation import judge
    from stages.models import pick_device

    e, pr = params.evaluate, params.promote
    if not e.judge.enabled:
        raise PromotionError(f"promote.metric = {pr.metric}: the judge compares the candidate with production; set "
                             "evaluate.judge.base_url (and model) or evaluate.judge.model_path")
    rows = eval_rows(params)
    preds = [p for p in read_jsonl(output_dir(params, "evaluate") / "predictions.jsonl") if p["model"] == pr.candidate]
    if len(preds) != len(rows):
        raise PromotionError(f"stage evaluate's predictions hold {len(preds)} rows of {pr.candidate}, the eval set "
                             f"{len(rows)}: rerun stage evaluate")
    out = production_outputs(params, path, rows)
    from stages.pipeline import evaluate as ev

    ask, _ = judge.make_judge(e.judge, device=pick_device(params.run.device), dtype=params.model.dtype)
    verdicts = judge.judge_pairs(ask, judge.read_template(e.judge.prompt_file),
                                 [judge.instruction_text(r["prompt"]) for r in rows], [p["completion"] for p in preds],
                                 [ev.full_text(c, r) for c, r in zip(out.completions, out.reasoning, strict=True)])
    scores, candidate_lengths, production_lengths = verdicts.kept([p["length"] for p in preds], out.lengths)
    if not scores:
        raise PromotionError(f"promote.metric = {pr.metric}: none of the judge's {2 * len(rows)} replies comparing "
                             f"{pr.candidate} with production named a verdict in both orders (first: "
                             f"{verdicts.unparsed_replies()[0][:200]!r}); use a stronger judge, raise "
                             "evaluate.judge.max_new_tokens or adapt evaluate.judge.prompt_file")
    lc, lower, _ = judge.lc_win_rate(scores, candidate_lengths, production_lengths,
                                     confidence=2 * pr.confidence - 1, resamples=e.judge.resamples,
                                     seed=params.run.seed)
    return lc, lower


def markdown(result: dict[str, Any]) -> str:
    d = result["decision"]
    prod = result.get("production") or {}
    bound = (f"; improvement {d['improvement']:+.4g}, one-sided {d['confidence']:.0%} lower bound "
             f"{d['lower_bound']:+.4g} ({d['method']})" if d.get("lower_bound") is not None else "")
    hub = result["hub"]
    lines = ["## Promotion", "", f"- decision: **{result['event']}**: {d['reason']}",
             f"- metric: {d['metric']}: candidate {d['candidate']}, production {d['production']}{bound}",
             f"- production: {prod.get('version', 'none')} ({prod.get('path', '-')})",
             f"- hub: {'pushed to ' + hub['model_id'] if hub.get('pushed') else hub['reason']}"]
    return "\n".join(lines) + "\n"


def run(ctx) -> dict[str, Any]:
    """The stage: judge, promote if better, and record the decision in the stage's output folder."""
    result = run_gate(ctx.params, log=ctx.log)
    artifacts.write_json_atomic(ctx.out / "decision.json", result)
    production = result.get("production") or {}
    d = result["decision"]
    return {"event": result["event"], "reason": d["reason"], "metric": d["metric"],
            "candidate": d["candidate"], "production": d["production"], "improvement": d.get("improvement"),
            "lower_bound": d.get("lower_bound"), "method": d.get("method"),
            "production_version": production.get("version"), "hub": result["hub"]}
