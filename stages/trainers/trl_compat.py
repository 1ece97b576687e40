"""TRL 1.16 names that `stages.trainers` does not support yet, and the error for setting one.

Our trainers and configs take TRL 1.16's argument and field names (tests/stages/trainers/
test_trl_compat.py walks TRL's own signatures and dataclasses and fails on any TRL name that
is neither ours nor listed here, and on any entry here that is no longer needed). A TRL name
listed here is never silently ignored: a trainer argument we accept by name only raises when
given, and a config key gets the error of `unsupported_trl_fields` (configs and params.yaml).

Keys: "name" for every TRL trainer or config that has it, "Class.name" for one (e.g.
"GRPOTrainer.tools"); a "Class.name" we have with a narrower type than TRL's is listed for the part we
lack. Values: why, and what to do instead.
No TRL import here (torch-free).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

TRL_VERSION = "1.16"

_VLLM = ("needs vLLM on a CUDA GPU: vLLM is reached as a separate OpenAI-compatible server (the generation backend "
         "'vllm'; GRPO: use_vllm with vllm_mode 'server'); TRL's colocated engine and weight sync are not built")
_LIGER = ("needs Liger's Triton kernels, which run on CUDA GPUs; the losses use our own chunked log-prob kernel "
          "instead")

UNSUPPORTED: dict[str, str] = {
    # ---- every config or trainer of TRL that has the name
    "use_liger_kernel": _LIGER, "liger_kernel_config": _LIGER,
    "use_vllm": _VLLM, "vllm_mode": _VLLM, "vllm_model_impl": _VLLM, "vllm_structured_outputs_regex": _VLLM,
    "vllm_gpu_memory_utilization": _VLLM, "vllm_server_host": _VLLM,
    "vllm_server_port": _VLLM, "vllm_server_timeout": _VLLM, "vllm_group_port": _VLLM,
    "vllm_tensor_parallel_size": _VLLM, "vllm_enable_sleep_mode": _VLLM, "vllm_max_model_length": _VLLM,
    "ds3_gather_for_generation": "needs DeepSpeed ZeRO-3, which runs on CUDA GPUs and is not used here",
    # ---- one trainer or config
    "GRPOConfig.log_completions_hub_repo": "needs the Hugging Face Hub (a server): completions go to the run's "
                                           "trackers",
}


def unsupported_reason(owner: str, name: str) -> str | None:
    """Why TRL's `owner.name` (e.g. "GRPOConfig", "use_vllm") is not supported, or None when it is not listed."""
    return UNSUPPORTED.get(f"{owner}.{name}", UNSUPPORTED.get(name))


def unsupported_message(qualified: str, name: str) -> str:
    """The error for a TRL setting we do not support: names it as TRL's, says why and what to do."""
    owner = qualified.rsplit(".", 1)[0]
    reason = unsupported_reason(owner, name) or "not listed"
    return (f"{qualified}: TRL {TRL_VERSION}'s `{name}` is not supported by stages.trainers yet ({reason}); "
            f"remove it")


def unsupported_trl_fields(config, given: Mapping[str, Any] | Iterable[str]) -> list[tuple[str, str]]:
    """[(key, message)] for every key of `given` that names a TRL setting of `config` we do not support.

    config: our config class (its dataclass fields tell which keys are ours) or its name.
    given: the keys set by the user (kwargs, a params.yaml section) with their values, or the keys alone.
    A listed name that is a field of ours inherited from `transformers.TrainingArguments` (e.g.
    use_liger_kernel) is refused only when its value differs from the default; one declared by our own
    config is ours and never refused; one we lack is refused whenever given.
    """
    name = config if isinstance(config, str) else config.__name__
    fields = {} if isinstance(config, str) else {f.name: f for f in dataclasses.fields(config)}
    values = dict(given) if isinstance(given, Mapping) else dict.fromkeys(given, _UNSET)
    problems = []
    for key, value in values.items():
        if unsupported_reason(name, key) is None:
            continue
        field = fields.get(key)
        if field is not None and (not inherited_from_transformers(config, key) or value is _UNSET
                                  or value == _default(field)):
            continue
        problems.append((key, unsupported_message(f"{name}.{key}", key)))
    return problems


_UNSET = object()


def inherited_from_transformers(config: type, field: str) -> bool:
    """Whether `config`'s field is declared by a transformers class (TrainingArguments), not by our own."""
    for klass in config.__mro__:
        if field in klass.__dict__.get("__annotations__", {}):
            return klass.__module__.startswith("transformers.")
    return False


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _UNSET
