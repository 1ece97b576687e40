"""What every trainer does first with TRL-shaped arguments, so each `__init__` reads as its method only.

TRL 1.16's trainers take `model` as a hub id, a local folder or a module; load the tokenizer
from the model's folder when `processing_class` is not given; wrap the model with
`peft_config` (a peft `LoraConfig`, ...); accept `datasets.Dataset`, `IterableDataset` or, for
evaluation, a dict of them (each evaluated with its name in the metric prefix, as
`transformers.Trainer` does); and build a default config when `args` is None. Each step is one
function here; every trainer in `stages.trainers` calls them in this order:

    args = args or default_args(SFTConfig, model, "SFT")
    processing_class = load_processing_class(model, processing_class, args)  # + chat_template_path, eos/pad_token
    model = apply_peft(load_model(model, args, quantization_config), peft_config)  # model_init_kwargs

then, where the config asks, `apply_eos_to_model` (eos_token) and `disable_dropout`.

Plus `renamed_kwarg` (an old keyword kept for one release with a FutureWarning naming the new
one: a FutureWarning, not a DeprecationWarning, because Python shows it to the user by default, as
transformers does for its renamed arguments) and `refuse` (a TRL argument we accept by name only to
say it is not supported yet).
"""
from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stages.data.templates import read_chat_template
from stages.trainers.trl_compat import unsupported_message


def default_args(config_cls, model, method: str):
    """TRL's config when `args` is None: `config_cls(output_dir="<model folder name>-<method>")`."""
    return config_cls(output_dir=f"{Path(model_name(model) or 'model').name}-{method}")


def model_name(model) -> str | None:
    """The id or folder a model was given as or loaded from ("" or None when built in memory)."""
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else None


def model_init_kwargs(args) -> dict[str, Any]:
    """`args.model_init_kwargs` (TRL's field, where the config has it) with TRL's defaults: dtype float32,
    `trust_remote_code` from the config where it has that field. A dtype name stays a string here."""
    kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    if "torch_dtype" in kwargs:  # transformers' old name
        kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
    kwargs.setdefault("dtype", "float32")
    if getattr(args, "trust_remote_code", None) is not None:
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def load_model(model, args, quantization_config=None, *, load=None):
    """`model` itself when it is a module, else loaded from its id or folder with `model_init_kwargs(args)`:
    a causal LM (`AutoModelForCausalLM`), or with `load(path, dtype=..., trust_remote_code=...,
    quantization_config=...)` the trainer's own loader (the reward trainer's one-output classifier).
    `quantization_config` (a transformers `BitsAndBytesConfig`) applies to loading from a folder only."""
    from torch import nn

    if isinstance(model, nn.Module):
        given = [k for k, v in (("quantization_config", quantization_config),
                                ("args.model_init_kwargs", getattr(args, "model_init_kwargs", None))) if v]
        if given:
            raise ValueError(f"{' and '.join(given)} given, but model is an instantiated {type(model).__name__}: "
                             "they apply when the trainer loads the model itself; pass the model's folder as "
                             "model=..., or load it with those settings yourself")
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model = {model!r}: expected a model id, a model folder (str or Path) or a torch module "
                        "(a transformers PreTrainedModel or a peft PeftModel)")
    kwargs = model_init_kwargs(args)
    path = str(model)
    if kwargs["dtype"] == "auto":  # the dtype stored in the folder's config
        from transformers import AutoConfig

        stored = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False)).dtype
        kwargs["dtype"] = str(stored or "float32").removeprefix("torch.")
    if load is None:
        return _causal_lm(path, quantization_config=quantization_config, **kwargs)
    extra = sorted(set(kwargs) - {"dtype", "trust_remote_code"})
    if extra:
        raise ValueError(f"args.model_init_kwargs: {extra} are not used by this trainer's loader; it takes dtype and "
                         "trust_remote_code (load the model yourself for other settings)")
    return load(path, quantization_config=quantization_config, **kwargs)


def _causal_lm(path: str, *, dtype: str, quantization_config=None, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    from stages.models import explained

    if not hasattr(torch, str(dtype)) or not isinstance(getattr(torch, str(dtype)), torch.dtype):
        raise ValueError(f"args.model_init_kwargs.dtype = {dtype!r}: not a torch dtype; use float32, bfloat16, "
                         "float16 or auto")
    if quantization_config is not None:
        kwargs["device_map"] = {"": torch.cuda.current_device()}  # bitsandbytes places the quantised weights
        kwargs["quantization_config"] = quantization_config
    return explained("model")(AutoModelForCausalLM.from_pretrained)(path, dtype=getattr(torch, dtype), **kwargs)


def load_processing_class(model, processing_class=None, args=None):
    """`processing_class` when given, else the tokenizer of the model's folder (`stages.models.load_tokenizer`:
    EOS stands in for a missing pad token, as in TRL); then the config's tokenizer fields applied to it
    (`configure_tokenizer`)."""
    if processing_class is None:
        name = model_name(model)
        if not name:
            raise ValueError(f"processing_class is None and the model (a {type(model).__name__} built in memory) "
                             "names no folder to load a tokenizer from: pass processing_class="
                             "AutoTokenizer.from_pretrained(<its folder>), or pass model as that folder")
        from stages.models import load_tokenizer

        processing_class = load_tokenizer(
            name, trust_remote_code=bool(model_init_kwargs(args).get("trust_remote_code", False)))
    return configure_tokenizer(processing_class, args)


def configure_tokenizer(tokenizer, args):
    """TRL's tokenizer fields of `args` (where the config has them) set on `tokenizer`, in place as TRL does:
    `chat_template_path` (a .jinja/.j2 file, or a tokenizer folder whose template is copied), `eos_token`,
    and `pad_token` (else the tokenizer's, else its EOS). A token must be in the vocabulary; a template
    whose special tokens are not is refused (TRL adds them and resizes the embeddings; do that yourself)."""
    owner = type(args).__name__ if args is not None else "args"
    path = getattr(args, "chat_template_path", None)
    if path is not None:
        tokenizer.chat_template = read_chat_template(path, tokenizer, owner)
    vocab = tokenizer.get_vocab()
    for field in ("eos_token", "pad_token"):
        token = getattr(args, field, None)
        if token is not None and token not in vocab:
            raise ValueError(f"{owner}.{field} = {token!r}: not a token of the tokenizer's vocabulary "
                             f"({type(tokenizer).__name__}, {len(vocab)} tokens); give one of its tokens, e.g. "
                             f"{getattr(tokenizer, field, None)!r}, or add it with tokenizer.add_special_tokens and "
                             "resize the model's embeddings")
    if getattr(args, "eos_token", None) is not None:
        tokenizer.eos_token = args.eos_token
    if getattr(args, "pad_token", None) is not None:
        tokenizer.pad_token = args.pad_token
    elif getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def apply_eos_to_model(model, tokenizer, args) -> None:
    """With `args.eos_token` set, the model's config and generation config stop at it too (as TRL does), so a
    model trained to end on it also ends there when generating."""
    if getattr(args, "eos_token", None) is None:
        return
    from stages.sharding import unwrap

    inner = unwrap(model)
    eos = tokenizer.eos_token_id
    inner.config.eos_token_id = eos
    generation = getattr(inner, "generation_config", None)
    if generation is not None:
        current = generation.eos_token_id
        current = [] if current is None else [current] if isinstance(current, int) else list(current)
        generation.eos_token_id = [eos, *(i for i in current if i != eos)]


def disable_dropout(*models) -> None:
    """Dropout off in each model (None skipped): every `nn.Dropout`, and the attention-dropout rate that attention
    layers read from their own attribute (HF's Llama, Qwen, Mistral) or from the model's config."""
    from torch import nn

    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
            for holder in (module, getattr(module, "config", None)):
                if isinstance(getattr(holder, "attention_dropout", None), float):
                    setattr(holder, "attention_dropout", 0.0)  # noqa: B010 (the module or its config)


def apply_peft(model, peft_config=None, *, task_type: str = "CAUSAL_LM"):
    """`model` wrapped with the adapters of `peft_config` (`stages.trainers.adapters.wrap_peft`), or `model`
    unchanged when it is None. A config without a task type gets `task_type` (SEQ_CLS for reward models,
    whose `score` head PEFT then trains in full); the caller's config object is not modified."""
    if peft_config is None:
        return model
    from stages.trainers.adapters import wrap_peft
    from stages.trainers.reference_model import is_peft

    if is_peft(model):
        raise ValueError("peft_config given, but the model already has PEFT adapters: pass the base model with "
                         "peft_config, or the PeftModel without it")
    if getattr(peft_config, "task_type", None) is None:
        peft_config = copy.copy(peft_config)
        peft_config.task_type = task_type
    elif str(peft_config.task_type) not in (task_type, f"TaskType.{task_type}"):
        raise ValueError(f"peft_config.task_type = {peft_config.task_type}: this trainer trains a {task_type} "
                         f"model; set task_type={task_type!r} or leave it unset")
    return wrap_peft(model, peft_config)


def check_dataset(data, name: str, *, allow_dict: bool = False):
    """`data` as given when it is None, a `datasets.Dataset` / `IterableDataset`, or a list of row dicts;
    with `allow_dict`, a dict of those too (evaluation: each is evaluated under its own metric prefix).
    Anything else (a DataFrame, a list of strings, ...) fails here, naming `name`, before any work."""
    import datasets

    if data is None or isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        return data
    if isinstance(data, Mapping):
        if not allow_dict:
            raise TypeError(f"{name}: a {type(data).__name__} of datasets; training takes one dataset (a dict of "
                            "datasets is for eval_dataset: one evaluation per name)")
        return {key: check_dataset(value, f"{name}[{key!r}]") for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        bad = next((i for i, row in enumerate(data) if not isinstance(row, Mapping)), None)
        if bad is not None:
            raise TypeError(f"{name} row {bad}: a {type(data[bad]).__name__}; rows are dicts of columns "
                            "(e.g. {'prompt': ..., 'completion': ...})")
        return data
    hint = " (datasets.Dataset.from_pandas(df))" if type(data).__name__ == "DataFrame" else ""
    raise TypeError(f"{name}: a {type(data).__name__}; pass a datasets.Dataset, a datasets.IterableDataset or a "
                    f"list of row dicts{hint}")


def map_eval(eval_dataset, prepare, *, named: bool = False):
    """`prepare` applied to the eval dataset, or to each dataset of a dict of them (keys kept); with `named`,
    `prepare(dataset, name)`, name "eval_dataset" or "eval_dataset[key]" (for error messages)."""
    if isinstance(eval_dataset, Mapping):
        return {key: prepare(value, f"eval_dataset[{key!r}]") if named else prepare(value)
                for key, value in eval_dataset.items()}
    return prepare(eval_dataset, "eval_dataset") if named else prepare(eval_dataset)


def rows_with_prompts(data, name: str, *, method: str) -> list[dict]:
    """The rows of an online trainer's dataset (checked by `check_dataset`) as a list; each must have a 'prompt'
    (the error names `name`, `method` and the first row without one)."""
    rows = list(check_dataset(data, name) or [])
    missing = [i for i, r in enumerate(rows) if "prompt" not in r]
    if not rows or missing:
        where = f" (first: row {missing[0]})" if missing else " (the dataset is empty)"
        raise ValueError(f"{name}: {method} needs rows with a 'prompt' column; {len(missing)} of {len(rows)} rows "
                         f"lack it{where}")
    return rows


def renamed_kwarg(kwargs: dict[str, Any], old: str, new: str, value, *, trainer: str):
    """`value` of the new keyword, or the old keyword's (popped from `kwargs`) with a FutureWarning naming
    the new one; both at once is an error. Old names are kept for one release."""
    if old not in kwargs:
        return value
    old_value = kwargs.pop(old)
    if value is not None:
        raise TypeError(f"{trainer}: both {old}= and {new}= given; {old} is the old name of {new}: pass {new} only")
    warnings.warn(f"{trainer}({old}=...) is deprecated and will be removed in the next release; use {new}=... "
                  "(TRL's name)", FutureWarning, stacklevel=3)
    return old_value


def refuse(trainer: str, **given) -> None:
    """Raise for any TRL argument of `trainer` given a value (not None) that we do not support yet, with the
    reason from `stages.trainers.trl_compat.UNSUPPORTED`."""
    for name, value in given.items():
        if value is not None:
            raise ValueError(unsupported_message(f"{trainer}.{name}", name))


def no_unknown_kwargs(trainer: str, kwargs: dict[str, Any]) -> None:
    """A TypeError naming keywords no trainer takes (after `renamed_kwarg` popped the old names)."""
    if kwargs:
        raise TypeError(f"{trainer}.__init__() got unexpected keyword argument(s) {sorted(kwargs)}")


def looks_like_rewards(value) -> bool:
    """True for what is surely reward functions rather than a model: a list, a plain callable, a built-in
    reward name or a module:function path (catches TRL-order mistakes such as OnlineDPOTrainer(model, rewards))."""
    from torch import nn

    from stages.reward_function_names import REWARD_BUILTINS

    if isinstance(value, (list, tuple)):
        return True
    if isinstance(value, str):
        return value in REWARD_BUILTINS or (":" in value and not os.path.exists(value))
    return callable(value) and not isinstance(value, nn.Module)


def offline_inputs(config_cls: type, method: str, model, args, train_dataset, eval_dataset, processing_class):
    """(args, train_dataset, eval_dataset, processing_class) of an offline trainer (SFT, reward, DPO, KTO), in
    TRL's order: the default config, the datasets checked, the tokenizer given or loaded from the model's path."""
    args = args or default_args(config_cls, model, method)
    train_dataset = check_dataset(train_dataset, "train_dataset")
    eval_dataset = check_dataset(eval_dataset, "eval_dataset", allow_dict=True)
    return args, train_dataset, eval_dataset, load_processing_class(model, processing_class, args)
