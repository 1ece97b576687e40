"""Tiny random-weight models of real architectures, built locally (no hub), for the architecture matrix.

Each builder writes an ordinary Hugging Face model folder: a byte-level BPE tokenizer trained
on the built-in task's corpus with the architecture's own special tokens and chat template
(as `stages.builtin.tiny` builds the built-in one), and a randomly initialised model whose
config carries what makes the architecture different:

| name    | class              | what it exercises                                                  |
|---------|--------------------|--------------------------------------------------------------------|
| qwen2   | Qwen2ForCausalLM   | tied input/output embeddings, ChatML template, grouped-query attention |
| gpt2    | GPT2LMHeadModel    | no chat template (plain-string data), pad == EOS, learned positions |
| gemma2  | Gemma2ForCausalLM  | final and attention logit soft-capping (the logits path), BOS in the template |
| mistral | MistralForCausalLM | [INST] template without a generation prompt, EOS written by the template |

(Llama is the built-in `builtin:tiny`.)
"""
from __future__ import annotations

from pathlib import Path

from stages.builtin import arithmetic

SIZE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 512}

CHATML = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")
GEMMA = ("{{- bos_token -}}{%- for m in messages -%}"
         "{{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + m['content'] "
         "+ '<end_of_turn>\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}"
         "{%- endif -%}")
MISTRAL = ("{{- bos_token -}}{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}"
           "{{- m['content'] + eos_token -}}{%- else -%}{{- '[INST] ' + m['content'] + ' [/INST]' -}}{%- endif -%}"
           "{%- endfor -%}")


def train_tokenizer(*, eos: str, pad: str, bos: str | None = None, extra: tuple[str, ...] = (),
                    chat_template: str | None = None, vocab_size: int = 384):
    """A byte-level BPE with single-digit tokens over the built-in task's corpus, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([pad, eos, *([bos] if bos else []), *extra, arithmetic.THINK_OPEN,
                                   arithmetic.THINK_CLOSE]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(arithmetic.corpus(), trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos,
                                   additional_special_tokens=specials[1:], chat_template=chat_template,
                                   model_max_length=512, padding_side="right")


def _ids(tok) -> dict:
    return {"vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id}


def qwen2(folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = train_tokenizer(eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",), chat_template=CHATML)
    return _save(folder, tok, Qwen2ForCausalLM(Qwen2Config(**SIZE, **_ids(tok), tie_word_embeddings=True)))


def gpt2(folder: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = train_tokenizer(eos="<|endoftext|>", pad="<|endoftext|>")  # GPT-2 has no pad token: EOS pads
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, n_inner=64, n_positions=512, **_ids(tok))
    return _save(folder, tok, GPT2LMHeadModel(config))


def gemma2(folder: Path) -> Path:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tok = train_tokenizer(eos="<end_of_turn>", pad="<pad>", bos="<bos>", extra=("<start_of_turn>",),
                          chat_template=GEMMA)
    config = Gemma2Config(**{**SIZE, "num_hidden_layers": 2}, **_ids(tok), head_dim=16, query_pre_attn_scalar=16,
                          # Gemma 2 caps at 30; a random-weight model's logits are far below that, so it caps
                          # at 1 here, where the capping changes every log-prob
                          final_logit_softcapping=1.0, attn_logit_softcapping=50.0, sliding_window=64,
                          attn_implementation="eager")
    return _save(folder, tok, Gemma2ForCausalLM(config))


def mistral(folder: Path) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    tok = train_tokenizer(eos="</s>", pad="<pad>", bos="<s>", chat_template=MISTRAL)
    return _save(folder, tok, MistralForCausalLM(MistralConfig(**SIZE, **_ids(tok), sliding_window=None)))


def _save(folder: Path, tok, model) -> Path:
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(0)
    with torch.no_grad():  # a deterministic init, independent of the library's own
        gen = torch.Generator().manual_seed(0)
        gemma = "gemma" in type(model).__name__.lower()  # Gemma's norms scale by (1 + weight)
        for name, p in sorted(model.named_parameters()):
            if name.endswith("bias"):
                p.zero_()
            elif ("norm" in name or ".ln_" in name) and not gemma:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=tok.bos_token_id, do_sample=False)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


BUILDERS = {"qwen2": qwen2, "gpt2": gpt2, "gemma2": gemma2, "mistral": mistral}
