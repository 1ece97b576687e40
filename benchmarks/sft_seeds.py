"""Does our SFT learn as reliably as TRL's? Held-out accuracy over seeds, per loss path.

Usage::

    python benchmarks/sft_seeds.py                                  # chunked + logits, seeds 1..8
    python benchmarks/sft_seeds.py --paths chunked logits trl --seeds 1 2 3
    python benchmarks/sft_seeds.py --set warmup_ratio=0.05           # any TrainingArguments override
    python benchmarks/sft_seeds.py --json out.json                  # also write every run's figures

The task of issue 16, item 6 (and of NOTES.md's TRL reference point): two-digit additions in
chat form, with demonstrations that drop the carry 70 % of the time when a sum needs one
(`stages.builtin.arithmetic.generate`), a word-level tokenizer with one token per digit (built
here: digits, "+", newline and the chat markers), and a Llama of hidden 128, 4 layers, ~0.8M
parameters with random weights (`stages.builtin.tiny.build_model`, seeded). 12,000 rows,
batch 64, 4 epochs (752 steps), lr 2e-3 cosine, no warm-up (the issue's recipe: `warmup_steps=0`
is passed explicitly; SFTConfig's own default is now a 5 % warm-up, `--set warmup_steps=0.05`),
max_grad_norm 1, no weight decay, fp32; then greedy decoding of 300 held-out sums, exact match.
The labels cap accuracy at the share of sums without a carry (0.59 on these 300).

Paths, all `transformers.Trainer`s with the same arguments, model init and data order:
  chunked  stages.trainers.sft.SFTTrainer, use_chunked_logprobs=True (the default)
  logits   the same with use_chunked_logprobs=False
  trl      trl.SFTTrainer (benchmark only; bf16 and gradient checkpointing off as on ours)
The seed sets both the model's init and the Trainer's seed (data order).
Runs are sequential in one process with 1 torch thread (the machine is shared).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=344)
TRAINING = dict(per_device_train_batch_size=64, num_train_epochs=4, learning_rate=2e-3, lr_scheduler_type="cosine",
                warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0)
PATHS = ("chunked", "logits", "trl")


def build_tokenizer():
    """Word-level: one token per digit, '+', newline and each chat marker."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from stages.builtin import tiny

    vocab = {t: i for i, t in enumerate([*tiny.SPECIAL_TOKENS, *"0123456789", "+", "\n", "-", " "])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=tiny.PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(tiny.SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tiny.EOS, pad_token=tiny.PAD,
                                   chat_template=tiny.CHAT_TEMPLATE, additional_special_tokens=tiny.SPECIAL_TOKENS[2:],
                                   model_max_length=64, padding_side="right")


def task(num_train: int = 12_000, num_eval: int = 300, data_seed: int = 0):
    """(train rows as prompt/completion chat, eval [(prompt messages, right answer)])."""
    from stages.builtin import arithmetic

    splits = arithmetic.generate(num_train=num_train, num_preference=0, num_eval=num_eval, digits=2,
                                 error_rate=0.7, reasoning=False, seed=data_seed)
    train = [{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in splits["sft"]]
    evals = [(r["prompt"], r["completion"][0]["content"]) for r in splits["eval"]]
    return train, evals


def accuracy(model, tok, evals) -> float:
    """Greedy exact match; every prompt has the same length (two two-digit numbers), so one batch, no padding."""
    import torch

    ids = torch.tensor([tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"] for p, _ in evals])
    model.eval()
    with torch.no_grad():
        out = ids
        for _ in range(5):
            nxt = model(input_ids=out).logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], 1)
    right = 0
    for row, (_, answer) in zip(out[:, ids.shape[1]:].tolist(), evals):
        row = row[:row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
        right += "".join(tok.convert_ids_to_tokens(row)) == answer
    return right / len(evals)


def run(path: str, seed: int, train, evals, tok, overrides: dict, workdir: str) -> dict:
    import torch
    from transformers.trainer_callback import TrainerCallback

    from stages.builtin import tiny

    model = tiny.build_model(tok, seed=seed, **MODEL)
    common = dict(output_dir=workdir, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                  logging_steps=25, seed=seed, bf16=False, fp16=False, dataloader_num_workers=0,
                  **{**TRAINING, **overrides})
    if path == "trl":
        import trl

        args = trl.SFTConfig(gradient_checkpointing=False, max_length=64, **common)
        trainer = trl.SFTTrainer(model=model, args=args, processing_class=tok, train_dataset=_hf(train))
    else:
        from stages.trainers.sft import SFTConfig, SFTTrainer

        args = SFTConfig(use_chunked_logprobs=path == "chunked", max_seq_length=64, **common)
        trainer = SFTTrainer(model, args, processing_class=tok, train_dataset=train)

    history: list[dict] = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                history.append({"step": state.global_step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm")})

    trainer.add_callback(Keep())
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    acc = accuracy(trainer.model, tok, evals)
    del trainer
    torch.set_num_threads(1)
    return {"path": path, "seed": seed, "accuracy": acc, "final_loss": history[-1]["loss"], "seconds": seconds,
            "load": os.getloadavg()[0], "history": history}


def _hf(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


def mean_sd(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main() -> None:
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", nargs="+", default=["chunked", "logits"], choices=PATHS)
    ap.add_argument("--seeds", nargs="+", type=int, default=list(range(1, 9)))
    ap.add_argument("--num-train", type=int, default=12_000)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="TrainingArguments override, value parsed as JSON (e.g. warmup_ratio=0.05)")
    ap.add_argument("--json", default=None, help="write every run (with its loss/grad-norm history) here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    overrides = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.overrides)}

    tok = build_tokenizer()
    train, evals = task(args.num_train)
    print(f"overrides: {overrides or 'none'}; {len(train)} rows; load {os.getloadavg()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for seed in args.seeds:  # seeds outer, paths inner: every path sees the same background load
            for path in args.paths:
                r = run(path, seed, train, evals, tok, overrides, workdir)
                results.append(r)
                print(f"{path:8s} seed {seed:3d}: accuracy {r['accuracy']:.3f}  final loss {r['final_loss']:.3f}  "
                      f"{r['seconds']:.0f} s  load {r['load']:.2f}", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
    print("\npath      accuracy mean ± sd   final loss mean ± sd   failures (acc < 0.5)")
    for path in args.paths:
        rs = [r for r in results if r["path"] == path]
        am, asd = mean_sd([r["accuracy"] for r in rs])
        lm, lsd = mean_sd([r["final_loss"] for r in rs])
        fails = sum(r["accuracy"] < 0.5 for r in rs)
        print(f"{path:8s}  {am:.3f} ± {asd:.3f}          {lm:.3f} ± {lsd:.3f}            {fails}/{len(rs)}")


if __name__ == "__main__":
    main()
