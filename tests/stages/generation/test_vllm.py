"""The "vllm" backend's client against a local HTTP server speaking vLLM's OpenAI completions protocol.

`FakeVLLM` is a real HTTP server (``http.server`` in a thread) that answers like ``vllm
serve``: ``GET /v1/models`` and ``POST /v1/completions`` with vLLM's JSON shape. Its
completions come from a responder: the built-in model's own greedy decoding (so the client
must reproduce the "hf" backend exactly) or a scripted one. This tests our request building
and response parsing; the last test runs against a real vLLM server when one is available.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import shlex
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from stages.data.tokenize import render_prompt
from stages.generation import SamplingParams, generate
from stages.generation.common import prompt_seed
from stages.generation.vllm import VLLMServerError, serve_command

from .conftest import PROMPTS

EOS = 1


class FakeVLLM:
    """An OpenAI-compatible completions server; ``responder(body) -> list of choice dicts``."""

    def __init__(self, served: str, responder, *, api_key: str | None = None, status: int = 200):
        self.served, self.responder, self.api_key, self.status = served, responder, api_key, status
        self.requests: list[tuple[dict, dict]] = []  # (headers, body)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self):
                if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                    self._reply(401, {"error": {"message": "Unauthorized"}})
                    return False
                return True

            def do_GET(self):
                if self._authorised() and self.path == "/v1/models":
                    self._reply(200, {"object": "list", "data": [{"id": fake.served, "object": "model"}]})

            def do_POST(self):
                if not self._authorised():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((dict(self.headers), body))
                if fake.status != 200:
                    return self._reply(fake.status, {"object": "error", "message": "top_k must be -1 or > 0",
                                                     "type": "BadRequestError", "code": fake.status})
                if body["model"] != fake.served:
                    return self._reply(404, {"error": {"message": f"The model `{body['model']}` does not exist."}})
                self._reply(200, {"id": "cmpl-1", "object": "text_completion", "model": fake.served,
                                  "choices": fake.responder(body), "usage": {}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def hf_greedy_responder(model, tok, style="token_ids"):
    """Greedy decoding of the received prompt ids with the HF model, answered as vLLM would."""
    lock = threading.Lock()

    def respond(body):
        assert body["temperature"] == 0.0 and body["n"] == 1
        with lock, torch.no_grad():
            out = model.generate(input_ids=torch.tensor([body["prompt"]]), max_new_tokens=body["max_tokens"],
                                 do_sample=False, eos_token_id=body["stop_token_ids"], pad_token_id=0)
        ids = out[0, len(body["prompt"]):].tolist()
        stopped = ids[-1] in body["stop_token_ids"]
        return [choice(tok, 0, ids, "stop" if stopped else "length", style)]

    return respond


def choice(tok, index, ids, finish, style="token_ids"):
    c = {"index": index, "text": tok.decode(ids), "finish_reason": finish, "stop_reason": None, "logprobs": None}
    if style == "token_ids":
        c["token_ids"] = ids
    elif style == "logprobs":
        c["logprobs"] = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-1.0] * len(ids)}
    elif style == "drop_eos":  # the stop token left out of the ids; finish_reason still says it stopped
        c["token_ids"] = ids[:-1] if finish == "stop" else ids
    elif style == "text":
        c["text"] = tok.decode([t for t in ids if t != EOS])
    return c


@pytest.fixture
def eos_model(model):
    """The tiny model with EOS made slightly likelier than token 189, so some completions stop early."""
    with torch.no_grad():
        model.lm_head.weight[EOS] = model.lm_head.weight[189] * 1.05
    return model


def test_greedy_matches_the_hf_backend_and_the_request_is_vllms(tiny_path, eos_model, tok):
    greedy = SamplingParams(max_new_tokens=12, seed=3)
    reference = generate(eos_model, tok, PROMPTS, greedy)
    assert any(reference.finished) and not all(reference.finished)
    with FakeVLLM(str(tiny_path), hf_greedy_responder(eos_model, tok)) as server:
        gens = generate(str(tiny_path), tok, PROMPTS, greedy, backend="vllm", base_url=server.url, batch_size=4)
    for field in ("prompt_index", "prompt_ids", "completion_ids", "completions", "reasoning", "finished"):
        assert getattr(gens, field) == getattr(reference, field), field
    assert gens.backend == "vllm" and gens.seed == 3
    bodies = {tuple(b["prompt"]): b for _, b in server.requests}
    assert len(bodies) == len(PROMPTS)
    for p in PROMPTS:
        ids = tok(render_prompt(tok, p), add_special_tokens=False)["input_ids"]
        # the prompt's own seed, from the call's seed and its token ids (not its position)
        assert bodies[tuple(ids)] == {"model": str(tiny_path), "prompt": ids, "n": 1, "max_tokens": 12,
                                      "temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": prompt_seed(3, ids),
                                      "stop_token_ids": [EOS], "skip_special_tokens": False,
                                      "spaces_between_special_tokens": False, "return_token_ids": True}


@pytest.mark.parametrize("style", ["logprobs", "text", "drop_eos"])
def test_token_id_fallbacks_give_the_same_completions(eos_model, tok, style):
    greedy = SamplingParams(max_new_tokens=12)
    with FakeVLLM("m", hf_greedy_responder(eos_model, tok)) as server:
        want = generate("m", tok, PROMPTS, greedy, backend="vllm", base_url=server.url)
    assert any(want.finished)
    with FakeVLLM("m", hf_greedy_responder(eos_model, tok, style)) as server:
        got = generate("m", tok, PROMPTS, greedy, backend="vllm", base_url=server.url)
    assert got.completions == want.completions and got.finished == want.finished
    if style != "text":  # re-tokenising text may split differently; ids are exact otherwise
        assert got.completion_ids == want.completion_ids


def scripted(tok, seed: int = 0):
    """Choice k of prompt p (known by its request seed): [110 + p, 20 + k, 20 + k] then EOS for even k, else cut at
    max_tokens; shuffled."""
    seeds = [prompt_seed(seed, tok(render_prompt(tok, p), add_special_tokens=False)["input_ids"]) for p in PROMPTS]

    def respond(body):
        s, out = body["seed"], []
        p = seeds.index(s)
        for k in range(body["n"]):
            if k % 2 == 0:  # with the sampled tokens' log-probs, as vLLM answers `logprobs: 0`
                out.append(choice(tok, k, [110 + p, 20 + k, 20 + k, EOS], "stop"))
                out[-1]["logprobs"] = {"tokens": ["a"] * 4, "token_logprobs": [-0.5, -0.25 * k, -1.0, -2.0],
                                       "top_logprobs": None}
            else:
                out.append(choice(tok, k, [110 + p] + [20 + k] * (body["max_tokens"] - 1), "length"))
        random.Random(s).shuffle(out)
        return out

    return respond


def test_sampling_request_and_prompt_major_order(tok):
    sampling = SamplingParams(max_new_tokens=5, n=3, do_sample=True, temperature=0.7, top_p=0.9, top_k=5, seed=100)
    with FakeVLLM("m", scripted(tok, 100)) as server:
        gens = generate("m", tok, PROMPTS, sampling, backend="vllm", base_url=server.url, batch_size=3)
    body = server.requests[0][1]
    assert (body["n"], body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (3, 0.7, 0.9, 5, 5)
    assert "use_beam_search" not in body and body["logprobs"] == 0
    assert gens.prompt_index == [p for p in range(len(PROMPTS)) for _ in range(3)]
    for j, (p, ids, done) in enumerate(zip(gens.prompt_index, gens.completion_ids, gens.finished, strict=True)):
        k = j % 3
        assert ids[0] == 110 + p  # the prompt's own seed: belongs to prompt p
        assert ids == ([110 + p, 20 + k, 20 + k, EOS] if k % 2 == 0 else [110 + p] + [20 + k] * 4)
        assert done == (k % 2 == 0)
        lp = gens.logprobs[j]  # the server's log-probs where it gave them, NaN where not
        assert lp == [-0.5, -0.25 * k, -1.0, -2.0] if k % 2 == 0 else (len(lp) == 5 and all(v != v for v in lp))


def test_beam_search_request_keeps_the_n_best(tok):
    with FakeVLLM("m", scripted(tok)) as server:
        gens = generate("m", tok, PROMPTS[:2], SamplingParams(max_new_tokens=5, num_beams=4, n=2), backend="vllm",
                        base_url=server.url)
    body = server.requests[0][1]
    assert body["use_beam_search"] is True and body["n"] == 4 and body["temperature"] == 0.0
    assert [ids[1] for ids in gens.completion_ids] == [20, 21, 20, 21]  # choices 0 and 1 of each prompt


def test_api_key_is_sent_and_http_errors_are_reported(tok, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    with FakeVLLM("m", scripted(tok), api_key="s3cret") as server:
        generate("m", tok, PROMPTS[:1], SamplingParams(max_new_tokens=2), backend="vllm", base_url=server.url)
    assert server.requests[0][0]["Authorization"] == "Bearer s3cret"
    monkeypatch.delenv("VLLM_API_KEY")
    with FakeVLLM("m", scripted(tok), api_key="s3cret") as server:
        with pytest.raises(VLLMServerError, match="HTTP 401.*VLLM_API_KEY"):
            generate("m", tok, PROMPTS[:1], SamplingParams(max_new_tokens=2), backend="vllm", base_url=server.url)
    with FakeVLLM("m", scripted(tok), status=400) as server:
        with pytest.raises(VLLMServerError, match="HTTP 400: top_k must be -1 or > 0"):
            generate("m", tok, PROMPTS[:1], SamplingParams(max_new_tokens=2), backend="vllm", base_url=server.url)


def test_wrong_model_name_lists_the_served_ones(tok):
    with FakeVLLM("served-name", scripted(tok)) as server:
        with pytest.raises(VLLMServerError, match=r"serves \['served-name'\].*served_model_name"):
            generate("/models/x", tok, PROMPTS[:1], SamplingParams(max_new_tokens=2), backend="vllm",
                     base_url=server.url)
        gens = generate("/models/x", tok, PROMPTS[:1], SamplingParams(max_new_tokens=2), backend="vllm",
                        base_url=server.url, served_model_name="served-name")
    assert server.requests[-1][1]["model"] == "served-name" and len(gens) == 1


def test_stop_ids_of_a_local_models_generation_config_are_sent(tiny_path, tmp_path, tok):
    """Like the "hf" backend, stop on every EOS the model folder's generation_config lists."""
    import shutil

    folder = shutil.copytree(tiny_path, tmp_path / "model")
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [EOS, 189]}))
    with FakeVLLM(str(folder), scripted(tok)) as server:
        gens = generate(str(folder), tok, PROMPTS[:1], SamplingParams(max_new_tokens=2), backend="vllm",
                        base_url=server.url)
    assert server.requests[0][1]["stop_token_ids"] == [EOS, 189] and len(gens) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_says_how_to_start_one(tok):
    url = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(VLLMServerError) as err:
        generate("/models/x", tok, PROMPTS[:1], SamplingParams(), backend="vllm", base_url=url, timeout=5,
                 max_retries=2, backoff=0.01)
    msg = str(err.value)
    assert url in msg and "vllm serve /models/x --host 127.0.0.1" in msg and "own environment" in msg
    assert "after 2 retries; last error: URLError" in msg and err.value.retries == 2


def test_serve_command_and_bad_model_argument(model, tok):
    assert serve_command("/m") == ["vllm", "serve", "/m", "--host", "127.0.0.1", "--port", "8000",
                                   "--logprobs-mode", "processed_logprobs"]
    cmd = serve_command("/m", port=9000, served_model_name="pol", dtype="bfloat16", extra_args=("--seed", "0"))
    assert shlex.join(cmd) == ("vllm serve /m --host 127.0.0.1 --port 9000 --logprobs-mode processed_logprobs "
                               "--served-model-name pol --dtype bfloat16 --seed 0")
    with pytest.raises(ValueError, match="model path"):
        generate(model, tok, PROMPTS[:1], SamplingParams(), backend="vllm")


# ------------------------------------------------------------------ a real vLLM server

URL = os.environ.get("ALIGN_VLLM_URL")
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _wait_for(url: str, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/models", timeout=2).read()
            return
        except OSError:
            time.sleep(2)
    pytest.fail(f"vllm serve did not answer at {url} within {seconds} s")


@pytest.mark.slow
@pytest.mark.skipif(not (URL or HAS_VLLM), reason="no vLLM: set ALIGN_VLLM_URL to a running server's .../v1 URL")
def test_real_vllm_server(tiny_path):
    """Against `vllm serve` (ALIGN_VLLM_URL, serving a local model folder, or one started here on the tiny model)."""
    from stages.models import load_causal_lm, load_tokenizer

    proc = None
    if URL:
        url = URL.rstrip("/")
        model_path = json.loads(urllib.request.urlopen(url + "/models", timeout=10).read())["data"][0]["id"]
        if not (Path(model_path) / "config.json").exists():
            pytest.skip(f"the server at {url} serves {model_path!r}, not a local model folder to compare with")
    else:
        model_path, port = str(tiny_path), _free_port()
        url = f"http://127.0.0.1:{port}/v1"
        proc = subprocess.Popen(serve_command(model_path, port=port, dtype="float32"))
        _wait_for(url, proc, 600)
    try:
        tok = load_tokenizer(model_path)
        greedy = SamplingParams(max_new_tokens=8)
        gens = generate(model_path, tok, PROMPTS, greedy, backend="vllm", base_url=url)
        assert gens.prompt_index == list(range(len(PROMPTS)))
        for ids, done in zip(gens.completion_ids, gens.finished, strict=True):
            assert 1 <= len(ids) <= 8 and (done or len(ids) == 8)
        reference = generate(load_causal_lm(model_path), tok, PROMPTS, greedy)
        first = sum(a[:1] == b[:1] for a, b in zip(gens.completion_ids, reference.completion_ids, strict=True))
        assert first >= 0.8 * len(PROMPTS)  # other kernels may flip near-ties later on, not the first token
        sampled = SamplingParams(max_new_tokens=8, n=2, do_sample=True, seed=5)
        runs = [generate(model_path, tok, PROMPTS, sampled, backend="vllm", base_url=url) for _ in range(2)]
        assert runs[0].completion_ids == runs[1].completion_ids and len(runs[0]) == 2 * len(PROMPTS)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def test_min_p_repetition_penalty_and_generation_kwargs_reach_the_request(tok):
    sampling = SamplingParams(max_new_tokens=5, n=3, do_sample=True, min_p=0.1, repetition_penalty=1.3,
                              generation_kwargs={"presence_penalty": 0.5}, seed=100)
    with FakeVLLM("m", scripted(tok, 100)) as server:
        generate("m", tok, PROMPTS[:1], sampling, backend="vllm", base_url=server.url)
    body = server.requests[0][1]
    assert (body["min_p"], body["repetition_penalty"], body["presence_penalty"]) == (0.1, 1.3, 0.5)
    with pytest.raises(ValueError, match="cache_implementation = 'static' is HF generate's"):
        generate("m", tok, PROMPTS[:1], SamplingParams(cache_implementation="static"), backend="vllm",
                 base_url="http://127.0.0.1:9")
