"""Sampling from the policy during training, shared by online DPO, GRPO and PPO (and `score`'s settings).

A trainer config's `sampling` (`stages.trainers.method_fields.SamplingFields`: backend, decoding settings and
the completions per prompt, `n`, as one `stages.sampling.SamplingParams`) goes as it is into one
`stages.generation.generate` call (`sample_online`), with the call's seed. Every online trainer (and `score`)
seeds its sampling the same way:

    call seed   = stable_seed(run seed, draw)                      (stages.basics)
    prompt seed = stable_hash(call seed, the prompt's token ids)   (stages.generation.common.prompt_seed)

`draw` is the optimizer step (`state.global_step`: global, the same on every rank, restored on
resume); `score` samples once, draw 0. Each prompt's n completions come from its own prompt
seed, so a prompt gets the same token ids whatever its batch, position in it, rank, shard or
resume. Two equal prompts in one step get equal completions. Torch and the generation backends
are imported only when sampling.
"""
from __future__ import annotations

from typing import Any

from stages.sampling import GENERATION_BACKENDS, SamplingParams, backend_options  # noqa: F401 (re-exported)


def sample_online(model, tokenizer, prompts: list, sampling: SamplingParams, *, seed: int, precision: str = "no"):
    """`sampling.n` sampled completions per prompt from `model` (unwrapped from DDP), the call seeded `seed`:
    `Generations`. `sampling` is the trainer config's (`SamplingFields.sampling`).

    precision: the autocast `model`'s forward already runs under (the trainer's, "no", "bf16", "fp16"):
    the whole call becomes one autocast region, so the weights are cast once, not at every decode step
    (`stages.precision.cached_casts`; the same casts, so the same samples).

    With backend vllm the server named by the options (`backend_options`) samples from its own copy of the weights,
    which training does not update: the samples are off-policy once the policy has moved; their `logprobs` (the
    server's log-probs of what it sampled) are what GRPO's truncated importance sampling corrects with.
    """
    import dataclasses

    from stages.generation import generate
    from stages.precision import cached_casts

    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    options: dict[str, Any] = backend_options(sampling, path)
    source = options.pop("model") if sampling.backend == "vllm" else model
    with cached_casts(model, precision if sampling.backend != "vllm" else "no"):
        return generate(source, tokenizer, prompts, dataclasses.replace(sampling, seed=seed), **options)


def wait_for_server(base_url: str, *, timeout: float, poll: float = 2.0) -> None:
    """Wait until the OpenAI-compatible server at `base_url` (…/v1) lists its models, for at most `timeout` seconds
    (TRL's vllm_server_timeout); a ConnectionError naming the URL and how to start it when it never answers."""
    import json
    import time
    import urllib.error
    import urllib.request

    deadline, last = time.monotonic() + timeout, ""
    while True:
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=max(poll, 1.0)) as r:
                json.load(r)
                return
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = str(getattr(e, "reason", e))
        if time.monotonic() >= deadline:
            raise ConnectionError(f"no vLLM server answered at {base_url} within vllm_server_timeout = {timeout} s "
                                  f"({last}); start one with `vllm serve <model> --logprobs-mode processed_logprobs` "
                                  "(stages.generation.vllm.serve_command) or fix vllm_server_host / _port / "
                                  "vllm_server_base_url")
        time.sleep(poll)
