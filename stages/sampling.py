"""The sampling parameters: one record, `SamplingParams`, carried from a method's config
(`stages.trainers.method_fields.SamplingFields.sampling`) or a stage's section to the generation backend
(`stages.generation.generate`). No torch here: the configs build it during params validation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# stages.generation.BACKENDS, without importing torch
GENERATION_BACKENDS = ("auto", "hf", "decoder", "vllm", "continuous_batching")


@dataclass
class SamplingParams:
    """How to sample: one record from a method's config (`SamplingFields.sampling`) or a stage to the backend
    (`stages.generation.generate`). ``do_sample=False`` and ``num_beams == 1``: greedy.

    Attributes:
        max_new_tokens: generated tokens per completion at most (EOS included).
        n: completions per prompt (samples, or the n best beams).
        do_sample: sample from the (temperature, top-p, top-k filtered) distribution.
        temperature: divides the logits before sampling; > 0.
        top_p: nucleus sampling mass in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 = off.
        min_p: drop tokens less likely than min_p times the most likely one (sampling); 0 = off.
        repetition_penalty: divides the positive logits (multiplies the negative ones) of tokens already in
            the prompt or the completion (CTRL's penalty, HF's `repetition_penalty`); 1 = off.
        generation_kwargs: further keyword arguments of HF ``generate`` (the "hf" backend; e.g.
            no_repeat_ngram_size, bad_words_ids) or fields of the vLLM server's request (backend "vllm");
            the settings above are their own fields, not keys here.
        cache_implementation: HF ``generate``'s KV cache ("static", "offloaded", ...; the "hf" backend);
            None: the model's default.
        num_beams: beam search when > 1; returns the ``n`` best beams (``n <= num_beams``).
        seed: the call's seed; each prompt's completions are sampled from ``prompt_seed(seed, its
            token ids)``, so a prompt gets the same samples whatever else is in the call.
        backend: a ``stages.generation.BACKENDS`` key (GENERATION_BACKENDS).
        batch_size: prompts per ``generate`` call (in process), requests in flight ("vllm").
        vllm_url, vllm_model: backend "vllm": the server's ``.../v1`` URL and the model name it serves
            (None: the model's path).
        continuous_batching_config: backend "continuous_batching": keyword arguments of transformers'
            ContinuousBatchingConfig (None: a KV cache sized to each call's requests).
    """

    max_new_tokens: int = 64
    n: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None
    cache_implementation: str | None = None
    num_beams: int = 1
    seed: int = 0
    backend: str = "auto"
    batch_size: int = 64
    vllm_url: str = "http://127.0.0.1:8000/v1"
    vllm_model: str | None = None
    continuous_batching_config: dict[str, Any] | None = None

    def __post_init__(self):
        problems = []
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            problems.append(f"SamplingParams.max_new_tokens = {self.max_new_tokens!r}: must be an int >= 1 "
                            "(the most tokens generated per completion)")
        if not _is_int(self.n) or self.n < 1:
            problems.append(f"SamplingParams.n = {self.n!r}: must be an int >= 1 (completions per prompt)")
        if not _is_int(self.num_beams) or self.num_beams < 1:
            problems.append(f"SamplingParams.num_beams = {self.num_beams!r}: must be an int >= 1 (1 = no beam search)")
        elif _is_int(self.n) and self.num_beams > 1 and self.n > self.num_beams:
            problems.append(f"SamplingParams.n = {self.n} > num_beams = {self.num_beams}: beam search returns at "
                            f"most num_beams completions; set num_beams >= {self.n} or n <= {self.num_beams}")
        if self.do_sample and not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            problems.append(f"SamplingParams.temperature = {self.temperature!r}: must be > 0 when do_sample = True "
                            "(1.0 samples from the model's distribution); for greedy decoding set do_sample = False")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            problems.append(f"SamplingParams.top_p = {self.top_p!r}: must be in (0, 1] (1.0 = off; 0.9 keeps the "
                            "most likely tokens holding 90% of the mass)")
        if not _is_int(self.top_k) or self.top_k < 0:
            problems.append(f"SamplingParams.top_k = {self.top_k!r}: must be an int >= 0 (0 = off)")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p < 1):
            problems.append(f"SamplingParams.min_p = {self.min_p!r}: must be in [0, 1) (0 = off; 0.05 drops tokens "
                            "under 5% of the most likely one's probability)")
        if not (isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0):
            problems.append(f"SamplingParams.repetition_penalty = {self.repetition_penalty!r}: must be > 0 (1.0 = off; "
                            "1.1-1.3 discourages repeats)")
        owned = sorted(set(self.generation_kwargs or {}) & OWNED_GENERATE_KEYS)
        if owned:
            problems.append(f"SamplingParams.generation_kwargs sets {owned}: those are sampling settings of their own "
                            "(max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, n, num_beams, "
                            "cache_implementation) or set by the backend (EOS, padding, logits processors); set the "
                            "field instead")
        if self.backend not in GENERATION_BACKENDS:
            problems.append(f"SamplingParams.backend = {self.backend!r}: unknown; supported: "
                            + ", ".join(GENERATION_BACKENDS))
        if not _is_int(self.batch_size) or self.batch_size < 1:
            problems.append(f"SamplingParams.batch_size = {self.batch_size!r}: must be an int >= 1 (prompts per call)")
        if not _is_int(self.seed):
            problems.append(f"SamplingParams.seed = {self.seed!r}: must be an int")
        greedy = not self.do_sample and self.num_beams == 1
        if greedy and _is_int(self.n) and self.n > 1:
            problems.append(f"SamplingParams.n = {self.n} with greedy decoding would give {self.n} identical "
                            "completions per prompt; set do_sample = True (or num_beams >= n), or n = 1")
        if problems:
            raise ValueError("invalid sampling parameters:\n  " + "\n  ".join(problems))

    @property
    def greedy(self) -> bool:
        return not self.do_sample and self.num_beams == 1


# generate keys that SamplingParams owns or the backends set: not accepted in generation_kwargs
OWNED_GENERATE_KEYS = frozenset({
    "max_new_tokens", "max_length", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "num_beams", "num_return_sequences", "n", "cache_implementation", "eos_token_id", "pad_token_id", "use_cache",
    "logits_processor", "generation_config", "seed", "max_tokens", "stop_token_ids", "prompt", "model", "logprobs",
})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def backend_options(s: Any, model_path: str | None) -> dict[str, Any]:
    """Options of the backend of `s` (a SamplingParams, or score's generation section): the vLLM server's URL and
    served model name (default: `model_path`); the engine's settings of continuous_batching."""
    if s.backend == "continuous_batching":
        return {"config": s.continuous_batching_config}
    if s.backend != "vllm":
        return {}
    return {"base_url": s.vllm_url, "model": s.vllm_model or model_path}
