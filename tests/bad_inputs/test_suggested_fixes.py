"""Every error message that suggests `--set` overrides, followed literally: the run then finishes, or stops
before any training with the next fix, which followed in turn leads to a finished run.

Each case starts from the small params and a user's own files (the built-in task written out,
tests/pipelines.py), takes the first `--set ...` run of every problem in the message (what one
report tells the user to do), applies them all, and validates again, at most four rounds; then
the whole pipeline runs (a module-wide output folder: stages already built with the same
fingerprint are reused, as a user's rerun would). `SUGGESTIONS` lists where each message is
made; `test_every_suggestion_in_the_code_is_exercised` fails when a new `--set` suggestion
appears in the code without a case here.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from stages.data import DataError
from stages.harness.params_loader import ParamsError, load_params
from tests.conftest import ROOT, deep_update, write_params
from tests.pipelines import arithmetic_files, evaluate_table, run_pipeline

pytestmark = pytest.mark.slow

SET_RUN = re.compile(r"--set \S+(?: --set \S+)*")


def suggested(message: str) -> list[str]:
    """The overrides of the first `--set K=V [--set K=V ...]` run of every problem line of `message`."""
    found = []
    for line in message.splitlines():
        run = SET_RUN.search(line)
        if run:
            found += [item.rstrip(",;)") for item in run.group(0).split("--set ") if item.strip()]
    return [item.strip() for item in found]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("suggested-fixes")
    files = arithmetic_files(folder)
    texts = [{"text": json.loads(line)["messages"][0]["content"] + " = " + json.loads(line)["messages"][-1]["content"]}
             for line in files["sft"].read_text().splitlines()]
    (folder / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in texts))
    return folder


# the fixes that are files, not overrides: a problem naming the key gets the project's file for it
FILE_FIXES = {"data.eval_source": "eval.jsonl"}


def follow(project: Path, extra: dict, rounds: int = 4) -> tuple[list[list[str]], object]:
    """Validate `extra` over the small params; apply each message's suggestions until params validate (a
    problem that asks for a file instead, FILE_FIXES, gets the project's file). Returns ([overrides added per
    round], the validated params)."""
    params_file = write_params(project, deep_update({"run": {"output_dir": str(project / "artifacts")}}, extra))
    overrides: list[str] = []
    steps: list[list[str]] = []
    for _ in range(rounds):
        try:
            return steps, load_params(params_file, overrides, rows=True)
        except ParamsError as e:
            fixes = suggested(str(e)) + [f"{key}={project / name}" for key, name in FILE_FIXES.items()
                                         if re.search(rf"^  - {re.escape(key)} .*; set {re.escape(key)} to ",
                                                      str(e), re.M)]
            assert fixes, f"a params problem without a --set suggestion:\n{e}"
            assert not set(fixes) <= set(overrides), f"the same suggestion again (a loop):\n{e}"
            steps.append(fixes)
            overrides += fixes
    raise AssertionError(f"still refused after {rounds} rounds of suggestions: {steps}")


def finished(params) -> list[str]:
    run_pipeline(params)
    return [r["model"] for r in evaluate_table(params)]


SFT_ONLY = {"data": {"source": None, "sft": "{sft}"}}
CASES = [
    # (case, extra params ({sft}, {text}: the project's files), first suggestion expected)
    ("own_files_with_the_builtin_task", {"data": {"sft": "{sft}"}}, ["data.source=null"]),
    ("sft_only_reward_model_in_score", SFT_ONLY, ["policy.method=grpo", "score.enabled=false"]),
    ("sft_only_default_rewards", deep_update(json.loads(json.dumps(SFT_ONLY)), {"score": {
        "reward_functions": ["exact_match", "reward_model_prob"], "reward_weights": [1.0, 0.5]}}),
     ["policy.method=grpo", "score.enabled=false"]),
    ("policy_data_preprocess_without_pairs", deep_update(json.loads(json.dumps(SFT_ONLY)),
                                                         {"policy": {"data": "preprocess"}}),
     ["policy.method=grpo", "score.enabled=false", "score.reward_functions=[exact_match]"]),
    ("grpo_shared_head_without_pairs", deep_update(json.loads(json.dumps(SFT_ONLY)), {
        "policy": {"method": "grpo", "grpo": {"reward_head": "shared"}}}),
     ["score.reward_functions=[exact_match]", "policy.grpo.reward_head=separate"]),
    ("ppo_reward_model_without_pairs", deep_update(json.loads(json.dumps(SFT_ONLY)), {"policy": {"method": "ppo"}}),
     ["score.reward_functions=[exact_match]", "policy.ppo.reward_functions=[exact_match]",
      "policy.ppo.reward_weights=[1.0]"]),
    ("online_dpo_reward_model_without_pairs", deep_update(json.loads(json.dumps(SFT_ONLY)),
                                                          {"policy": {"method": "online_dpo"}}),
     ["score.reward_functions=[exact_match]", "policy.online_dpo.reward_functions=[exact_match]",
      "policy.online_dpo.reward_weights=[1.0]"]),
    ("dpo_without_pairs_and_a_grpo_reward_model", deep_update(json.loads(json.dumps(SFT_ONLY)), {"policy": {"grpo": {
        "reward_functions": ["exact_match", "reward_model"], "reward_weights": [1.0, 1.0]}}}),
     ["policy.method=grpo", "score.enabled=false", "policy.grpo.reward_functions=[exact_match]",
      "policy.grpo.reward_weights=null"]),
    ("text_rows_only_with_score", {"data": {"source": None, "sft": "{text}"}},
     ["score.enabled=false", "policy.method=none", "score.reward_functions=[exact_match]"]),
    ("text_rows_only_with_grpo", {"data": {"source": None, "sft": "{text}"}, "score": {"enabled": False},
                                  "policy": {"method": "grpo"}}, ["policy.method=none"]),
]


@pytest.mark.parametrize("case, extra, first", CASES, ids=[c[0] for c in CASES])
def test_following_the_suggestions_finishes_the_run(project, case, extra, first):
    extra = json.loads(json.dumps(extra).replace('"{sft}"', json.dumps(str(project / "sft.jsonl")))
                       .replace('"{text}"', json.dumps(str(project / "text.jsonl"))))
    steps, params = follow(project, extra)
    assert steps and sorted(f for f in steps[0] if f.split("=")[0] not in FILE_FIXES) == sorted(first), steps
    models = finished(params)
    assert models[:2] == ["base", "sft"] and (params.policy.method == "none" or "policy" in models), models
    print(f"\n[{case}] {len(steps)} round(s) of suggestions: {steps} -> finished, evaluate rows {models}")


def test_keeping_dpo_on_rule_reward_pairs_stops_as_the_message_says(project):
    """The alternative the message offers (keep DPO, rule rewards only in score) is conditional: the tiny SFT
    model's samples are wrong on every prompt, so score pairs none and the run stops before policy, with the
    message naming why, as the suggestion warned."""
    extra = json.loads(json.dumps(SFT_ONLY).replace('"{sft}"', json.dumps(str(project / "sft.jsonl"))))
    with pytest.raises(ParamsError) as e:
        load_params(write_params(project, deep_update({"run": {"output_dir": str(project / "artifacts")}}, extra)),
                    rows=True)
    message = str(e.value)
    alternative = re.search(r"keep policy\.method = dpo with (--set \S+(?: --set \S+)*) if the SFT model's samples "
                            r"are right on some prompts and wrong on others \(score pairs only samples whose scores "
                            r"differ; with none the run stops before policy\)", message)
    assert alternative, message
    params = load_params(project / "params.yaml", suggested(alternative.group(1)), rows=True)
    manifests = run_pipeline(params, ("preprocess", "sft", "reward", "score"))
    print(f"\n[keep dpo, rule rewards only] score pairs: {manifests['score']['metrics'].get('pairs')}")
    if manifests["score"]["metrics"].get("pairs"):  # a model that is right on some prompts: the run finishes
        assert "policy" in finished(params)
    else:
        with pytest.raises(DataError, match=r"no preference pairs; policy\.data = score: score produced no pairs"):
            run_pipeline(params, ("reference",))


def test_promotion_on_the_dev_split_suggests_eval(project):
    """The promotion gate refuses a dev table with `--set evaluate.split=eval`; applied, evaluate reruns on eval
    and the gate decides."""
    from stages.pipeline import promote as promotion

    extra = json.loads(json.dumps(SFT_ONLY).replace('"{sft}"', json.dumps(str(project / "sft.jsonl"))))
    steps, params = follow(project, extra)
    dev = load_params(project / "params.yaml", [s for step in steps for s in step] + ["evaluate.split=dev",
                                                                                     f"promote.models_dir={project}/m"])
    run_pipeline(dev)
    with pytest.raises(promotion.PromotionError) as e:
        promotion.run_gate(dev)
    fixes = suggested(str(e.value))
    assert fixes == ["evaluate.split=eval"], str(e.value)
    fixed = load_params(project / "params.yaml", [s for step in steps for s in step] + fixes
                        + [f"promote.models_dir={project}/m"])
    run_pipeline(fixed)
    assert promotion.run_gate(fixed)["event"] == "promoted"


# where the code makes each `--set` suggestion in an error message (the key, or the f-string placeholder)
SUGGESTIONS = {
    "stages/harness/config.py": ["data.source"],
    "stages/data/sources.py": ["policy.data", "policy.method", "policy.grpo.reward_head", "score.enabled",
                               "policy.grpo.reward_functions", "policy.grpo.reward_weights", "{key}",
                               "{key.rsplit('.', 1)[0]}.reward_weights"],
    "stages/pipeline/promote.py": ["evaluate.split"],
}


def test_every_suggestion_in_the_code_is_exercised():
    """Each `--set KEY=...` suggestion in the library's messages (usage lines excluded) is one SUGGESTIONS lists,
    and the cases above follow it: a new suggestion cannot appear without a case."""
    made = set()
    for path in sorted((ROOT / "stages").rglob("*.py")):
        for line in path.read_text().splitlines():
            if line.strip().startswith(("python -m", "#", "align ", "--set")):  # usage lines of docstrings
                continue
            for match in re.finditer(r"--set (\{[^}]*\}[\w.]*|[\w.]+)=", line):
                if match.group(1) != "key":  # `--set key=value`, the syntax itself
                    made.add((path.relative_to(ROOT).as_posix(), match.group(1)))
    listed = {(f, key) for f, keys in SUGGESTIONS.items() for key in keys}
    assert made == listed, f"made but not listed: {sorted(made - listed)}; listed but gone: {sorted(listed - made)}"
