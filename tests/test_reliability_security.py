"""Safe loading: safetensors only, no pickle from any artifact, reward functions by import path only, servers
on loopback, secrets never written out, trust_remote_code off unless the params say so."""
from __future__ import annotations

import inspect
import json
import logging
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from stages.harness import runner
from stages.harness.config import Params
from stages.harness.params_loader import load_params
from tests.conftest import ROOT, write_params

SOURCES = sorted(p for d in ("stages", "flows", "tasks") for p in (ROOT / d).rglob("*.py"))
EVERY_SOURCE = sorted(p for d in ("stages", "flows", "tasks", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py"))
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@pytest.mark.parametrize("pattern, why", [
    (r"\bimport pickle\b|\bpickle\.load|\bdill\b|\bjoblib\.load", "pickle can run code while loading"),
    (r"torch\.load\((?![^)]*weights_only=True)", "torch.load without weights_only=True unpickles arbitrary objects"),
    (r"(?<![\w.])(eval|exec)\(", "eval/exec of strings (reward functions are imported by path)"),
    (r"trust_remote_code\s*=\s*True", "custom model code runs only when params.model.trust_remote_code says so"),
    (r"0\.0\.0\.0", "servers bind to 127.0.0.1 unless configured otherwise"),
    (r"use_safetensors\s*=\s*False|safe_serialization\s*=\s*False", "weights are written and read as safetensors"),
])
def test_no_unsafe_calls_in_the_code(pattern, why):
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in SOURCES
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(pattern, line) and not line.lstrip().startswith("#")]
    assert not hits, f"{why}:\n" + "\n".join(hits)


def test_every_torch_load_is_weights_only():
    """No torch.load in the repository (library, flows, benchmarks, tests) may unpickle arbitrary objects: each
    call, over as many lines as it spans, passes weights_only=True."""
    offenders = []
    for path in EVERY_SOURCE:
        text = path.read_text()
        for match in re.finditer(r"torch\.load\(", text):
            depth, end = 1, match.end()
            while depth and end < len(text):  # the call's closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            call = text[match.start():end]
            if "weights_only=True" not in call and path.name != "test_reliability_security.py":
                offenders.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: {call}")
    assert not offenders, "\n".join(offenders)


def test_transformers_trainer_loads_every_file_weights_only():
    """Every torch.load in transformers' Trainer (resume: optimizer, scheduler, scaler, RNG state, and the model
    weights when a checkpoint has no safetensors) passes weights_only=True; we call trainer.train(resume_from_
    checkpoint=...) only, never a load with weights_only=False."""
    import transformers.trainer as trainer_module

    text = inspect.getsource(trainer_module)
    calls = text.split("torch.load(")[1:]
    assert len(calls) >= 8
    for call in calls:
        assert "weights_only=True" in call[:300], "transformers.trainer: torch.load without weights_only=True"


def test_transformers_resumes_checkpoints_with_weights_only():
    """Crash-resume torch.loads optimizer.pt, scheduler.pt and rng_state.pth from `ctx.work`: transformers does
    every such load with weights_only=True (tensors and an allow-list of numpy types, no arbitrary pickle).
    This pins that: an upgrade that loosens it fails here."""
    from transformers import Trainer

    for method in ("_load_rng_state", "_load_optimizer_and_scheduler", "_load_scaler"):
        calls = inspect.getsource(getattr(Trainer, method)).split("torch.load(")[1:]
        assert calls, method
        for call in calls:
            assert "weights_only=True" in call[:300], f"{method}: torch.load without weights_only=True"


def test_stage_outputs_hold_no_pickles(built_pipeline):
    params, _ = built_pipeline
    out = Path(params.run.output_dir)
    pickles = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.suffix in PICKLE_SUFFIXES]
    assert not pickles, pickles
    assert (out / "sft" / "model" / "model.safetensors").exists()


def test_reward_functions_are_imported_never_evaluated(tmp_path, monkeypatch):
    from stages.reward_functions import load_reward_function

    monkeypatch.chdir(tmp_path)
    for spec in ["__import__('os').system('touch pwned')", "os:system('touch pwned')", "lambda p, c: 1"]:
        with pytest.raises(ValueError):
            load_reward_function(spec, key="score.reward_functions[0]")
    assert not (tmp_path / "pwned").exists()


def test_servers_default_to_loopback(monkeypatch, tmp_path):
    from flows import server
    from stages.generation import vllm
    from stages.harness.config import GenerationParams

    assert GenerationParams().vllm_url.startswith("http://127.0.0.1:")
    assert vllm.DEFAULT_BASE_URL.startswith("http://127.0.0.1:")
    cmd = vllm.serve_command("/models/x")
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"

    started = []

    class Exited:
        pid, returncode = 0, 1

        def __init__(self, args, **kwargs):
            started.append(args)

        def poll(self):
            return 1

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.setattr(server, "find_server", lambda: None)
    monkeypatch.setattr(subprocess, "Popen", Exited)
    with pytest.raises(RuntimeError, match="prefect server exited"):
        server.start_server(port=0, timeout=5)
    assert started[0][started[0].index("--host") + 1] == "127.0.0.1"


def test_secrets_never_reach_params_manifests_or_logs(tmp_path, monkeypatch, caplog, capsys):
    secrets = {"WANDB_API_KEY": "wandb-fake-0123456789abcdef", "HF_TOKEN": "hf_FakeToken0123456789",
               "HUGGING_FACE_HUB_TOKEN": "hf_OtherFake0123456789", "VLLM_API_KEY": "vllm-fake-key-0123456789"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    from stages.__main__ import main

    params = write_params(tmp_path, {"sft": {"max_steps": 2}})
    with caplog.at_level(logging.DEBUG):
        for stage in ("preprocess", "sft"):
            assert main([stage, "--params", str(params)]) == 0
            assert main(["status", "--params", str(params)]) == 0
    captured = capsys.readouterr()
    texts = {"log": caplog.text, "stdout": captured.out, "stderr": captured.err}
    texts.update({str(p): p.read_bytes().decode("utf-8", "replace") for p in tmp_path.rglob("*") if p.is_file()})
    leaked = [(where, name) for where, text in texts.items() for name, v in secrets.items() if v in text]
    assert not leaked, leaked
    assert len(texts) > 10  # manifests, metrics, the model folder, the params file were all searched


def test_trust_remote_code_is_off_unless_the_params_say_so(tmp_path, monkeypatch):
    assert Params().model.trust_remote_code is False
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seen = []
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def spy(real):
        def load(*args, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return real(*args, **kwargs)
        return load

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy(real_model))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy(real_tok))
    params = load_params(write_params(tmp_path, {"sft": {"max_steps": 1}}))
    for stage in ("preprocess", "sft"):
        runner.run_stage(stage, params)
    assert seen and set(seen) == {False}, seen
    seen.clear()
    trusted = load_params(write_params(tmp_path, {"model": {"trust_remote_code": True}, "sft": {"max_steps": 1}}))
    for stage in ("preprocess", "sft"):
        runner.run_stage(stage, trusted)
    assert seen and set(seen) == {True}, seen


MARKERS = {"HF_TOKEN": "hf_MARKERsecretHF0123456789", "WANDB_API_KEY": "MARKERsecretWANDB0123456789abcdef",
           "MLFLOW_TRACKING_PASSWORD": "MARKERsecretMLFLOW0123456789"}
JUDGE_KEY_ENV = "ALIGN_TEST_JUDGE_API_KEY"  # evaluate.judge.api_key_env: the variable's name, never its value


def files_holding(folder: Path, markers: dict[str, str]) -> list[tuple[str, str]]:
    """(file, variable) for every file under `folder` whose bytes hold a marker (as written, or UTF-16 / base64
    encoded, as a database or a JSON blob might store it)."""
    import base64

    forms = {name: [v.encode(), v.encode("utf-16-le"), base64.b64encode(v.encode())[:20]]
             for name, v in markers.items()}
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            found += [(str(path.relative_to(folder)), name) for name, encoded in forms.items()
                      if any(e in data for e in encoded)]
    return found


@pytest.mark.slow
def test_a_full_run_writes_no_secret_anywhere(tmp_path):
    """`align run` of the whole pipeline in a git + DVC project, with HF_TOKEN, WANDB_API_KEY and
    MLFLOW_TRACKING_PASSWORD set to marker values, and the evaluate stage's judge a real `transformers serve` whose
    key variable (evaluate.judge.api_key_env) holds a marker too: no file under the project (params, dvc.lock,
    artifacts/ with report.md and the tracker folders, logs, manifests, the DVC cache) or under PREFECT_HOME (the
    Prefect database, results, server log) holds any of them, nor does the console."""
    import os
    import sys

    from stages.builtin import tiny
    from tests.stages.evaluation.test_judge_server import Serve
    from tests.test_dvc import make_dvc_repo

    repo = make_dvc_repo(tmp_path / "repo")
    home = tmp_path / "prefect-home"
    markers = {**MARKERS, JUDGE_KEY_ENV: "sk-MARKERsecretJUDGE0123456789"}
    env = {**os.environ, **markers, "PREFECT_HOME": str(home), "DVC_NO_ANALYTICS": "1", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PREFECT_LOGGING_LEVEL": "DEBUG"}
    env.pop("PREFECT_API_URL", None)
    judge_model = str(tiny.build(tmp_path / "judge", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                 vocab_size=384, seed=0))
    server = Serve(judge_model)
    try:  # in params.yaml, not --set: a run with overrides leaves dvc.lock alone (its outputs are not params.yaml's)
        params = yaml.safe_load((repo / "params.yaml").read_text())
        params.setdefault("evaluate", {})["judge"] = {
            "base_url": server.url, "model": judge_model, "api_key_env": JUDGE_KEY_ENV, "max_retries": 1,
            "backoff": 0.1, "resamples": 50}
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        res = subprocess.run([str(Path(sys.executable).parent / "align"), "run"], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=900)
    finally:
        server.kill()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (repo / "artifacts" / "evaluate" / "manifest.json").is_file()
    assert (repo / "dvc.lock").is_file(), res.stdout[-2000:] + res.stderr[-2000:]
    assert any(home.rglob("*.db")) and any((repo / ".dvc" / "cache").rglob("*")), "the database and cache exist"
    table = json.loads((repo / "artifacts" / "evaluate" / "metrics.json").read_text())
    judged = [r for r in table if "judge.pairs" in r]  # the judge was asked (with the key: make_judge reads it)
    assert [r["model"] for r in judged] == ["base", "policy", "merged"], table
    assert all(r["judge.pairs"] + r["judge.unparsed"] / 2 >= r["n"] for r in judged)
    assert (repo / "artifacts" / "evaluate" / "report.md").is_file() and any((repo / "artifacts").rglob("events.*"))
    found = files_holding(repo, markers) + files_holding(home, markers)
    leaked_to_console = [name for name, v in markers.items() if v in res.stdout + res.stderr]
    searched = sum(1 for d in (repo, home) for p in d.rglob("*") if p.is_file())
    print(f"\nsecrets grep: {searched} files searched, markers found: {len(found) + len(leaked_to_console)}")
    assert not found and not leaked_to_console, (found, leaked_to_console)
    control = tmp_path / "control"  # the search itself finds a planted marker, in each encoding
    control.mkdir()
    (control / "plain.json").write_text(json.dumps({"token": MARKERS["HF_TOKEN"]}))
    (control / "wide.bin").write_bytes(MARKERS["WANDB_API_KEY"].encode("utf-16-le"))
    assert sorted(files_holding(control, MARKERS)) == [("plain.json", "HF_TOKEN"), ("wide.bin", "WANDB_API_KEY")]
