"""Model and tokenizer loading from a local Hugging Face folder or a hub id, and the checks made before loading.

`local_or_hub` turns a `model.name_or_path` that is not a built-in into something `from_pretrained`
accepts; `model_source_problem` says, in seconds and before any training (params validation calls
it), why a path or hub id cannot be loaded; `model_skeleton` is a model without weights, for checks.
`builtin:tiny` is built into run.output_dir by `stages.harness.model_paths`.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from stages.model_source import model_source_problem


def local_or_hub(name: str) -> str:
    """A local folder's path, or else the hub id (cached, or with the hub reachable); FileNotFoundError naming
    `model.name_or_path` and why when it is neither."""
    if problem := model_source_problem(name):
        raise FileNotFoundError(f"model.name_or_path = {name!r}: {problem}")
    path = Path(name).expanduser()
    return str(path) if path.exists() else name


def model_skeleton(cfg, *, sequence_classifier: bool = False):
    """`cfg`: the `model` params section. The model's modules without its weights (on the meta device: no memory,
    no download), for checks made before any training. Reads only config.json (builtin:tiny: its config from
    model.builtin; a GGUF file: its header)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from stages.gguf import gguf_file

    if cfg.name_or_path == "builtin:tiny":
        from stages.builtin import tiny

        spec = {k: v for k, v in dataclasses.asdict(cfg.builtin).items() if k != "seed"}
        config = tiny.model_config(**spec)
    elif (file := gguf_file(cfg.name_or_path, cfg.gguf_file)) is not None:  # read from the file's header
        config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
        del config.quantization_config
    else:
        config = AutoConfig.from_pretrained(local_or_hub(cfg.name_or_path), trust_remote_code=cfg.trust_remote_code)
    auto = AutoModelForSequenceClassification if sequence_classifier else AutoModelForCausalLM
    if sequence_classifier:
        config.num_labels = 1
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=cfg.trust_remote_code)


def pick_device(device: str) -> str:
    import os

    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("run.device = 'cuda' but no CUDA device is visible; use auto or cpu")
    # a launched rank (stages.harness.launch): "cuda" is its own GPU
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return device


def explained(what: str):
    """Decorator: transformers' loading errors become ValueErrors naming the folder, the param and the fix."""
    def wrap(load):
        @functools.wraps(load)
        def loader(path, *args, **kwargs):
            try:
                return load(path, *args, **kwargs)
            except OSError as e:  # no weights, an unreadable config, a hub id without network
                raise ValueError(f"{path}: cannot load the {what}: {e}") from e
            except ValueError as e:
                msg = str(e)
                if "trust_remote_code" in msg:
                    raise ValueError(f"{path}: the model ships its own Python code, which runs only with "
                                     "model.trust_remote_code: true; set it only for a model whose code you have "
                                     "read and trust") from e
                if "Unrecognized configuration class" in msg:
                    kind = msg.split("<class '")[-1].split("'>")[0].rsplit(".", 1)[-1] if "<class '" in msg else "this"
                    raise ValueError(f"{path}: a {kind} model is not a causal language model (AutoModelForCausalLM "
                                     "has no class for it); model.name_or_path needs a decoder LM such as Llama, "
                                     "Qwen or GPT-2") from e
                raise
        return loader
    return wrap


@explained("tokenizer")
def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    # how it was loaded (HF_HUB_OFFLINE set or not), not what it is: saved with the tokenizer, it would make a
    # stage's output depend on the environment (tests/flows/test_reproducible.py)
    tok.init_kwargs.pop("local_files_only", None)
    if tok.pad_token is None:  # many base models ship without one; EOS is the usual stand-in
        tok.pad_token = tok.eos_token
    return tok


@explained("model")
def load_causal_lm(path: str, *, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False,
                   quantization_config=None):
    """A causal LM from a model folder, hub id or PEFT adapter folder (loaded onto its base)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, dtype), "trust_remote_code": trust_remote_code}
    adapter = Path(path) / "adapter_config.json"
    if adapter.exists():  # a PEFT adapter: load its base (itself maybe an adapter: recursion), merge the adapter in
        import json

        from peft import PeftModel

        base_path = json.loads(adapter.read_text())["base_model_name_or_path"]
        base = load_causal_lm(base_path, dtype=dtype, device="cpu", trust_remote_code=trust_remote_code)
        merged = PeftModel.from_pretrained(base, path).merge_and_unload()
        if quantization_config is not None:  # QLoRA on an adapter's model: merge at full precision, then quantise
            merged = load_quantized(merged, AutoModelForCausalLM, quantization_config, **kwargs)
        # the merged model *is* `path`: an adapter trained on it (e.g. LoRA DPO on a LoRA SFT model) names
        # `path` as its base, so loading that adapter later rebuilds the whole chain
        merged.config._name_or_path = merged.name_or_path = str(path)
        if quantization_config is not None:
            return merged  # bitsandbytes placed it; its quantised weights stay frozen (the adapters train)
        return merged.requires_grad_(True).to(device)  # PEFT loads for inference, frozen; training continues here
    if quantization_config is not None:  # bitsandbytes places the quantised weights itself
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization_config,
                                                    device_map={"": torch.cuda.current_device()}, **kwargs)
    # transformers wraps PreTrainedModel.to in functools.wraps, whose stub loses the method's binding of self
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)  # type: ignore[arg-type]


def load_quantized(model, auto_class, quantization_config, **kwargs):
    """`model` (full precision, e.g. a merged adapter) reloaded quantised by `auto_class.from_pretrained`
    with `quantization_config` onto the current GPU: bitsandbytes quantises while it loads weights from a
    folder, so the model goes through a temporary one (removed afterwards)."""
    import tempfile

    import torch

    with tempfile.TemporaryDirectory(prefix="align-quantize-") as folder:
        model.save_pretrained(folder)
        quantized = auto_class.from_pretrained(folder, quantization_config=quantization_config,
                                               device_map={"": torch.cuda.current_device()}, **kwargs)
    if not (getattr(quantized, "is_loaded_in_4bit", False) or getattr(quantized, "is_loaded_in_8bit", False)):
        raise RuntimeError(f"{type(quantized).__name__} came back unquantized from {quantization_config!r}")
    return quantized
