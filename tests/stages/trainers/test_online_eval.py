"""OnlineEval: a greedy exact-match evaluation every eval_steps, logged like any training metric."""
from stages.models import load_causal_lm, load_tokenizer
from stages.reward_functions import exact_match
from stages.trainers.callbacks import OnlineEval
from stages.trainers.sft_trainer import SFTConfig, SFTTrainer
from tests.stages.trainers.conftest import build_tiny, builtin_rows


def test_online_eval_logs_every_eval_steps(tmp_path):
    path = build_tiny(tmp_path / "m")
    rows = builtin_rows("sft", "messages", num_train=64, num_preference=4, num_eval=8)
    eval_rows = rows[:6]
    tok = load_tokenizer(str(path))
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=8, logging_steps=1,
                     report_to="none", use_cpu=True, save_strategy="no", learning_rate=1e-3, max_length=64)
    trainer = SFTTrainer(load_causal_lm(str(path)), args, processing_class=tok, train_dataset=rows)
    always = OnlineEval(trainer, eval_rows, every=2, score_fn=lambda p, c, **_: [1.0] * len(c), max_new_tokens=4,
                        name="eval_always")
    em = OnlineEval(trainer, eval_rows, every=2, score_fn=exact_match, max_new_tokens=4)
    trainer.add_callback(always)
    trainer.add_callback(em)
    trainer.train()
    logged = [(h["step"], h["eval_always"]) for h in trainer.state.log_history if "eval_always" in h]
    assert logged == [(2, 1.0), (4, 1.0)]
    # a tiny untrained model never answers 4 tokens of "a+b" right: exact match 0, and it was scored (not None)
    assert [s for s, _ in em.history] == [2, 4] and all(v == 0.0 for _, v in em.history)
    losses = [h for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all("eval_always" not in h for h in losses)  # its own log lines
