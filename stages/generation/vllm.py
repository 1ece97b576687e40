"""Generation backend "vllm": a client of a vLLM OpenAI-compatible server, over HTTP with the standard library.

vLLM pins its own torch and transformers, so it runs as a separate server in its own environment
(`serve_command()` builds its command line); `generate(path, tokenizer, prompts, sampling, backend="vllm",
base_url="http://127.0.0.1:8000/v1")` talks to it. Prompts are rendered with *our* tokenizer's chat template
and sent as token ids (``POST /v1/completions`` with ``prompt: [ids]``), so the server sees exactly the tokens
the in-process backends would feed the model. Completion token ids come back with ``return_token_ids``; older
servers' answers fall back to ``logprobs`` tokens written as ``token_id:N``, else the text is re-tokenised.
Sampling requests ask for ``logprobs: 0`` and return them as ``Generations.logprobs``: the distribution the
server sampled from under ``--logprobs-mode processed_logprobs``, which ``serve_command`` passes.

One request per prompt, ``batch_size`` in flight at once (the server batches them continuously); each request
carries its prompt's own seed, ``prompt_seed(seed, prompt token ids)``, so results do not depend on the batch
size, the prompt's position or the order requests arrive in.
"""
from __future__ import annotations

import math
import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stages.generation.common import (
    Generations,
    SamplingParams,
    build_generations,
    eos_token_ids,
    prompt_seed,
    render_and_tokenize,
    trim_at_eos,
)
from stages.openai_client import EndpointError, OpenAIClient

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
URL_ENV, API_KEY_ENV = "ALIGN_VLLM_URL", "VLLM_API_KEY"
PROTOCOLS = ("vllm", "openai")


class VLLMServerError(EndpointError):
    """The vLLM server is unreachable (after the retries) or answered with an error."""


def serve_command(model_path: str, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
                  dtype: str | None = None, extra_args: tuple[str, ...] = ()) -> list[str]:
    """The ``vllm serve`` command line for ``model_path`` (run it in vLLM's own environment).

    Binds to ``host`` (loopback by default: the server has no authentication unless
    ``--api-key``/``VLLM_API_KEY`` is set). ``shlex.join(serve_command(...))`` gives the shell form.
    """
    cmd = ["vllm", "serve", str(model_path), "--host", host, "--port", str(int(port)),
           "--logprobs-mode", "processed_logprobs"]  # log-probs of the distribution it samples from
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if dtype:
        cmd += ["--dtype", dtype]
    return cmd + list(extra_args)


def generate(model, tokenizer, prompts: list, sampling: SamplingParams, *, batch_size: int = 64,
             progress: bool = False, base_url: str | None = None, api_key: str | None = None,
             served_model_name: str | None = None, timeout: float = 600.0, max_retries: int = 4,
             backoff: float = 1.0, protocol: str = "vllm", tools: list | None = None) -> Generations:
    """Completions of ``prompts`` from a running vLLM server (see :func:`stages.generation.generate`).

    Args:
        model: the model path the server was started with (its default served name).
        tokenizer: that model's tokenizer (renders and tokenises prompts, decodes completions);
            None: loaded from ``model``.
        base_url: the server's ``.../v1`` URL; default ``$ALIGN_VLLM_URL`` or ``http://127.0.0.1:8000/v1``.
        api_key: sent as a bearer token; default ``$VLLM_API_KEY`` (unset: no header).
        served_model_name: the name in requests, when the server was started with ``--served-model-name``.
        timeout: seconds to wait for one prompt's answer.
        max_retries, backoff: retries of a request that timed out, was refused or got HTTP 429/5xx, the first
            after `backoff` seconds, doubling (`stages.openai_client`); then `VLLMServerError`.
        protocol: "vllm" (token-id prompts and vLLM's extensions: exact tokens, stop ids, top_k, beams) or
            "openai" (the rendered prompt as text and the standard fields only, for any OpenAI-compatible
            server such as `transformers serve`; completions are re-tokenised from the text; no top_k, no beams).
    """
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError("backend 'vllm' takes the model path (or served model name) the server was started with, "
                         f"not a loaded {type(model).__name__}; pass the model folder as `model`")
    if tokenizer is None:
        from stages.models import load_tokenizer

        tokenizer = load_tokenizer(str(model))
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r}: must be an int >= 1 (requests in flight at once)")
    if sampling.cache_implementation is not None:
        raise ValueError(f"cache_implementation = {sampling.cache_implementation!r} is HF generate's; the vLLM server "
                         "manages its own KV cache: leave it unset with backend 'vllm'")
    client = _Client(base_url or os.environ.get(URL_ENV) or DEFAULT_BASE_URL,
                     api_key if api_key is not None else os.environ.get(API_KEY_ENV), timeout, str(model),
                     max_retries=max_retries, backoff=backoff)
    name = served_model_name or str(model)
    eos = eos_token_ids(tokenizer, _LocalModel(model))
    rendered, prompt_ids = render_and_tokenize(tokenizer, prompts, tools)

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol = {protocol!r}: one of {', '.join(PROTOCOLS)}")
    if protocol == "openai":
        bodies = [openai_body(name, text, sampling, seed=prompt_seed(sampling.seed, ids))
                  for text, ids in zip(rendered, prompt_ids, strict=True)]
    else:
        bodies = [request_body(name, ids, sampling, eos, seed=prompt_seed(sampling.seed, ids)) for ids in prompt_ids]
    if bodies:
        client.check_model(name)  # fail fast with one clear error, before spawning threads
    bar = None
    if progress:
        import logging

        from stages.basics import Progress

        bar = Progress(logging.getLogger("stages.generation"), total=len(bodies), unit="prompts",
                       what="generate (vllm)")

    def one(body: dict) -> tuple[list[list[int]], list[list[float]]]:
        out = parse_response(client.post("/completions", body), tokenizer, eos, sampling.n)
        if bar is not None:
            bar.advance(1)
        return out

    with ThreadPoolExecutor(max_workers=max(1, min(batch_size, len(bodies)))) as pool:
        answers = list(pool.map(one, bodies))
    if bar is not None:
        bar.finish()
    sampled = sampling.do_sample and sampling.num_beams == 1
    logprobs = [lp for _, lp in answers] if sampled else None
    return build_generations(tokenizer, prompts, rendered, prompt_ids, [ids for ids, _ in answers], eos,
                             seed=sampling.seed, backend="vllm", logprobs=logprobs)


class _LocalModel:
    """The generation config of a local model folder, so both backends stop on the same ids."""

    def __init__(self, model):
        self.generation_config = None
        if (Path(model) / "generation_config.json").is_file():
            from transformers import GenerationConfig

            self.generation_config = GenerationConfig.from_pretrained(str(model))


def openai_body(model_name: str, prompt: str, s: SamplingParams, *, seed: int) -> dict:
    """The standard ``/v1/completions`` JSON (no vLLM extensions): the rendered prompt as text."""
    if s.num_beams > 1 or (s.do_sample and s.top_k > 0):
        raise ValueError("protocol 'openai' has no beam search and no top_k (vLLM extensions); use protocol 'vllm' "
                         "against a vLLM server, or greedy / temperature / top_p sampling")
    return {"model": model_name, "prompt": prompt, "n": s.n, "max_tokens": s.max_new_tokens,
            "temperature": float(s.temperature) if s.do_sample else 0.0,
            "top_p": float(s.top_p) if s.do_sample else 1.0, "seed": seed}


def request_body(model_name: str, prompt_ids: list[int], s: SamplingParams, eos: list[int], *, seed: int) -> dict:
    """The ``/v1/completions`` JSON for one prompt (vLLM's extensions: top_k, stop_token_ids, return_token_ids...)."""
    body = {
        "model": model_name,
        "prompt": list(prompt_ids),
        "n": s.num_beams if s.num_beams > 1 else s.n,  # beam search returns all beams; we keep the n best
        "max_tokens": s.max_new_tokens,
        "temperature": float(s.temperature) if s.do_sample else 0.0,  # 0 = greedy in vLLM
        "top_p": float(s.top_p) if s.do_sample else 1.0,
        "top_k": s.top_k if s.do_sample and s.top_k > 0 else -1,  # -1 = off
        "seed": seed,
        "stop_token_ids": list(eos),
        "skip_special_tokens": False,  # keep <think> tags and EOS visible for the fallback path
        "spaces_between_special_tokens": False,
        "return_token_ids": True,
    }
    if s.do_sample and s.min_p > 0:
        body["min_p"] = float(s.min_p)
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = float(s.repetition_penalty)
    body.update(s.generation_kwargs or {})  # further fields of vLLM's sampling parameters
    if s.num_beams > 1:
        body["use_beam_search"] = True
    elif s.do_sample:
        body["logprobs"] = 0  # the sampled token's own log-prob, no alternatives
    return body


def parse_response(response: dict, tokenizer, eos: list[int], n: int) -> tuple[list[list[int]], list[list[float]]]:
    """The ``n`` completions' token ids (EOS-trimmed, EOS appended when the server stopped on one) in choice order,
    and each token's log-prob from ``logprobs.token_logprobs`` (NaN where the server gave none, e.g. an
    appended EOS, or ids re-tokenised from text)."""
    choices = sorted(response.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) < n:
        raise VLLMServerError(f"the vLLM server returned {len(choices)} choices for a request with n = {n}")
    out, logps = [], []
    for c in choices[:n]:
        ids = _choice_token_ids(c, tokenizer)
        given = [math.nan if v is None else float(v) for v in (c.get("logprobs") or {}).get("token_logprobs") or []]
        lp = (given + [math.nan] * len(ids))[:len(ids)]
        reason, stop = c.get("finish_reason"), c.get("stop_reason")
        if reason == "stop" and not (ids and ids[-1] in eos) and (stop is None or stop in eos):
            ids.append(stop if stop is not None else eos[0])  # the server dropped the EOS it stopped on
            lp.append(math.nan)
        ids = trim_at_eos(ids, eos)
        out.append(ids)
        logps.append(lp[:len(ids)])
    return out, logps


def _choice_token_ids(choice: dict, tokenizer) -> list[int]:
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.split(":", 1)[1]) for t in tokens]
    return list(tokenizer(choice.get("text", ""), add_special_tokens=False)["input_ids"])


class _Client:
    """`stages.openai_client.OpenAIClient` (retries of timeouts, 429 and 5xx included) with vLLM's hints on errors."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float, model: str, max_retries: int = 4,
                 backoff: float = 1.0):
        self.http = OpenAIClient(base_url, api_key, timeout=timeout, max_retries=max_retries, backoff=backoff)
        self.base_url, self.model = self.http.base_url, model

    def post(self, path: str, body: dict) -> dict:
        return self._send(lambda: self.http.post(path, body))

    def get(self, path: str) -> dict:
        return self._send(lambda: self.http.get(path))

    def _send(self, call) -> dict:
        try:
            return call()
        except EndpointError as e:
            if e.status is None:
                raise VLLMServerError(
                    f"cannot reach the vLLM server at {self.base_url} ({e}); start it with: "
                    f"{shlex.join(serve_command(self.model))} in its own environment (vLLM pins its own torch and "
                    f"transformers; see README, 'Generation'), or point base_url / ${URL_ENV} at a running one",
                    endpoint=e.endpoint, retries=e.retries) from None
            hint = ""
            if e.status == 404 and "model" in str(e).lower():
                hint = f"; the server serves {self._served_models()}: pass one as served_model_name"
            elif e.status in (400, 422) and "unexpected field" in str(e).lower():
                hint = ("; this server does not take vLLM's extensions: pass protocol='openai' (standard fields, "
                        "text prompts) for another OpenAI-compatible server")
            elif e.status == 401:
                hint = f"; set {API_KEY_ENV} (or api_key=) to the key the server was started with"
            raise VLLMServerError(f"vLLM server {e}{hint}",
                                  endpoint=e.endpoint, status=e.status, retries=e.retries) from None

    def check_model(self, name: str) -> None:
        served = [m.get("id") for m in self.get("/models").get("data", [])]
        if served and name not in served:
            raise VLLMServerError(f"the vLLM server at {self.base_url} serves {served}, not {name!r}; pass "
                                  "served_model_name= (or the model path it was started with)",
                                  endpoint=self.base_url)

    def _served_models(self) -> list[str]:
        try:
            return [m.get("id") for m in self.get("/models").get("data", [])]
        except VLLMServerError:
            return []
