"""A GGUF file as a model source: checked from its header, dequantised once into a plain model folder.

GGUF is how local models are shared (llama.cpp, Ollama, LM Studio). transformers reads it with the
`gguf` package and dequantises every tensor to the dtype asked for; what it loads cannot be saved
again ("quantized with gguf and is not serializable"), so `dequantise` builds a fresh model from the
file's config without its `quantization_config`, copies the weights in and saves an ordinary folder
(`config.json`, safetensors, the tokenizer with the chat template the file carries). Every stage
then loads that folder. `gguf_problem` says why a file cannot be loaded, in about a second and
before any training: the `gguf` package missing, a truncated or foreign file, an architecture or a
quantisation type transformers cannot dequantise.

`stages.harness.model_paths` decides where the folder lies and when it is current.
"""
from __future__ import annotations

from pathlib import Path

SUFFIX = ".gguf"
INSTALL = "pip install 'align[real]'  (or: pip install gguf)"
# quantisation types transformers reads as they are; the rest go through gguf's dequantisers
PLAIN_TYPES = ("F32", "F16", "BF16")


def gguf_file(name_or_path: str, gguf_file: str | None = None) -> Path | None:
    """The GGUF file `model.name_or_path` (and `model.gguf_file`) name, or None when they name none: a `.gguf`
    path, a folder and a file name in it, or `builtin:smollm2-135m-instruct` (FileNotFoundError, with the
    install command, when its package is missing)."""
    from stages.builtin import smollm2

    if name_or_path == smollm2.NAME:
        return smollm2.gguf_path()
    if gguf_file:
        return Path(name_or_path).expanduser() / gguf_file
    if name_or_path.lower().endswith(SUFFIX):
        return Path(name_or_path).expanduser()
    return None


def gguf_problem(path: Path) -> str | None:
    """Why transformers cannot dequantise the GGUF file at `path`, or None. Reads the header and the tensor
    table only (memory-mapped, about a second for a 100 MB file)."""
    if not path.is_file():
        where = "no such file" if not path.exists() else "not a file"
        return f"{where}: {path.resolve()}"
    try:
        import gguf
    except ImportError:
        return f"reading a GGUF file needs the gguf package, which is not installed: {INSTALL}"
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        return f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')"
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, IndexError or struct errors on damage
        return (f"{path} cannot be read as GGUF ({type(e).__name__}: {e}); the file is damaged or truncated: "
                "download or copy it again")
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        return (f"{path} is truncated: its tensor table needs {end:,} bytes, the file has {size:,}; download or "
                "copy it again")
    return architecture_problem(reader) or quant_type_problem(reader)


def architecture_problem(reader) -> str | None:
    # the architectures transformers maps from GGUF (its GGUF_SUPPORTED_ARCHITECTURES, read without importing torch)
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    supported = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if arch is None:
        return "the file has no general.architecture field, so transformers cannot tell which model it holds"
    spellings = {arch, arch.replace("-", "_"), arch.replace("moe", "_moe")}  # llama.cpp's names vs transformers'
    if not spellings & set(supported):
        return (f"architecture {arch!r}: transformers cannot dequantise it from GGUF (it reads "
                f"{', '.join(supported)}); convert the original model folder instead, or use a GGUF of one of "
                "those architectures")
    return None


def quant_type_problem(reader) -> str | None:
    from gguf import quants

    readable = getattr(quants, "_type_traits", {})  # gguf's dequantisers by type (it has no public list)
    unread = sorted({t.tensor_type.name for t in reader.tensors
                     if t.tensor_type.name not in PLAIN_TYPES and t.tensor_type not in readable})
    if unread:
        return (f"quantisation type(s) {', '.join(unread)}: the installed gguf package cannot dequantise them; "
                "upgrade gguf (pip install -U gguf) or use a GGUF quantised as Q4_0, Q4_1, Q5_K, Q8_0, F16 or F32")
    return None


def dequantise(path: Path, dest: Path, *, dtype: str = "float32") -> None:
    """Write the model and tokenizer of GGUF file `path` into folder `dest` as a plain transformers folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for attr in ("quantization_config", "_name_or_path"):  # the folder is a plain model: no gguf on reload
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    if tokenizer.pad_token is None:  # many chat models ship without one; EOS is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
