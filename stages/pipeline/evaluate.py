"""Stage `evaluate`: every model of the pipeline on the held-out prompts, one comparison table.

Rows: base (with `evaluate.baseline`), sft, policy (absent with policy.method: none) and merged (the model
that is served and promoted; it should equal the policy row within noise). Completions come from
`stages.generation` (greedy, beam or sampled: `evaluate.decoding`, seeded by run.seed); when the policy section
names tools (`policy.grpo.tools`), every model answers through them, in the episodes the policy trains on
(`stages.pipeline.tool_answers`: the answer is the last turn, the report shows the transcript). Columns
(`evaluate.metrics`): accuracy (exact match of `answer_regex`), bleu and rouge (metric modules shipped in
`stages/metrics/`), reward (stage `reward`'s model), win_rate (that same reward model prefers the row's
completion to the SFT model's; ties 1/2: the policy was trained against it, so it is not an outside
opinion), format (a closed reasoning block and an answer), length. Judged from outside the pipeline:
`lm_eval.<task>.<metric>` (lm-evaluation-harness tasks, `evaluate.lm_eval`, `stages.evaluation.lm_eval`)
and `judge.win_rate` / `judge.lc_win_rate` with their intervals (a pairwise judge that is not our reward
model, `evaluate.judge`, `stages.evaluation.judge`). `evaluate.split` picks `eval` (the reported table,
what promotion compares) or `dev` (what tuning selects on, so eval stays unseen).
Writes `metrics.json`, `predictions.jsonl`, `completions.jsonl` (the first `evaluate.log_completions` prompts
with every model's completion, reward, judge verdict and correctness, also in `report.md` and sent to the
trackers), `plots/`, `lm_eval_tasks/` and `report.md`. Everything is computed before anything is written:
a judge that stays down fails the stage with no metrics.

Each model's outputs are saved in the work folder as soon as they are generated: a rerun after a crash skips
the models already done, and `run_shard` generates a share of the models apart (another process or machine).

    python -m stages evaluate [--set evaluate.decoding=beam] [--set evaluate.max_samples=100]
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stages import generation, trackers
from stages.basics import Progress
from stages.completion_text import THINK_TAGS, answer_after_reasoning
from stages.data import DataError, read_jsonl, write_jsonl
from stages.evaluation import judge
from stages.generation import SamplingParams
from stages.harness.artifacts import write_json_atomic
from stages.harness.model_paths import resolve_model
from stages.models import load_causal_lm, load_tokenizer, pick_device
from stages.openai_client import EndpointError
from stages.pipeline import tool_answers

REFERENCE_METRICS = ("accuracy", "bleu", "rouge")


def run(ctx) -> dict[str, Any]:
    p, e = ctx.params, ctx.params.evaluate
    device = pick_device(p.run.device)
    rows = eval_rows(ctx)
    tasks = lm_eval_tasks(ctx)  # an unknown task or a dataset missing offline fails here, before any model loads
    template = judge.read_template(e.judge.prompt_file) if e.judge.enabled else None
    reward_path = ctx.inputs["reward"] / "model"
    reward_path = str(reward_path) if reward_path.is_dir() and {"reward", "win_rate"} & set(e.metrics) else None
    models = candidates(ctx)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    progress = Progress(ctx.log, total=len(models), unit="models", what="evaluate:")
    outputs = {}
    for label, (path, base) in models.items():
        outputs[label] = model_outputs(ctx, label, path, base, rows, device)
        progress.advance(1)
    progress.finish()
    timings["generation_s"] = round(time.perf_counter() - started, 2)

    started = time.perf_counter()
    benchmarks = {label: run_lm_eval(ctx, path, base, tasks, device) for label, (path, base) in models.items()
                  } if tasks else {}
    timings["lm_eval_s"] = round(time.perf_counter() - started, 2)
    rewards = score_rewards(rows, outputs, reward_path, device) if reward_path else {}
    started = time.perf_counter()
    judged = run_judge(ctx, rows, outputs, template, device) if template is not None else {}
    timings["judge_s"] = round(time.perf_counter() - started, 2)

    table, predictions = [], []
    pattern = re.compile(e.answer_regex) if e.answer_regex else None
    for label, out in outputs.items():
        row, preds = row_metrics(rows, out, e.metrics, pattern, rewards.get(label), rewards.get("sft"))
        row.update(benchmarks.get(label, {}))
        if label in judged:
            row.update(judged[label]["columns"])
            for pred, score in zip(preds, judged[label]["scores"], strict=True):
                pred["judge"] = score
        table.append({"model": label, **row, "split": e.split})
        predictions += [{"model": label, **pr} for pr in preds]
        ctx.log.info("evaluate: %s %s", label, ", ".join(f"{k}={v}" for k, v in row.items() if v is not None))

    write_jsonl(ctx.out / "predictions.jsonl", predictions)
    (ctx.out / "metrics.json").write_text(json.dumps(table, indent=2))
    from stages.metrics.report import write_headline

    write_headline(p.run.output_dir, table)  # for `dvc metrics show/diff`, tracked by git
    notes = report_notes(e, reward_path, outputs, judged)  # no wall times: the report is reproduced byte for byte
    plots = {}
    if e.plots:
        from stages.metrics import report

        plots = report.write_plots(ctx.out / "plots", table, loss_histories=loss_histories(ctx),
                                   rewards={"score (SFT samples)": score_values(ctx), **rewards})
    from stages.metrics.report import markdown_report

    completions = completions_table(predictions, list(outputs), e.log_completions)
    write_jsonl(ctx.out / "completions.jsonl", completions)
    (ctx.out / "report.md").write_text(markdown_report(table, plots, notes=notes, completions=completions))
    by_model = {r["model"]: r for r in table}
    final = by_model.get("merged", by_model.get("policy", by_model["sft"]))
    metrics = {"accuracy": final.get("accuracy"), "sft_accuracy": by_model["sft"].get("accuracy"),
               "baseline_accuracy": by_model["base"].get("accuracy") if "base" in by_model else None,
               "n": len(rows), "split": e.split, "timings": timings,
               "judge_verdicts": {label: found["verdicts"] for label, found in judged.items()},
               "models": {r["model"]: {k: v for k, v in r.items() if k != "model"} for r in table}, "table": table}
    trackers.log_stage_metrics(p, "evaluate", metrics)  # into the pipeline run of the training stages' trackers
    trackers.log_table(p, "evaluate", "completions", completions, folder=ctx.out)
    return metrics


# --------------------------------------------------------------------------- lm-eval and the judge


def lm_eval_tasks(ctx) -> list:
    """The `--tasks` arguments of evaluate.lm_eval.tasks (the shipped ones written into the stage's output,
    `lm_eval_tasks/`, so the CLI can rerun them), registry datasets checked; [] when off."""
    le = ctx.params.evaluate.lm_eval
    if not le.tasks:
        return []
    from stages.evaluation import lm_eval

    specs = lm_eval.task_specs(le.tasks, folder=ctx.out / "lm_eval_tasks",
                               eval_file=ctx.inputs["preprocess"] / f"{ctx.params.evaluate.split}.jsonl",
                               gsm8k_data=le.gsm8k_data)
    lm_eval.check_datasets(specs)
    return specs


def run_lm_eval(ctx, path: str, base: str | None, specs: list, device: str) -> dict[str, float]:
    """lm-eval's columns of one model; an adapter row is its base with the adapter on (lm-eval's `peft`)."""
    from stages import adapter_merge
    from stages.evaluation import lm_eval

    p, le = ctx.params, ctx.params.evaluate.lm_eval
    folder, adapter = (base, path) if base is not None and adapter_merge.is_adapter(path) else (path, None)
    ctx.log.info("evaluate: lm-eval %s on %s", ", ".join(s.configured for s in specs), path)
    return lm_eval.evaluate_model(folder, specs, adapter=adapter, dtype=p.model.dtype, device=device,
                                  num_fewshot=le.num_fewshot, limit=le.limit, batch_size=le.batch_size,
                                  apply_chat_template=le.apply_chat_template, seed=p.run.seed)


def run_judge(ctx, rows: list[dict], outputs: dict[str, Outputs], template: str, device: str
              ) -> dict[str, dict[str, Any]]:
    """{label: {"columns": judge.* columns, "scores": per-prompt scores}} of every model against the baseline
    row. An endpoint that stays down raises `EndpointError` (endpoint, last error, retries): no metrics written."""
    j = ctx.params.evaluate.judge
    if j.baseline not in outputs:
        raise DataError(f"evaluate.judge.baseline = {j.baseline!r}: no such row in this run ({', '.join(outputs)})")
    ask, client = judge.make_judge(j, device=device, dtype=ctx.params.model.dtype)
    instructions = [judge.instruction_text(r["prompt"]) for r in rows]
    base = outputs[j.baseline]
    found: dict[str, dict[str, Any]] = {}
    for label, out in outputs.items():
        if label == j.baseline:
            continue
        try:
            verdicts = judge.judge_pairs(ask, template, instructions,
                                         [full_text(c, r) for c, r in zip(out.completions, out.reasoning, strict=True)],
                                         [full_text(c, r) for c, r in zip(base.completions, base.reasoning,
                                                                          strict=True)])
        except EndpointError as e:
            if client is None:
                raise
            raise EndpointError(f"evaluate.judge ({label} vs {j.baseline}): {e}; {client.retries} retries in all, "
                                f"over {client.requests} requests; no metrics were written", endpoint=e.endpoint,
                                status=e.status, retries=e.retries) from None
        columns = judge.summary(verdicts, out.lengths, base.lengths, confidence=j.confidence,
                                resamples=j.resamples, seed=ctx.params.run.seed)
        found[label] = {"columns": columns, "scores": verdicts.scores, "verdicts": verdicts.distribution()}
        ctx.log.info("evaluate: judge %s vs %s: win rate %s, LC %s over %d of %d pairs; verdicts %s", label,
                     j.baseline, columns["judge.win_rate"], columns["judge.lc_win_rate"], columns["judge.pairs"],
                     len(rows), judge.distribution_text(found[label]["verdicts"]))
        if verdicts.unparsed:
            ctx.log.warning("evaluate: judge %s vs %s: %d of %d replies named no verdict (first: %r); their pairs "
                            "are left out of the rates", label, j.baseline, verdicts.unparsed, 2 * len(rows),
                            verdicts.unparsed_replies()[0][:200])
    retries = client.retries if client is not None else 0
    for label in found:
        found[label]["columns"]["judge.retries"] = retries
    return found


def completions_table(predictions: list[dict[str, Any]], labels: list[str], limit: int) -> list[dict[str, Any]]:
    """The first `limit` prompts, one row each: prompt, reference, then per model its completion, reward, judge
    verdict (its score against the baseline: 1, 0.5 or 0 per order, averaged) and correctness."""
    by_model = {label: [p for p in predictions if p["model"] == label] for label in labels}
    n = min(limit, len(by_model[labels[0]])) if labels else 0
    rows = []
    for i in range(n):
        first = by_model[labels[0]][i]
        row: dict[str, Any] = {"prompt": judge.instruction_text(first["prompt"]), "reference": first["reference"]}
        for label in labels:
            pred = by_model[label][i]
            row[f"{label} completion"] = pred.get("transcript", pred["completion"])
            for key in ("reward", "judge", "correct"):
                if key in pred:
                    row[f"{label} {key}"] = pred[key]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- models


def run_shard(ctx, shard: int, num_shards: int) -> dict[str, Any]:
    """Generate the outputs of share `shard` of `num_shards` of the models (the k-th candidate when
    k % num_shards == shard) into `ctx.work/outputs/`; the stage's `run` afterwards (same params, so
    the same work folder) finds them saved and only scores them and writes the table.

    Run through `stages.harness.runner.run_shard` (`python -m stages evaluate --shard K --num-shards N`).
    Returns {"models": the labels of this share}.
    """
    device = pick_device(ctx.params.run.device)
    rows = eval_rows(ctx)
    mine = {label: model for k, (label, model) in enumerate(candidates(ctx).items()) if k % num_shards == shard}
    for label, (path, base) in mine.items():
        model_outputs(ctx, label, path, base, rows, device)
    return {"models": list(mine)}


def eval_rows(ctx) -> list[dict]:
    """The rows of the held-out split `evaluate.split` (at most `evaluate.max_samples`), checked before any
    model is loaded."""
    e = ctx.params.evaluate
    path = ctx.inputs["preprocess"] / f"{e.split}.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    if not rows and e.split == "dev":
        raise DataError(f"evaluate.split = dev, but {path} holds no dev rows: set data.builtin.num_dev (built-in "
                        "task) or preprocess.dev_fraction > 0, or give data.dev_source")
    if e.max_samples > 0:
        rows = rows[: e.max_samples]
    check_references(rows, e.metrics, path)
    return rows


def model_outputs(ctx, label: str, path: str, base: str | None, rows: list[dict], device: str) -> Outputs:
    """Model `label`'s outputs on `rows`: from `ctx.work/outputs/<label>.json` when a crashed run or a
    `run_shard` saved them, else generated and saved there (atomically) first."""
    p, e = ctx.params, ctx.params.evaluate
    saved = ctx.work / "outputs" / f"{label}.json"
    if saved.exists():
        ctx.log.info("evaluate: %s outputs reused from %s", label, saved)
        return Outputs(**json.loads(saved.read_text()))
    model, tokenizer = load_model(path, base, dtype=p.model.dtype, device=device,
                                  trust_remote_code=p.model.trust_remote_code)
    settings = tool_answers.tool_settings(p)
    if settings is None:
        out = generate_outputs(model, tokenizer, rows, sampling_params(e, p.run.seed), batch_size=e.batch_size)
    else:
        if label == "base":  # the prompts and calls in the template the pipeline trains with (sft.chat_template_path)
            tokenizer.chat_template = load_tokenizer(str(ctx.inputs["sft"] / "model"),
                                                     trust_remote_code=p.model.trust_remote_code).chat_template
        out = tool_outputs(model, tokenizer, rows, sampling_params(e, p.run.seed), settings, batch_size=e.batch_size,
                           model_name=label)
    del model
    write_json_atomic(saved, asdict(out))
    return out


def candidates(ctx) -> dict[str, tuple[str, str | None]]:
    """label -> (model folder, the base an adapter folder goes on; None: load as is)."""
    p = ctx.params
    sft = str(ctx.inputs["sft"] / "model")
    models: dict[str, tuple[str, str | None]] = {}
    if p.evaluate.baseline:
        models["base"] = (resolve_model(p.model, p.run.output_dir), None)
    models["sft"] = (sft, None)
    if (ctx.inputs["policy"] / "model").is_dir():  # absent with policy.method: none
        models["policy"] = (str(ctx.inputs["policy"] / "model"), sft)
    models["merged"] = (str(ctx.inputs["merge"] / "model"), None)
    return models


def load_model(path: str, base: str | None, *, dtype: str, device: str, trust_remote_code: bool = False):
    """(model, tokenizer). An adapter with a known `base` is loaded on it, unmerged (the adapter model the
    merged row is compared with); other adapters and full models through `load_causal_lm`."""
    from stages import adapter_merge

    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    if base is not None and adapter_merge.is_adapter(path):
        return adapter_merge.load_adapter_model(base, path, dtype=dtype, device=device,
                                        trust_remote_code=trust_remote_code), tokenizer
    return load_causal_lm(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code), tokenizer


def sampling_params(e, seed: int) -> SamplingParams:
    if e.decoding == "beam":
        return SamplingParams(max_new_tokens=e.max_new_tokens, num_beams=e.num_beams, seed=seed)
    if e.decoding == "sample":
        return SamplingParams(max_new_tokens=e.max_new_tokens, do_sample=True, temperature=e.temperature,
                              top_p=e.top_p, top_k=e.top_k, seed=seed)
    return SamplingParams(max_new_tokens=e.max_new_tokens, seed=seed)


@dataclass
class Outputs:
    """One model's completions of the eval prompts (answer part), their reasoning blocks and token lengths."""

    completions: list[str]
    reasoning: list[str | None]
    lengths: list[int]
    transcripts: list[str] | None = None  # answered through tools: each episode's turns, calls and results
    tool_calls: int | None = None  # answered through tools: the calls made


def generate_outputs(model, tokenizer, rows: list[dict], sampling: SamplingParams, *, batch_size: int) -> Outputs:
    gens = generation.generate(model, tokenizer, [r["prompt"] for r in rows], sampling, batch_size=batch_size,
                               progress=True, tools=[r.get("tools") for r in rows])
    return Outputs(gens.completions, gens.reasoning, [len(ids) for ids in gens.completion_ids])


def tool_outputs(model, tokenizer, rows: list[dict], sampling: SamplingParams, settings, *, batch_size: int,
                 model_name: str) -> Outputs:
    """Answers reached through the policy's tools (`stages.pipeline.tool_answers`); lengths count the tool turns."""
    got = tool_answers.answer_with_tools(model, tokenizer, rows, sampling, settings, batch_size=batch_size,
                                         model_name=model_name)
    return Outputs(got.answers, [None] * len(rows), got.lengths, got.transcripts, got.calls)


def generate(model, tokenizer, prompts: list, *, batch_size: int, max_new_tokens: int, seed: int
             ) -> tuple[list[str], list[int]]:
    """Greedy completions (stripped of padding, EOS and reasoning blocks) and their token lengths (EOS included)."""
    gens = generation.generate(model, tokenizer, prompts, SamplingParams(max_new_tokens=max_new_tokens, seed=seed),
                               batch_size=batch_size)
    return gens.completions, [len(ids) for ids in gens.completion_ids]


# --------------------------------------------------------------------------- metrics


def check_references(rows: list[dict], metrics: list[str], path: Path) -> None:
    """Reference metrics need a reference completion in every row: a clear error before any model loads."""
    wanted = [m for m in metrics if m in REFERENCE_METRICS]
    missing = [i for i, r in enumerate(rows) if not r.get("completion")]
    if wanted and missing:
        raise DataError(f"evaluate.metrics includes {wanted}, which need reference completions, but {len(missing)} "
                        f"of {len(rows)} eval rows in {path} have none (first: row {missing[0]}); set "
                        f"data.eval_source to prompts with references, or drop {wanted} from evaluate.metrics")
    if not rows:
        raise DataError(f"{path}: no evaluation rows; check data.eval_source / preprocess.eval_fraction")


def score_rewards(rows: list[dict], outputs: dict[str, Outputs], reward_path: str, device: str
                  ) -> dict[str, list[float]]:
    """The reward model's score of every completion, per model label."""
    from stages.reward_functions import load_reward_function

    fn = load_reward_function("reward_model", reward_model_path=reward_path, device=device, key="evaluate.metrics")
    prompts = [r["prompt"] for r in rows]
    return {label: [float(v) for v in fn(prompts, out.completions, reasoning=out.reasoning)]
            for label, out in outputs.items()}


def row_metrics(rows: list[dict], out: Outputs, metrics: list[str], pattern: re.Pattern | None,
                rewards: list[float] | None, sft_rewards: list[float] | None
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(one table row, per-prompt predictions) of one model's outputs."""
    n = len(rows)
    references = [reference_text(r["completion"]) if r.get("completion") else None for r in rows]
    texts = [full_text(c, r) for c, r in zip(out.completions, out.reasoning, strict=True)]
    preds, correct = [], []
    for i, row in enumerate(rows):
        pred = {"prompt": row["prompt"], "reference": references[i], "completion": texts[i],
                "length": out.lengths[i]}
        if out.transcripts is not None:
            pred["transcript"] = out.transcripts[i]
        if "accuracy" in metrics:
            answer, expected = extract(out.completions[i], pattern), extract(references[i], pattern)
            ok = answer is not None and answer == expected
            correct.append(ok)
            pred.update(answer=answer, expected=expected, correct=ok)
        if rewards is not None:
            pred["reward"] = rewards[i]
        preds.append(pred)
    row = {"n": n}
    if "accuracy" in metrics:
        row["accuracy"] = round(sum(correct) / n, 4)
    if "bleu" in metrics or "rouge" in metrics:
        from stages.metrics import load_metric

        plain_refs = []
        for r in references:
            assert r is not None  # check_references refused rows without one before any model loaded
            plain_refs.append(plain(r))
        if "bleu" in metrics:
            row["bleu"] = round(load_metric("bleu").compute(predictions=[plain(t) for t in texts],
                                                            references=plain_refs)["bleu"], 3)
        if "rouge" in metrics:
            scores = load_metric("rouge").compute(predictions=[plain(t) for t in texts], references=plain_refs,
                                                  rouge_types=["rouge1", "rouge2", "rougeL"])
            row.update({k: round(v, 4) for k, v in scores.items()})
    if "reward" in metrics:
        row["reward"] = round(sum(rewards) / n, 4) if rewards is not None else None
    if "win_rate" in metrics:
        row["win_rate"] = (round(sum(1.0 if a > b else 0.5 if a == b else 0.0
                                     for a, b in zip(rewards, sft_rewards, strict=True))
                                 / n, 4) if rewards is not None and sft_rewards is not None else None)
    if "format" in metrics:
        from stages.reward_functions import reasoning_format

        row["format"] = round(sum(reasoning_format([], out.completions, reasoning=out.reasoning)) / n, 4)
    if "length" in metrics:
        row["mean_completion_tokens"] = round(sum(out.lengths) / n, 2)
    if out.tool_calls is not None:
        row["tool_calls_per_prompt"] = round(out.tool_calls / n, 4)
    return row, preds


def full_text(answer: str, reasoning: str | None) -> str:
    return answer if reasoning is None else f"{THINK_TAGS[0]}{reasoning}{THINK_TAGS[1]}{answer}"


def plain(text: str) -> str:
    """Reasoning tags dropped (they would be free n-gram matches for BLEU/ROUGE), the reasoning kept."""
    return text.replace(THINK_TAGS[0], "").replace(THINK_TAGS[1], " ").strip()


def reference_text(completion: Any) -> str:
    if isinstance(completion, list):
        return completion[-1]["content"]
    return completion


def after_reasoning(text: str) -> str:
    """A reference's answer part, by the reasoning-block policy of `stages.completion_text` ("" if a block is left
    open)."""
    return answer_after_reasoning(text)


def extract(text: str | None, pattern: re.Pattern | None) -> str | None:
    """The answer in `text`: the regex's first group (reasoning blocks already stripped), or the stripped text."""
    if text is None:
        return None
    text = after_reasoning(text)
    if pattern is None:
        return text.strip() or None
    m = pattern.search(text.strip())
    return m.group(1) if m else None


# --------------------------------------------------------------------------- report inputs


def report_notes(e, reward_path: str | None, outputs: dict[str, Outputs], judged: dict[str, Any] | None = None
                 ) -> list[str]:
    split = "eval" if e.split == "eval" else "dev (for model selection; the promotion gate compares on eval)"
    notes = [f"{len(next(iter(outputs.values())).completions)} held-out prompts of split {split}, decoding {e.decoding}"
             + (f" ({e.num_beams} beams)" if e.decoding == "beam" else "") + f", max {e.max_new_tokens} new tokens"]
    if {"reward", "win_rate"} & set(e.metrics) and reward_path is None:
        notes.append("reward and win_rate skipped: stage reward trained no reward model (no preference data)")
    if e.lm_eval.tasks:
        notes.append(f"lm_eval.*: lm-evaluation-harness tasks {', '.join(e.lm_eval.tasks)} (± its stderr)")
    if judged:
        who = e.judge.model or e.judge.model_path
        retries = next(iter(judged.values()))["columns"].get("judge.retries", 0)
        notes.append(f"judge.*: {who} compared each model with {e.judge.baseline} in both orders (ties 1/2); "
                     f"[{e.judge.confidence:.0%} interval]; lc = length-controlled; rates over the pairs read in "
                     "both orders (judge.pairs; judge.unparsed: replies naming no verdict); judge.consistent: share "
                     f"of read pairs whose orders agree; {retries} retried requests")
        notes += [f"judge verdicts, {label} vs {e.judge.baseline}: {judge.distribution_text(found['verdicts'])}"
                  for label, found in judged.items()]
    return notes


def loss_histories(ctx) -> dict[str, list[dict]]:
    """log_history.json of every upstream training stage that wrote one."""
    out = {}
    for stage in ctx.inputs:  # the training stages among them write one
        path = ctx.inputs.get(stage, Path("/nonexistent")) / "log_history.json"
        if path.is_file():
            out[stage] = json.loads(path.read_text())
    return out


def score_values(ctx) -> list[float]:
    path = ctx.inputs["score"] / "scores.jsonl"
    return [r["score"] for r in read_jsonl(path) if r.get("score") is not None] if path.is_file() else []
