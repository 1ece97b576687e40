"""The judge and the "vllm" generation backend against a real OpenAI-compatible server: `transformers serve`
(transformers' own), started by the tests on 127.0.0.1 with the built-in tiny model, then killed halfway."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from stages.builtin import tiny
from stages.evaluation import judge
from stages.openai_client import EndpointError, OpenAIClient

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY_ENV, KEY = "ALIGN_TEST_JUDGE_KEY", "sk-MARKERjudgeKey0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`transformers serve <folder>` in its own process group; `url` is its .../v1."""

    def __init__(self, folder: str):
        self.folder, port = folder, free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        cli = Path(sys.executable).parent / "transformers"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([str(cli), "serve", folder, "--host", "127.0.0.1", "--port", str(port),
                                         "--device", "cpu"], env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=2).read()
                return
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError("transformers serve exited") from None
                time.sleep(0.5)
        self.kill()
        raise RuntimeError("transformers serve did not become healthy in 120 s")

    def kill(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(tiny.build(tmp_path_factory.mktemp("serve") / "tiny", hidden_size=32, num_layers=1, num_heads=2,
                          intermediate_size=64, vocab_size=384, seed=0))


@pytest.fixture
def server(tiny_folder):
    s = Serve(tiny_folder)
    yield s
    s.kill()


def test_judge_against_transformers_serve(server, monkeypatch):
    """Both orders of 6 pairs are asked (12 requests), replies are greedy (the same on a second run), and the
    win rate is the mean of the per-prompt scores the replies give."""
    monkeypatch.setenv(KEY_ENV, KEY)
    j = JudgeConfig(base_url=server.url, model=server.folder, api_key_env=KEY_ENV)
    ask, client = judge.make_judge(j, device="cpu", dtype="float32")
    template = judge.read_template(None)
    instructions = [f"{a}+{b}" for a, b in [(12, 34), (7, 8), (40, 2), (9, 90), (15, 15), (3, 4)]]
    model_texts = ["46", "15", "42", "99", "30", "7"]
    baseline_texts = ["45", "16", "42", "98", "31", "8"]
    v = judge.judge_pairs(ask, template, instructions, model_texts, baseline_texts)
    assert client is not None and client.requests == 12 and client.retries == 0
    again = judge.judge_pairs(ask, template, instructions, model_texts, baseline_texts)
    assert again.forward == v.forward and again.reverse == v.reverse  # temperature 0
    expected = [judge.pair_score(judge.parse_verdict(f), judge.parse_verdict(r))
                for f, r in zip(v.forward, v.reverse, strict=True)]
    assert v.scores == expected
    cols = judge.summary(v, [2] * 6, [2] * 6, confidence=0.95, resamples=100, seed=0)
    read = [s for s in expected if s is not None]  # a pair with a reply naming no verdict is left out, and counted
    assert cols["judge.pairs"] == len(read) and cols["judge.unparsed"] == sum(
        (judge.parse_verdict(t) is None) for t in v.forward + v.reverse)
    if read:
        assert cols["judge.win_rate"] == pytest.approx(sum(read) / len(read), abs=1e-4)
        assert cols["judge.win_rate_low"] <= cols["judge.win_rate"] <= cols["judge.win_rate_high"]
    else:
        assert cols["judge.win_rate"] is None and cols["judge.lc_win_rate"] is None
    assert KEY not in repr(client) and client.headers()["Authorization"] == f"Bearer {KEY}"


def test_a_judge_that_goes_down_halfway_fails_after_counted_retries(server):
    client = OpenAIClient(server.url, timeout=10, max_retries=3, backoff=0.05)
    ask = judge.endpoint_judge(client, server.folder, max_new_tokens=4, concurrency=1)
    killer = kill_after(server, client, 6)
    with pytest.raises(EndpointError) as err:
        judge.judge_pairs(ask, judge.read_template(None), [f"{i}+1" for i in range(10)], ["a"] * 10, ["b"] * 10)
    killer.join()
    msg = str(err.value)
    assert f"{server.url}/chat/completions failed after 3 retries; last error: URLError" in msg, msg
    # the request in flight spent its 3 retries; at most one more had started (one worker): not all 20
    assert err.value.retries == 3 and client.retries in (3, 6) and 6 <= client.requests <= 8


def kill_after(server: Serve, client: OpenAIClient, requests: int) -> threading.Thread:
    def watch():
        while client.requests < requests:
            time.sleep(0.01)
        server.kill()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_vllm_backend_speaks_plain_openai_to_transformers_serve(server):
    """The "vllm" backend with protocol "openai" (text prompt, standard fields) returns the "hf" backend's greedy
    completions; the vLLM protocol's extensions are refused by this server with a clear error."""
    from stages.generation import SamplingParams, generate
    from stages.generation.vllm import VLLMServerError
    from stages.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(server.folder)
    model = load_causal_lm(server.folder, dtype="float32", device="cpu")
    prompts = [[{"role": "user", "content": c}] for c in ["12+34", "7+8", "99+1"]] + ["plain text"]
    sampling = SamplingParams(max_new_tokens=8)
    local = generate(model, tok, prompts, sampling, backend="hf")
    served = generate(server.folder, tok, prompts, sampling, backend="vllm", base_url=server.url, protocol="openai")
    assert served.completions == local.completions and any(served.completions)
    with pytest.raises(VLLMServerError, match=r"HTTP 422: Unexpected fields.*pass protocol='openai'"):
        generate(server.folder, tok, prompts[:1], sampling, backend="vllm", base_url=server.url, max_retries=0)


@dataclasses.dataclass
class JudgeConfig:
    """evaluate.judge's fields that make_judge reads."""

    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    model_path: str | None = None
    max_new_tokens: int = 4
    timeout: float = 30.0
    max_retries: int = 2
    backoff: float = 0.05
    concurrency: int = 2


@pytest.mark.slow
def test_evaluate_stage_with_the_judge_killed_halfway_writes_no_metrics(built_pipeline, tmp_path, monkeypatch):
    """The whole evaluate stage against `transformers serve` serving the run's SFT model as the judge: first a
    run that succeeds (the table has judge columns with intervals; the key is written nowhere), then one whose
    server is killed after 30 requests: it fails naming the endpoint and the retries, and publishes nothing."""
    from stages.harness import runner
    from tests.test_reliability_security import files_holding

    params, _ = built_pipeline
    out = tmp_path / "artifacts"
    shutil.copytree(params.run.output_dir, out, symlinks=True)
    shutil.rmtree(out / "evaluate")
    monkeypatch.setenv(KEY_ENV, KEY)
    sft = str(out / "sft" / "model")
    serve = Serve(sft)
    try:
        j = dataclasses.replace(params.evaluate.judge, base_url=serve.url, model=sft, api_key_env=KEY_ENV,
                                max_new_tokens=4, backoff=0.05, max_retries=3, resamples=200)
        p = dataclasses.replace(params, run=dataclasses.replace(params.run, output_dir=str(out)),
                                evaluate=dataclasses.replace(params.evaluate, judge=j))
        table = runner.run_stage("evaluate", p)["metrics"]["table"]
        by = {r["model"]: r for r in table}
        assert "judge.win_rate" not in by["sft"]  # the baseline is not judged against itself
        for label in ("base", "policy", "merged"):
            r = by[label]
            assert r["judge.pairs"] <= r["n"] and r["judge.retries"] == 0
            if r["judge.pairs"]:  # the tiny judge's replies rarely name a verdict: no rates without one
                assert r["judge.win_rate_low"] <= r["judge.win_rate"] <= r["judge.win_rate_high"]
                assert r["judge.lc_win_rate_low"] <= r["judge.lc_win_rate"] <= r["judge.lc_win_rate_high"]
            else:
                assert r["judge.win_rate"] is None and r["judge.unparsed"] >= r["n"]
        assert by["policy"]["judge.win_rate"] == by["merged"]["judge.win_rate"]  # same completions, same verdicts
        report = (out / "evaluate" / "report.md").read_text()
        assert "## Completions" in report and "sft completion" in report and "merged judge" in report
        assert not files_holding(out, {KEY_ENV: KEY})
        print("\njudge table:", json.dumps({k: {c: v for c, v in r.items() if c.startswith("judge.")}
                                              for k, r in by.items()}, indent=1))

        shutil.rmtree(out / "evaluate")
        shutil.rmtree(out / "metrics", ignore_errors=True)
        p2 = dataclasses.replace(p, evaluate=dataclasses.replace(p.evaluate, max_new_tokens=5))  # a new run
        client_requests = count_requests(monkeypatch)
        killer = threading.Thread(target=lambda: (wait_for(client_requests, 30), serve.kill()), daemon=True)
        killer.start()
        with pytest.raises(EndpointError) as err:
            runner.run_stage("evaluate", p2)
        killer.join()
        print("error:", err.value)
        assert f"{serve.url}/chat/completions failed after 3 retries; last error: URLError" in str(err.value)
        assert not (out / "evaluate").exists() and not list(out.rglob("metrics.json"))
        assert not (out / "metrics" / "evaluate.json").exists()
    finally:
        serve.kill()


def count_requests(monkeypatch) -> list[int]:
    """A counter of the requests every OpenAIClient sends from now on."""
    seen = [0]
    real = OpenAIClient.send

    def send(self, method, path, data):
        seen[0] += 1
        return real(self, method, path, data)

    monkeypatch.setattr(OpenAIClient, "send", send)
    return seen


def wait_for(counter: list[int], n: int) -> None:
    while counter[0] < n:
        time.sleep(0.01)
