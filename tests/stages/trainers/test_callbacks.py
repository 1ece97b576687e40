"""LogToLogger on a real Trainer run: progress lines with step/total, rate, ETA and the last loss."""
import logging
import re

import torch

from stages.trainers.callbacks import LogToLogger
from stages.trainers.sft_trainer import SFTConfig, SFTTrainer
from tests.stages.trainers.conftest import build_tiny, builtin_rows

LINE = re.compile(r"^step (\d+)/12 steps \((\d+)%\), [\d.e+]+ steps/s, (ETA \d+s|done in \d+s)(, loss=[\d.]+)?")


def test_progress_lines_have_rate_eta_and_loss(tmp_path, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("ALIGN_PROGRESS_EVERY_S", "0")  # a line at every step: what the rate limit lets through
    path = build_tiny(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=12, per_device_train_batch_size=8,
                     logging_steps=5, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    logger = logging.getLogger("stages.test-progress")
    forwarder = LogToLogger(logger)
    trainer = SFTTrainer(AutoModelForCausalLM.from_pretrained(path), args, processing_class=tok,
                         train_dataset=builtin_rows("sft", "messages", num_train=64, num_preference=10),
                         callbacks=[forwarder])
    with caplog.at_level(logging.INFO, logger="stages.test-progress"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.name == logger.name and r.levelno == logging.INFO]
    progress = [m for line in lines if (m := LINE.match(line))]
    print("\n" + "\n".join(m.group(0) for m in progress[-3:]))
    assert [int(m.group(1)) for m in progress] == [*range(1, 12), 12]  # every step but the last, then the close
    assert all(m.group(3).startswith("ETA") for m in progress[:-1]) and progress[-1].group(3).startswith("done in")
    # the Trainer logs after a step's on_step_end: step 5's loss shows from step 6 on
    assert [bool(m.group(4)) for m in progress] == [step > 5 for step in range(1, 13)]
    assert len(forwarder.history) >= 2  # the logged dicts are still kept
