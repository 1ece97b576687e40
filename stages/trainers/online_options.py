"""TRL's settings shared by the configs of RLOO and on-policy distillation, declared once (torch-free).

Loading (`model_init_kwargs`, `trust_remote_code`: read by `stages.trainers.inputs.load_model`),
dropout, data order and padding, the vLLM server as TRL addresses it (`use_vllm` with
`vllm_mode: server`, host and port), and the logging of sampled completions. What each does at
run time lives in `stages.trainers.online_extras`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from stages.fields import param

DEFAULT_VLLM_URL = "http://127.0.0.1:8000/v1"  # SamplingFields' default for vllm_server_base_url
# generation_kwargs keys that override a field of ours, as in TRL ("they will override them"): key -> our field
OVERRIDES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "cache_implementation": "cache_implementation",
             "max_new_tokens": "max_completion_length"}


@dataclass
class OnlineOptions:
    """TRL 1.16's loading, data, vLLM-server and completion-logging fields (RLOOConfig, DistillationConfig).
    The sampling settings (min_p, repetition_penalty, generation_kwargs, cache_implementation) are SamplingFields',
    which every config using this mixin also has."""

    if TYPE_CHECKING:  # declared by SamplingFields (stages.trainers.method_fields)
        generation_kwargs: dict[str, Any] | None
        cache_implementation: str | None

    model_init_kwargs: dict[str, Any] | None = param(None, help="keyword arguments of from_pretrained when model is a "
                                                     "folder or id (dtype defaults to float32)")
    trust_remote_code: bool = param(False, help="allow model and tokenizer folders that ship their own code")
    disable_dropout: bool = param(False, help="set every dropout of the trained model to 0")
    shuffle_dataset: bool = param(True, help="shuffle the training prompts (false: dataset order)")
    pad_to_multiple_of: int | str | None = param(
        "auto", help="pad prompt and completion widths to a multiple of this (auto or null: no padding; TRL's auto "
        "pads only on AWS Neuron)", check=lambda v: v in ("auto", None) or (isinstance(v, int) and v >= 1),
        rule="must be an int >= 1, 'auto' or null")
    use_vllm: bool = param(False, help="sample from a vLLM server (vllm_mode: server); same as generation_backend: "
                           "vllm")
    vllm_mode: Literal["server", "colocate"] = param(
        "colocate", help="server: a vLLM server reached over its OpenAI API (the one mode built; colocate, TRL's "
        "default, needs a GPU engine inside the trainer and is refused when use_vllm is set)")
    vllm_server_host: str = param("127.0.0.1", help="host of the vLLM server, when vllm_server_base_url is not set")
    vllm_server_port: int = param(8000, help="port of the vLLM server, when vllm_server_base_url is not set",
                                  check=lambda v: 0 < v < 65536, rule="must be a TCP port (1-65535)")
    vllm_server_timeout: float = param(240.0, help="seconds to wait for the vLLM server to answer before training "
                                       "starts (use_vllm)", check=lambda v: v > 0, rule="must be > 0")
    chat_template_kwargs: dict[str, Any] | None = param(None, help="keyword arguments of the chat template when "
                                                        "conversational prompts are rendered (e.g. enable_thinking)")
    log_completions: bool = param(False, help="log a sample of (prompt, completion, reward) every logging_steps")
    num_completions_to_print: int | None = param(None, help="rows of that sample (null: all of the step's)",
                                                 check=lambda v: v >= 1, rule="must be >= 1 or null")
    log_unique_prompts: bool = param(False, help="one row per prompt in that sample")

    def online_problems(self) -> list[tuple[str, str]]:
        problems = []
        if self.use_vllm and self.vllm_mode != "server":
            problems.append(("vllm_mode", f"= {self.vllm_mode!r} with use_vllm: the colocated vLLM engine (a GPU "
                             "engine inside the trainer) is not built; start `vllm serve` and set vllm_mode: server"))
        backend = getattr(self, "generation_backend", "auto")
        extra = sorted(set(self.generation_kwargs or {}) - set(OVERRIDES))
        if extra and backend not in ("hf", "vllm") and not self.use_vllm:
            problems.append(("generation_kwargs", f"= {self.generation_kwargs}: {extra} are options of HF generate "
                             f"(or of a vLLM server), but generation_backend = {backend!r}; set generation_backend: "
                             "hf"))
        if self.cache_implementation is not None and (backend != "hf" or self.use_vllm):
            problems.append(("cache_implementation", f"= {self.cache_implementation!r} is an option of HF generate, "
                             f"but generation_backend = {backend!r}{' with use_vllm' if self.use_vllm else ''}; set "
                             "generation_backend: hf"))
        if self.use_vllm and backend not in ("auto", "vllm"):
            problems.append(("use_vllm", f"= True but generation_backend = {backend!r}: pick one (use_vllm is "
                             "generation_backend: vllm)"))
        return problems

    def _setting(self, name: str) -> Any:
        """A sampling setting, as generation_kwargs overrides it."""
        given = self.generation_kwargs or {}
        key = next((k for k, v in OVERRIDES.items() if v == name and k in given), None)
        return given[key] if key is not None else getattr(self, name)

    def sampling_settings(self) -> dict[str, Any]:
        """SamplingFields' settings, with generation_kwargs' overrides and TRL's use_vllm and host/port applied."""
        s = super().sampling_settings()  # type: ignore[misc]
        rest = {k: v for k, v in (self.generation_kwargs or {}).items() if k not in OVERRIDES}
        s.update(temperature=self._setting("temperature"), top_p=self._setting("top_p"), top_k=self._setting("top_k"),
                 max_new_tokens=self._setting("max_completion_length"), min_p=self._setting("min_p") or 0.0,
                 repetition_penalty=self._setting("repetition_penalty"),
                 cache_implementation=self._setting("cache_implementation"), generation_kwargs=rest or None)
        if not self.use_vllm:
            return s
        url = s["vllm_url"]
        if url == DEFAULT_VLLM_URL and (self.vllm_server_host, self.vllm_server_port) != ("127.0.0.1", 8000):
            url = f"http://{self.vllm_server_host}:{self.vllm_server_port}/v1"
        return {**s, "backend": "vllm", "vllm_url": url}
