"""`builtin:tiny`: a small Llama-architecture causal LM and its tokenizer, built locally.

The tokenizer is a byte-level BPE trained on the built-in task's corpus. Digits are
pre-split into single tokens (as Llama 3's and Qwen's tokenizers do), because BPE merges
of digit strings make arithmetic much harder for small models. It carries a chat template
(with a generation prompt and `{% generation %}` markers for assistant-token masks) and the
reasoning tags `<think>` / `</think>` as special tokens.

The result is an ordinary Hugging Face model directory: `AutoModelForCausalLM` and
`AutoTokenizer.from_pretrained(path)` load it. Building is deterministic in the config.
"""
from __future__ import annotations

from pathlib import Path

from stages.builtin import arithmetic

EOS, PAD = "<|end|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, EOS, "<|system|>", "<|user|>", "<|assistant|>", arithmetic.THINK_OPEN, arithmetic.THINK_CLOSE]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|end|>' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)


def build_tokenizer(vocab_size: int):
    """Train the byte-level BPE with single-digit tokens; return a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(arithmetic.corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE,
        additional_special_tokens=SPECIAL_TOKENS[2:], model_max_length=512, padding_side="right",
    )


def model_config(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                 **tokens):
    """The Llama config of the built-in model (`tokens`: eos/pad ids, max_position_embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                       tie_word_embeddings=False, bos_token_id=None, **tokens)


def build_model(tokenizer, *, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int, seed: int):
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    config = model_config(vocab_size=len(tokenizer), hidden_size=hidden_size, num_layers=num_layers,
                          num_heads=num_heads, intermediate_size=intermediate_size,
                          max_position_embeddings=tokenizer.model_max_length,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # re-draw every weight from our own generator so the init does not depend on library internals
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    return model


def build(path: Path, *, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
          vocab_size: int, seed: int) -> Path:
    """Write tokenizer + model to `path` (an ordinary Hugging Face model directory)."""
    tokenizer = build_tokenizer(vocab_size)
    model = build_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                        intermediate_size=intermediate_size, seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path
