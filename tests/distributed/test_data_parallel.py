"""Data parallelism and gradient accumulation change nothing but speed: the proofs, on CPU.

Every run takes 3 optimizer steps of plain SGD (an update is -lr x the gradient, see
worker.py) on the built-in tiny model from the same start, with the same global batch of
8 rows (GRPO: 8 prompts x 4 fixed completions):

- 2 processes (`accelerate launch` with configs/accelerate/ddp.yaml, gloo on CPU) x 4 rows
  give the update of 1 process x 8 rows, for SFT, DPO and the GRPO loss (loss_type dapo:
  divided by the loss tokens of the whole step summed over processes; the fixed completions
  have 2..9 tokens, so each rank's own count would give another update);
- 1 row x 8 accumulation steps gives the update of 8 rows x 1 for SFT (whose loss is
  normalised over the tokens of the whole accumulated batch, not per micro-batch: the rows
  alternate long and short completions so a per-micro-batch mean would differ), DPO and
  GRPO's dapo.
"""
import sys

import pytest
import torch

from stages.config import LaunchConfig
from stages.launch import launch_command
from stages.processes import run_command
from tests.distributed import worker
from tests.distributed.conftest import free_port

STEPS = 3


def assert_same_update(got: dict, want: dict, rtol: float = 1e-3, label: str = "") -> None:
    """Every parameter's update equal within rtol of its largest entry; the updates are not all zero."""
    assert got.keys() == want.keys()
    assert sum(v.norm() ** 2 for v in want.values()) ** 0.5 > 1e-2  # the steps did move the weights
    worst = 0.0
    for name in want:
        scale = want[name].abs().max().item()
        err = (got[name] - want[name]).abs().max().item()
        worst = max(worst, err / max(scale, 1e-12))
        assert err <= rtol * scale + 1e-7, f"{name}: update differs by {err:.3g} (largest entry {scale:.3g})"
    print(f"{label}: largest relative difference of the update {worst:.2g}")  # pytest -s shows the figure


@pytest.fixture(scope="module")
def one_process(model, tmp_path_factory):
    """{method: update} of 1 process x 8 rows (x 1 accumulation step)."""
    out = tmp_path_factory.mktemp("one")
    return {m: worker.train(m, model, out, batch=8, steps=STEPS) for m in worker.METHODS}


@pytest.mark.slow
def test_two_processes_give_the_single_process_update(model, one_process, tmp_path):
    launch = LaunchConfig(num_processes=2, main_process_port=free_port())
    cmd = launch_command([worker.__file__, "--model", model, "--out", str(tmp_path), "--batch", "4",
                          "--steps", str(STEPS)], launch, log_dir=str(tmp_path / "logs"), python=sys.executable)
    lines = []
    run_command(cmd, on_line=lines.append, timeout_s=240)
    text = "\n".join(lines)
    assert "[default0]:" in text and "[default1]:" in text  # really two ranks
    for method in worker.METHODS:
        assert_same_update(torch.load(tmp_path / f"{method}.pt"), one_process[method], label=f"{method} 2x4 vs 1x8")


@pytest.mark.parametrize("method", ["sft", "dpo", "grpo"])
def test_accumulating_8_micro_batches_of_1_equals_one_batch_of_8(method, model, one_process, tmp_path):
    accumulated = worker.train(method, model, tmp_path, batch=1, accum=8, steps=STEPS)
    assert_same_update(accumulated, one_process[method], label=f"{method} batch 1 x accumulation 8 vs 8 x 1")


def test_sft_rows_differ_in_loss_tokens(model):
    """What makes the accumulation test bite: per-micro-batch token means would weight rows unequally."""
    from transformers import AutoTokenizer

    from stages.data.tokenize import tokenize_sft

    rows = tokenize_sft(AutoTokenizer.from_pretrained(model), worker.sft_rows()[:8], max_length=256)
    counts = [sum(r["completion_mask"]) for r in rows]
    assert max(counts) >= 3 * min(counts), counts
