"""Does alignment work? Every policy method on the built-in task, mean ± sd over seeds, selected on dev.

    python -m benchmarks alignment                          # every method, seeds 1 2 3, default params.yaml
    python -m benchmarks alignment --seeds 1 --methods dpo grpo
    python -m benchmarks alignment --sweep 1 --write sweep-1.md  # tune each method on dev (round 1), the choice on eval
    python -m benchmarks alignment --set policy.dpo.max_steps=50 --output-dir /tmp/align-bench   # resumable

Every stage is the real one (`stages.harness.runner.run_stage`, what every entry point calls), run in
`--output-dir` (default: a temporary folder). `run.seed` is the seed: it governs preprocess's
validation split, SFT's data order, the reward model's head and data order, score's samples,
the policy's initialisation, data order and samples, and evaluate's sampling (none with greedy
decoding). It changes neither the base model (`model.builtin.seed`) nor the task
(`data.builtin.seed`): the eval and dev prompts are the same for every seed. So:

    <output-dir>/builtin/                     the base model, built once for all seeds
    <output-dir>/seed-<s>/shared/             preprocess, sft, reward, score: once per seed
    <output-dir>/seed-<s>/<method>-<config>/  reference, policy, merge, evaluate of one configuration;
                                              the shared stages are links to shared/, and the runner finds
                                              them current (the stage contract), so they never rerun

Default mode: each method with params.yaml's settings, evaluated on the held-out `eval` split
(the reported table) and on `dev` (printed beside it). `--sweep N`: round N of the tuning budget,
the same for every method (ROUNDS below): round 1 tries 2 learning rates × one knob of the method
(4 configurations), round 2 two values of one more knob from round 1's choice, which
params.yaml holds (2 configurations; the one params.yaml holds is the default run's), round 3
each method's learning rate halved, kept and doubled (3 configurations). Every configuration is trained on
every seed and scored on `dev` only; the one with the best mean dev accuracy (the first in order on a tie) is
then scored on `eval`, the only time eval is looked at. `--write FILE` writes the tables (with `--sweep`, every
configuration's dev accuracy) to FILE.

Times are each stage's build time from its manifest (a reused stage keeps the time it was built in). On
2 CPU cores with one torch thread the default run takes about 15 minutes (about 140 s of shared stages per seed,
160 s for the five methods); a sweep round several times that. Several processes can share one `--output-dir`
(`--seeds 2 3` in one, `--seeds 1` in another), and a final run over all seeds reuses every stage.
`--tiny`: one seed on the tiny model and data, a smoke run in seconds.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, host_load, mean_sd, tiny_overrides
from stages.builtin.arithmetic_errors import ERROR_KINDS, error_kind  # noqa: E402
from stages.data import read_jsonl  # noqa: E402
from stages.harness import runner  # noqa: E402
from stages.harness.config import POLICY_METHODS, VERIFIED_FIRST, VERIFIED_FIRST_WEIGHTS  # noqa: E402
from stages.harness.params_loader import load_params, parse_overrides  # noqa: E402
from stages.harness.registry import STAGES  # noqa: E402

# The methods compared with one tuning budget (ROUNDS below). Not yet in it: rloo (tuned like grpo once it has its
# rounds) and distillation (it needs a teacher model, so it is not a like-for-like alternative).
METHODS = tuple(m for m in POLICY_METHODS if m not in ("none", "rloo", "distillation"))
SHARED = ("preprocess", "sft", "reward", "score")  # the stages no policy setting changes
PER_METHOD = ("reference", "policy", "merge", "evaluate")
DEFAULT_SEEDS = (1, 2, 3)

# The tuning budget, the same for every method: 9 configurations in three rounds, each scored on dev over the seeds.
# Round 1: 2 learning rates x 2 values of one knob (keys under policy.<method>.). Round 2, from round 1's choice
# (params.yaml's settings since): 2 values of one more knob. params.yaml holds each round's choice. A knob naming a
# shared stage's key (score.*) is that key itself: the offline methods' data is sampled by score, so its sampling
# temperature is theirs to tune (the SFT model samples the carry in 11-18% of carry sums where its labels had 30%).
ROUNDS: list[dict[str, dict[str, list[Any]]]] = [
    {"dpo": {"learning_rate": [1e-4, 3e-4], "beta": [0.1, 0.3]},
     "kto": {"learning_rate": [1e-4, 3e-4], "beta": [0.1, 0.3]},
     "online_dpo": {"learning_rate": [1e-4, 3e-4], "beta": [0.1, 0.3]},
     "grpo": {"learning_rate": [1e-4, 1.5e-4], "num_generations": [4, 8]},
     "ppo": {"learning_rate": [1.5e-5, 3e-5], "kl_coef": [0.02, 0.05]}},
    {"dpo": {"score.generation.temperature": [1.0, 1.3]},
     "kto": {"score.generation.temperature": [1.0, 1.3]},
     "online_dpo": {"rewards": ["reward_model", "exact_match+reward_model"]},
     "grpo": {"temperature": [1.0, 1.2]},
     "ppo": {"rewards": ["reward_model", "exact_match+reward_model"]}},
    # Round 3, after the SFT trunk went from 2 to 3 epochs and the reward model to batch 8 (every method's data and
    # start changed): each method's learning rate halved, kept and doubled.
    {"dpo": {"learning_rate": [5e-5, 1e-4, 2e-4]},
     "kto": {"learning_rate": [5e-5, 1e-4, 2e-4]},
     "online_dpo": {"learning_rate": [5e-5, 1e-4, 2e-4]},
     "grpo": {"learning_rate": [7.5e-5, 1.5e-4, 3e-4]},
     "ppo": {"learning_rate": [7.5e-6, 1.5e-5, 3e-5]}},
]
# Named values of knobs that set several keys at once: the verifiable reward deciding and the reward model breaking
# ties, as score.reward_functions does, against the reward model alone.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "rewards": {"reward_model": {"reward_functions": ["reward_model"], "reward_weights": None},
                "exact_match+reward_model": {"reward_functions": list(VERIFIED_FIRST),
                                             "reward_weights": list(VERIFIED_FIRST_WEIGHTS)}},
}


def configurations(method: str, round_: int = 1) -> list[dict[str, Any]]:
    """Round `round_`'s configurations of `method`, one {knob: value} each, in a fixed order."""
    grid = ROUNDS[round_ - 1][method]
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def overrides(method: str, config: dict[str, Any]) -> dict[str, Any]:
    """One configuration as params overrides: {"policy.<method>.<key>": value}, presets expanded; a shared
    stage's key (score.*) as it is."""
    out = {}
    for knob, value in config.items():
        for key, v in (PRESETS[knob][value] if knob in PRESETS else {knob: value}).items():
            out[key if key.split(".")[0] in SHARED else f"policy.{method}.{key}"] = v
    return out


def own_stages(config: dict[str, Any]) -> tuple[str, ...]:
    """The shared stages a configuration sets keys of, and every shared stage after the first of them: it runs
    them in its own folder."""
    first = min((SHARED.index(k.split(".")[0]) for k in config if k.split(".")[0] in SHARED), default=len(SHARED))
    return SHARED[first:]


def config_name(config: dict[str, Any]) -> str:
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.items()) or "default"


def effective(params, dotted: str) -> Any:
    """A dotted key's value in force: a method's null training override (policy.<method>.learning_rate, ...)
    falls back to the policy section's."""
    value = params
    for key in dotted.split("."):
        value = getattr(value, key)
    key = dotted.rsplit(".", 1)[-1]
    return getattr(params.policy, key) if value is None and hasattr(params.policy, key) else value


def holds(params, method: str, config: dict[str, Any]) -> bool:
    """`params` (params.yaml and the --set overrides) already are this configuration (which then runs in the
    default run's folder)."""
    return all(effective(params, k) == v for k, v in overrides(method, config).items())


def config_label(params, method: str, config: dict[str, Any]) -> str:
    """A configuration as the tables show it, "(params.yaml)" on the one `params` hold."""
    return config_name(config) + (" (params.yaml)" if config and holds(params, method, config) else "")


def pick(dev_means: dict[str, float]) -> str:
    """The configuration with the best mean dev accuracy; the first in order on a tie."""
    best = max(dev_means.values())
    return next(name for name, acc in dev_means.items() if acc == best)


class Bench:
    """Runs stages for (seed, method, configuration, split) in their folders and keeps what they report."""

    def __init__(self, out: Path, overrides: list[str]):
        self.out, self.overrides = out, overrides
        (out / "builtin").mkdir(parents=True, exist_ok=True)
        self.base = self.params(out, 0)  # params.yaml + overrides: which configuration is the default run's

    def params(self, folder: Path, seed: int, extra: dict[str, Any] | None = None):
        parsed, problems = parse_overrides(self.overrides)
        if problems:
            raise SystemExit("\n".join(problems))
        return load_params(ROOT / "params.yaml", {**parsed, "run.output_dir": str(folder), "run.seed": seed,
                                                  **(extra or {})})

    def run_params(self, folder: Path, seed: int, method: str, config: dict[str, Any], split: str):
        """The params of one configuration of `method` (a ROUNDS entry), scored on `split`."""
        return self.params(folder, seed, {"policy.method": method, "evaluate.split": split,
                                          **overrides(method, config)})

    def shared(self, seed: int) -> dict[str, Any]:
        """preprocess, sft, reward and score of `seed`: {stage: manifest}."""
        folder = self.out / f"seed-{seed}" / "shared"
        _link(folder / "builtin", self.out / "builtin")
        params = self.params(folder, seed)
        return {stage: runner.run_stage(stage, params) for stage in SHARED}

    def folder(self, seed: int, method: str, config: dict[str, Any]) -> Path:
        name = "default" if holds(self.base, method, config) else config_name(config)
        return self.out / f"seed-{seed}" / f"{method}-{name}"

    def run(self, seed: int, method: str, config: dict[str, Any], split: str) -> dict[str, Any]:
        """Every stage of one configuration, scored on `split`; {stage: manifest}. Shared stages are links to the
        seed's shared folder, found current by the runner (except those the configuration sets: `own_stages`)."""
        folder = self.folder(seed, method, config)
        _link(folder / "builtin", self.out / "builtin")
        linked = [stage for stage in SHARED if stage not in own_stages(config)]
        for stage in linked:
            _link(folder / stage, self.out / f"seed-{seed}" / "shared" / stage)
        params = self.run_params(folder, seed, method, config, split)
        manifests = {stage: runner.run_stage(stage, params) for stage in STAGES}
        assert not any(manifests[s]["executed"] for s in linked), f"{folder}: a shared stage ran again"
        return manifests


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(os.path.relpath(target, link.parent), target_is_directory=True)


def rows_of(manifests: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["model"]: r for r in manifests["evaluate"]["metrics"]["table"]}


def method_record(manifests: dict[str, Any]) -> dict[str, Any]:
    policy = manifests["policy"]
    return {"accuracy": rows_of(manifests)["policy"]["accuracy"], "reward": rows_of(manifests)["policy"].get("reward"),
            "n": manifests["evaluate"]["metrics"]["n"], "steps": policy["metrics"].get("steps"),
            "train_s": manifests["reference"]["wall_time_s"] + policy["wall_time_s"]}


def error_counts(evaluate_dir: Path, model: str) -> Counter | None:
    """How `model`'s held-out answers are wrong (stages.builtin.arithmetic.error_kind), from evaluate's
    predictions.jsonl: {kind: count, "right": count}; None when the prompts are not the built-in task's."""
    counts: Counter = Counter()
    for row in read_jsonl(evaluate_dir / "predictions.jsonl"):
        if row["model"] != model:
            continue
        operands = re.fullmatch(r"(\d+)\+(\d+)", row["prompt"][-1]["content"]) if isinstance(row["prompt"], list) \
            else None
        if operands is None:
            return None
        counts[error_kind(*map(int, operands.groups()), row["completion"]) or "right"] += 1
    return counts


def fmt(values: list[float], *, percent: bool = True, digits: int = 1) -> str:
    """'mean ± sd' of one value per seed ('' when a seed has none)."""
    if not values or any(v is None for v in values):
        return ""
    m, sd = mean_sd(values)
    return f"{m:.1%} ± {sd:.1%}" if percent else f"{m:.{digits}f} ± {sd:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS), help="values of run.seed")
    ap.add_argument("--sweep", type=int, choices=range(1, len(ROUNDS) + 1), default=None, metavar="ROUND",
                    help="tune each method on dev over ROUNDS[ROUND - 1]; the choice on eval")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a params override for every run (e.g. sft.max_steps=50)")
    ap.add_argument("--output-dir", default=None, help="keep the artifacts here; a rerun reuses every current stage")
    ap.add_argument("--write", metavar="FILE", default=None, help="also write the tables to FILE (markdown)")
    ap.add_argument("--tiny", action="store_true", help="the first seed only, on the tiny model and data (a smoke run)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.seeds, args.overrides = args.seeds[:1], tiny_overrides() + args.overrides
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="align-alignment-")).resolve()
    bench, load_before, started = Bench(out, args.overrides), host_load(), time.perf_counter()

    for method in args.methods:  # every configuration's params are valid before anything trains
        for config in configurations(method, args.sweep) if args.sweep else [{}]:
            bench.run_params(out / "check", args.seeds[0], method, config, "eval")
    shared = {seed: bench.shared(seed) for seed in args.seeds}
    sweep: dict[str, dict[str, list[float]]] = {}  # method -> config name -> dev accuracy per seed
    chosen: dict[str, dict[str, Any]] = {}
    for method in args.methods:
        if not args.sweep:
            chosen[method] = {}
            continue
        grid = configurations(method, args.sweep)
        sweep[method] = {config_name(c): [method_record(bench.run(s, method, c, "dev"))["accuracy"]
                                          for s in args.seeds] for c in grid}
        best = pick({name: statistics.fmean(accs) for name, accs in sweep[method].items()})
        chosen[method] = next(c for c in grid if config_name(c) == best)
        print(f"{method}: dev accuracy per configuration {json.dumps(sweep[method])}; chosen {best}", flush=True)

    results: dict[str, dict[str, list]] = {"base": {}, "sft": {}}  # label -> measure -> one value per seed
    errors: dict[str, Counter | None] = {}  # label -> error kinds on eval, summed over the seeds
    for method, config in chosen.items():
        for seed in args.seeds:
            dev = bench.run(seed, method, config, "dev")  # after --sweep: current, nothing runs
            evaluation = bench.run(seed, method, config, "eval")  # policy current: only evaluate runs
            for label, model in (("sft", "sft"), (method, "policy")):
                if label == "sft" and len(results["sft"].get("accuracy", [])) == len(args.seeds):
                    continue  # the SFT rows: once per seed, from the first method
                counts = error_counts(bench.folder(seed, method, config) / "evaluate", model)
                errors[label] = None if counts is None or errors.get(label, 0) is None else \
                    errors.get(label, Counter()) + counts
            for key, value in {**method_record(evaluation), "dev": method_record(dev)["accuracy"]}.items():
                results.setdefault(method, {}).setdefault(key, []).append(value)
            for label in ("base", "sft"):  # the same for every method of a seed: taken from the first
                if label in rows_of(evaluation) and len(results[label].get("accuracy", [])) < len(args.seeds):
                    r = results[label]
                    r.setdefault("accuracy", []).append(rows_of(evaluation)[label]["accuracy"])
                    r.setdefault("reward", []).append(rows_of(evaluation)[label].get("reward"))
                    r.setdefault("dev", []).append(rows_of(dev)[label]["accuracy"])

    results = {label: r for label, r in results.items() if r}  # base: absent with evaluate.baseline false
    report = tables(args, shared, results, chosen, sweep, load=(load_before, host_load()), out=out,
                    wall_s=time.perf_counter() - started, base=bench.base, errors=errors)
    print("\n" + report)
    if args.write:
        Path(args.write).write_text(report)
        print(f"wrote {args.write}")
    return 0


def tables(args, shared: dict[int, dict], results: dict, chosen: dict, sweep: dict, *, load: tuple, out: Path,
           wall_s: float, base, errors: dict[str, Counter | None] | None = None) -> str:
    seeds = " ".join(map(str, args.seeds))
    command = " ".join(["python -m benchmarks alignment", *([f"--sweep {args.sweep}"] if args.sweep else []),
                        "--seeds", seeds,
                        *(["--methods", *args.methods] if list(args.methods) != list(METHODS) else []),
                        *(f"--set {o}" for o in args.overrides)])
    n = next((r["n"][0] for r in results.values() if "n" in r), None)
    title = f"sweep round {args.sweep}: every method the same budget" if args.sweep else "every method"
    lines = [f"# Alignment benchmark, {title}, mean ± sd over seeds", "",
             f"Command: `{command}`. Seeds (`run.seed`): {seeds}. Held-out accuracy: greedy decoding, exact match, "
             f"{n} eval prompts; dev: the disjoint dev split (`evaluate.split: dev`). 1-min load {load[0]:.1f} "
             f"before, {load[1]:.1f} after, {os.cpu_count()} CPUs, torch threads {torch_threads()}. Wall time of this "
             f"run {wall_s:.0f} s (stages found current cost nothing). Artifacts: {out}.", ""]
    reward = [m["reward"]["metrics"] for m in shared.values()]
    score = [m["score"]["metrics"] for m in shared.values()]
    lines += ["| shared stage (per seed) | value |", "|---|---|"]
    if all("accuracy" in r for r in reward):
        lines.append(f"| reward model: held-out pair accuracy | {fmt([r['accuracy'] for r in reward])} |")
    lines.append(f"| score: pairs | {fmt([s['pairs'] for s in score], percent=False)} |")
    if all("chosen_correct" in s for s in score):
        lines.append(f"| score: chosen answer correct | {fmt([s['chosen_correct'] for s in score])} |")
    for stage in SHARED:
        lines.append(f"| stage {stage} s | {fmt([m[stage]['wall_time_s'] for m in shared.values()], percent=False)} |")
    lines += ["", "| model | configuration | eval accuracy | vs SFT (points) | dev accuracy | mean RM score "
                  "| `reference` + `policy` s | steps |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    sft = results.get("sft", {}).get("accuracy")
    for label, r in results.items():
        gain = "" if label in ("base", "sft") or not sft else \
            fmt([100 * (a - b) for a, b in zip(r["accuracy"], sft, strict=True)], percent=False)
        config = "" if label in ("base", "sft") else config_label(base, label, chosen[label]) if args.sweep \
            else "params.yaml"
        steps = "" if "steps" not in r else "/".join(sorted({str(s) for s in r["steps"]}))
        lines.append(f"| {label} | {config} | {fmt(r['accuracy'])} | {gain} | {fmt(r.get('dev', []))} | "
                     f"{fmt(r.get('reward', []), percent=False, digits=2)} | "
                     f"{fmt(r.get('train_s', []), percent=False)} | {steps} |")
    errors = {label: c for label, c in (errors or {}).items() if c}
    if errors:
        kinds = [k for k in ERROR_KINDS if any(c[k] for c in errors.values())]
        lines += ["", "What the models get wrong on eval (stages.builtin.arithmetic_errors.error_kind; answers summed "
                  f"over the {len(args.seeds)} seeds):", "", "| model | right | " + " | ".join(kinds) + " |",
                  "|---|" + "---:|" * (len(kinds) + 1)]
        for label, c in errors.items():
            lines.append(f"| {label} | {c['right']} | " + " | ".join(str(c[k]) for k in kinds) + " |")
    if sweep:
        lines += ["", "## Sweep (dev only)", "",
                  f"Each method's configurations of round {args.sweep} (ROUNDS in benchmarks/alignment.py: keys "
                  "under `policy.<method>.`), "
                  "each trained on every seed and scored on the dev split only; the best mean dev accuracy is "
                  "chosen (bold) and only it is scored on eval (the table above).", "",
                  "| method | configuration | dev accuracy (mean ± sd) | per seed |", "|---|---|---:|---|"]
        for method, configs in sweep.items():
            for config, (name, accs) in zip(configurations(method, args.sweep), configs.items(), strict=True):
                mark = "**" if name == config_name(chosen[method]) else ""
                label = config_label(base, method, config)
                lines.append(f"| {method} | {mark}{label}{mark} | {mark}{fmt(accs)}{mark} | "
                             f"{', '.join(f'{a:.1%}' for a in accs)} |")
    return "\n".join(lines) + "\n"

