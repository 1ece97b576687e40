"""TRL's documented tool-calling GRPO snippet (agent training: `tools=[multiply]`) on `stages.trainers`, import
line changed.

The block below is the snippet of TRL's agent-training announcement and docs (GRPO "Agent Training", a
`multiply` tool, six multiplication prompts, an accuracy reward that reads the episode's last message) with the
changes an offline machine and a short run force: the import line (`from stages.trainers import ...`),
`model=` a local folder instead of a hub id, and `args=` for a few steps. The folder is SmolLM2-135M-Instruct
(`builtin:smollm2-135m-instruct`, dequantised here unless --model names a folder) with align's ChatML tool
template (`stages.builtin.chat_templates.CHATML_TOOLS`; SmolLM2's own template cannot render tools), or with
--tiny a random 1-layer Llama with SmolLM2's tokenizer (the mechanics only: it will rarely call the tool).

    python examples/trl_tools.py [--model FOLDER | --tiny] [--steps 3] [--out DIR]

Prints one JSON line: {"example": "tools", "loss", "finite", "changed", "trainable", "tool_calls", "transcript"}:
the last training loss, whether it is finite, how many trainable tensors changed, the tool calls the run made
(tools/calls summed over its steps) and one logged episode. Tools run in this process, with its rights.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path


def prepare(out: Path, model: str | None, tiny: bool) -> str:
    """A local model folder whose chat template renders tools: SmolLM2 (or `model`) or a tiny random Llama."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from stages.builtin import smollm2
    from stages.builtin.chat_templates import CHATML_TOOLS

    folder = out / "model"
    folder.mkdir(parents=True, exist_ok=True)
    if model is None and not tiny:
        from stages.gguf import dequantise

        model = str(out / "smollm2")
        if not (Path(model) / "config.json").exists():
            dequantise(smollm2.gguf_path(), Path(model))
    if model is None:
        source = smollm2.gguf_path()
        tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    else:
        tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = CHATML_TOOLS.read_text()
    tok.save_pretrained(folder)
    if tiny:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
        LlamaForCausalLM(config).save_pretrained(folder)
    else:
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            link = folder / name
            if (Path(model) / name).exists() and not link.exists():
                link.symlink_to((Path(model) / name).resolve())
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a ChatML model folder (default: builtin:smollm2-135m-instruct)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama with SmolLM2's tokenizer")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    out = Path(cli.out or tempfile.mkdtemp(prefix="trl_tools_"))
    local = prepare(out, cli.model, cli.tiny)

    # ---- TRL's snippet; changed: the import, model= (a local folder), args= (a few steps)
    from datasets import Dataset

    from stages.trainers import GRPOConfig, GRPOTrainer

    def multiply(a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        return a * b

    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "What is 3 multiplied by 4?"}], "answer": 12},
            {"prompt": [{"role": "user", "content": "Calculate 7 times 8."}], "answer": 56},
            {"prompt": [{"role": "user", "content": "Find the product of 5 and 6."}], "answer": 30},
            {"prompt": [{"role": "user", "content": "What do you get when you multiply 9 by 9?"}], "answer": 81},
            {"prompt": [{"role": "user", "content": "Compute 12 multiplied by 11."}], "answer": 132},
            {"prompt": [{"role": "user", "content": "What is 15 times 14?"}], "answer": 210},
        ]
    )

    def accuracy(completions, answer, **kwargs):
        rewards = []
        for completion, ans in zip(completions, answer):  # noqa: B905 (TRL's snippet as written)
            if str(ans) in completion[-1]["content"]:
                rewards.append(1.0)
            else:
                rewards.append(0.0)
        return rewards

    trainer = GRPOTrainer(
        model=local,
        train_dataset=dataset,
        tools=[multiply],
        reward_funcs=accuracy,
        args=GRPOConfig(output_dir=str(out / "run"), max_steps=cli.steps, per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=64, max_tool_calling_iterations=2,
                        learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to="none",
                        log_completions=True, num_completions_to_print=0, tool_timeout=10.0),
    )
    # ---- end of the snippet (trainer.train() below, after noting the starting weights)

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    logs = [h for h in trainer.state.log_history if "loss" in h]
    rows = trainer.completions_log.last or [{}]
    print(json.dumps({"example": "tools", "loss": logs[-1]["loss"], "finite": math.isfinite(logs[-1]["loss"]),
                      "changed": sum(not after[n].detach().equal(p) for n, p in before.items()),
                      "trainable": len(before), "tool_calls": sum(h.get("tools/calls", 0) for h in logs),
                      "transcript": rows[0].get("completion")}))


if __name__ == "__main__":
    main()
