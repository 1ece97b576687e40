"""LoRA and QLoRA for every training stage, from the `lora` params of that stage.

`quantization_config(lora)` is what `from_pretrained` needs for QLoRA (a 4- or 8-bit
base through bitsandbytes, CUDA only); `apply_lora(model, lora)` wraps a model with PEFT
adapters after checking that the target modules exist.
"""
from __future__ import annotations

import importlib.util


def quantization_config(lora, *, device: str, key: str = "lora.quantization", compute_dtype: str = "bfloat16"):
    """A BitsAndBytesConfig for QLoRA, or None; an error naming `key` (e.g. policy.lora.quantization) where it
    cannot work, raised before any model is loaded: QLoRA never silently falls back to plain LoRA."""
    if not lora.enabled or lora.quantization == "none":
        return None
    if device != "cuda":
        raise ValueError(f"{key} = {lora.quantization!r}: QLoRA needs a CUDA GPU (bitsandbytes quantises on the "
                         f"GPU) but this run is on {device}; set {key}: none for plain LoRA (unquantized), or run "
                         "on a GPU")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"{key} = {lora.quantization!r} needs bitsandbytes: pip install bitsandbytes, or set "
                         f"{key}: none for plain LoRA (unquantized)")
    import torch
    from transformers import BitsAndBytesConfig

    if lora.quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=getattr(torch, compute_dtype))
    return BitsAndBytesConfig(load_in_8bit=True)


def lora_module_names(model) -> list[str]:
    """Full names of the layers LoRA can adapt: Linear, Embedding, Conv1d/2d and GPT-2's Conv1D."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, Conv1D)
    return [name for name, m in model.named_modules() if isinstance(m, kinds)]


def linear_module_names(model) -> list[str]:
    """Short names of the layers LoRA can target (q_proj, v_proj, ...)."""
    return sorted({name.rsplit(".", 1)[-1] for name in lora_module_names(model)})


def missing_targets(targets: list[str], model) -> list[str]:
    """The entries of `lora.target_modules` that name no adaptable layer, matched as PEFT matches a list
    (a name equal to the layer's full name or ending it after a dot); [] for [all-linear]."""
    if targets == ["all-linear"]:
        return []
    names = lora_module_names(model)
    return [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]


def lora_target_problems(params) -> list[tuple[str, str]]:
    """Params problems for every enabled `<section>.lora.target_modules` naming layers the model lacks,
    checked on the model's skeleton (config.json only) before anything is loaded or launched."""
    sections = {"sft": (params.sft, False), "reward": (params.reward, True)}
    if params.policy.trained is not None:
        sections[f"policy.{params.policy.method}"] = (params.policy.trained, False)
    wanted = [(name, section, cls) for name, (section, cls) in sections.items()
              if section.lora.enabled and section.lora.target_modules != ["all-linear"]]
    if not wanted:
        return []
    from stages.models import model_skeleton

    problems: list[tuple[str, str]] = []
    for name, section, sequence_classifier in wanted:
        try:
            model = model_skeleton(params.model, sequence_classifier=sequence_classifier)
        except Exception:  # noqa: BLE001 -- model.name_or_path's own check reports an unloadable model
            return problems
        targets = section.lora.target_modules
        if missing := missing_targets(targets, model):
            problems.append((f"{name}.lora.target_modules", (
                f"= {targets}: {missing} name no layer of {type(model).__name__} (model.name_or_path = "
                f"{params.model.name_or_path}); the layers LoRA can adapt are {linear_module_names(model)}; "
                "name some of them or use [all-linear]")))
    return problems


def apply_lora(model, lora, *, task_type: str = "CAUSAL_LM"):
    """Wrap `model` with LoRA adapters from a params `lora` section (`wrap_peft` with its LoraConfig).

    task_type: PEFT's task type; "SEQ_CLS" for reward models, whose classifier head
    (`score` / `classifier`) PEFT then trains in full and saves with the adapter.
    """
    from peft import LoraConfig

    targets = lora.target_modules
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type=task_type,
                        target_modules="all-linear" if targets == ["all-linear"] else targets,
                        modules_to_save=list(lora.modules_to_save) or None)  # PEFT extends it in place
    return wrap_peft(model, config, key="lora")


def wrap_peft(model, config, *, key: str = "peft_config"):
    """`get_peft_model(model, config)` after checking that the target modules and modules_to_save exist
    (errors name `key`: "lora" for params, "peft_config" for a trainer's argument); a 4/8-bit model is
    prepared for k-bit training first."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    targets = config.target_modules
    targets = [targets] if isinstance(targets, str) and targets != "all-linear" else targets
    if targets is not None and targets != "all-linear":
        targets = sorted(targets)
        if missing := missing_targets(targets, model):
            raise ValueError(f"{key}.target_modules = {targets}: {missing} not in the model; the layers LoRA can "
                             f"adapt are {linear_module_names(model)} (or use all-linear)")
    named = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in config.modules_to_save or [] if m not in named]
    if missing:
        raise ValueError(f"{key}.modules_to_save = {config.modules_to_save}: {missing} not in the model")
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, config)


def trainable_fraction(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
