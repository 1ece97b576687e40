"""The reward stage's trainer with the held-out pair accuracy after every epoch, by pair kind: pairs whose
rejected answer drops a carry ("carry") and pairs without a carry sum, whose rejected answer contradicts its
own column sums ("plain"; "train_plain": the first 400 training pairs of that kind).

    python benchmarks/reward_epochs.py OUTPUT_DIR SEED [KEY=VALUE ...]
    python benchmarks/reward_epochs.py /tmp/align/seed-1/shared 1 reward.num_train_epochs=8
    python benchmarks/reward_epochs.py artifacts 0 --frozen-layers 2   # an experiment, not a stage option

--frozen-layers K: the embeddings and the lowest K decoder blocks are frozen (the backward stops above them).

OUTPUT_DIR holds preprocess/ and sft/ of run.seed SEED (benchmarks/alignment.py's seed-<s>/shared); the
overrides are params.yaml keys. Nothing is written there (the checkpoints go to a temporary folder).
"""
import functools
import logging
import re
import sys
import tempfile
import time
import types
from pathlib import Path

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from reward_step import freeze_lower  # noqa: E402
from stages.builtin.arithmetic import needs_carry  # noqa: E402
from stages.params_loader import load_params, parse_overrides  # noqa: E402
from stages.data import read_jsonl  # noqa: E402
from stages.models import load_tokenizer  # noqa: E402
from stages.pipeline import training  # noqa: E402
from stages.pipeline.reward import split_pairs  # noqa: E402
from stages.seeding import prepare  # noqa: E402
from stages.trainers.reward import RewardConfig, RewardTrainer, evaluate_reward_model, load_reward_model  # noqa: E402,E501

shared, seed, *sets = sys.argv[1:]
frozen = 0
if "--frozen-layers" in sets:
    i = sets.index("--frozen-layers")
    frozen = int(sets[i + 1])
    del sets[i:i + 2]
parsed, _ = parse_overrides(sets)
p = load_params(ROOT / "params.yaml", {**parsed, "run.output_dir": shared, "run.seed": int(seed)})
prepare(p.run)
r = p.reward
pairs = read_jsonl(Path(shared) / "preprocess" / "preference.jsonl")
train_pairs, held = split_pairs(pairs, r.eval_fraction, p.run.seed)
def kind(row):
    a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
    return "carry" if needs_carry(a, b) else "plain"
start = str(Path(shared) / "sft" / "model")
tok = load_tokenizer(start)
model, _, _ = training.load_trainable_model(start, p, r, device="cpu", section="reward",
                                          load=functools.partial(load_reward_model, tokenizer=tok), task_type="SEQ_CLS")
if frozen:
    freeze_lower(model, frozen)
work = Path(tempfile.mkdtemp(prefix="reward-epochs-"))
ctx = types.SimpleNamespace(work=work, log=logging.getLogger("x"), params=p)
args = training.trainer_config(RewardConfig, r, {**training.trainer_args(ctx, r, device="cpu", section="reward"),
                                                "report_to": [], "save_strategy": "no"})
t0 = time.time()
class Ep(TrainerCallback):
    def on_epoch_end(self, a, state, control, model=None, **kw):
        out = {}
        for k in ("carry", "plain"):
            sub = [h for h in held if kind(h) == k]
            out[k] = round(evaluate_reward_model(model, tok, sub, batch_size=64, max_length=512)["accuracy"], 3)
        allq = evaluate_reward_model(model, tok, held, batch_size=64, max_length=512)["accuracy"]
        tr = [t for t in train_pairs[:400] if kind(t) == "plain"]
        out["train_plain"] = round(evaluate_reward_model(model, tok, tr, batch_size=64, max_length=512)["accuracy"], 3)
        print(f"epoch {state.epoch:.0f} step {state.global_step} acc {allq:.3f} {out} t={time.time()-t0:.0f}s", flush=True)
trainer = RewardTrainer(model, args=args, processing_class=tok, train_dataset=train_pairs, callbacks=[Ep()])
trainer.train()
print("train time", time.time() - t0, sets, f"frozen layers {frozen}")
