"""The support matrix: data parallelism and gradient accumulation change nothing but speed, for every
method, full fine-tuning and LoRA, on CPU.

Every run takes 2 optimizer steps of plain SGD (an update is -lr x the gradient, see
worker.py) on the built-in tiny model (hidden 32, 1 layer) from the same start, with the
same global batch of 4 rows (GRPO: 4 prompts x 4 sampled completions; online DPO: 4
prompts x 2; PPO: 4 prompts x 1):

- 2 processes (`accelerate launch` with configs/accelerate/ddp.yaml, gloo on CPU) x 2 rows
  give the update of 1 process x 4 rows: one launch trains every cell in turn;
- 1 row x 4 accumulation steps gives the update of 4 rows x 1, in this process.

The check: every parameter's update equal within 1e-3 of its largest entry
(`assert_same_update`). `pytest -s tests/distributed` prints the matrix with the worst
relative difference of every cell.
"""
import sys

import pytest
import torch

from stages.harness.config import LaunchConfig
from stages.harness.launch import launch_command
from stages.harness.processes import run_command
from tests.distributed import worker
from tests.distributed.conftest import free_port

STEPS = 2
BATCH = 4
RTOL = 1e-3
ATOL = 1e-7  # float32 resolution of the weights (~0.1) an update is read from: after - before
WAYS = ("2 proc", "accumulation")
MATRIX: dict[tuple[str, str, str], str] = {}  # (method, adapter, way) -> the cell's text in the printed table
NOT_INVARIANT = {
    # (method, way): why the cell cannot hold; its test checks that the run is refused before training
    ("ppo", "accumulation"): "n/a: PPO makes its own optimizer steps per rollout (num_ppo_epochs x num_mini_batches); "
                              "gradient_accumulation_steps must be 1 and is refused before training",
}


def worst_difference(got: dict, want: dict) -> float:
    """The largest |got - want| of a parameter's update relative to that update's largest entry, over all
    parameters; the entry floored at ATOL / RTOL, so the figure is <= RTOL exactly when `assert_same_update`
    holds (a LoRA A matrix that moved by 1e-6 is read to float32 resolution only)."""
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).abs().max() / (want[n].abs().max() + ATOL / RTOL)).item() for n in want)


def assert_same_update(got: dict, want: dict, rtol: float = RTOL, label: str = "") -> float:
    """Every parameter's update equal within rtol of its largest entry; the updates are not all zero.
    Returns the worst relative difference."""
    assert got.keys() == want.keys()
    assert sum(v.norm() ** 2 for v in want.values()) ** 0.5 > 1e-2  # the steps did move the weights
    for name in want:
        scale = want[name].abs().max().item()
        err = (got[name] - want[name]).abs().max().item()
        assert err <= rtol * scale + ATOL, f"{label} {name}: update differs by {err:.3g} (largest entry {scale:.3g})"
    return worst_difference(got, want)


def check_cell(method: str, adapter: str, way: str, got: dict, want: dict) -> None:
    """assert_same_update, with the measured difference recorded in MATRIX whether it holds or not."""
    worst = worst_difference(got, want)
    MATRIX[method, adapter, way] = f"{worst:.1e}" + ("" if worst <= RTOL else " FAIL")
    assert_same_update(got, want, label=f"{method} {adapter} {way}")


@pytest.fixture(scope="module", autouse=True)
def print_matrix():
    """After the module: the table, method x {full, LoRA} x {2 processes, accumulation} (pytest -s shows it)."""
    yield
    head = f"{'method':<16}" + "".join(f"{a + ' ' + w:>22}" for a in worker.ADAPTERS for w in WAYS)
    lines = ["", f"support matrix: worst relative difference of the update (pass: <= {RTOL:g})", head]
    for method in worker.METHODS:
        cells = [MATRIX.get((method, a, w), "n/a" if (method, w) in NOT_INVARIANT else "not run")
                 for a in worker.ADAPTERS for w in WAYS]
        lines.append(f"{method:<16}" + "".join(f"{c:>22}" for c in cells))
    lines += [f"{m} {w}: {why}" for (m, w), why in NOT_INVARIANT.items()]
    print("\n".join(lines))


@pytest.fixture(scope="module")
def one_process(model, tmp_path_factory):
    """{(method, adapter): update} of 1 process x 4 rows (x 1 accumulation step), every cell."""
    out = tmp_path_factory.mktemp("one")
    return {cell: worker.train(*cell, model, out, batch=BATCH, steps=STEPS) for cell in worker.CELLS}


@pytest.fixture(scope="module")
def two_processes(model, tmp_path_factory):
    """{(method, adapter): update} of 2 processes x 2 rows: one launch trains every cell in turn."""
    out = tmp_path_factory.mktemp("two")
    launch = LaunchConfig(num_processes=2, main_process_port=free_port())
    cmd = launch_command([worker.__file__, "--model", model, "--out", str(out), "--batch", str(BATCH // 2),
                          "--steps", str(STEPS)], launch, log_dir=str(out / "logs"), python=sys.executable)
    lines = []
    run_command(cmd, on_line=lines.append, timeout_s=300)
    text = "\n".join(lines)
    assert "[default0]:" in text and "[default1]:" in text  # really two ranks
    return {cell: torch.load(out / f"{worker.cell_name(*cell)}.pt", weights_only=True) for cell in worker.CELLS}


@pytest.mark.slow
@pytest.mark.parametrize("method,adapter", worker.CELLS, ids=[worker.cell_name(*c) for c in worker.CELLS])
def test_two_processes_give_the_single_process_update(method, adapter, two_processes, one_process):
    check_cell(method, adapter, WAYS[0], two_processes[method, adapter], one_process[method, adapter])


ACCUMULATED = [c for c in worker.CELLS if (c[0], WAYS[1]) not in NOT_INVARIANT]


@pytest.mark.parametrize("method,adapter", ACCUMULATED, ids=[worker.cell_name(*c) for c in ACCUMULATED])
def test_accumulating_micro_batches_of_1_equals_one_batch(method, adapter, model, one_process, tmp_path):
    accumulated = worker.train(method, adapter, model, tmp_path, batch=1, accum=BATCH, steps=STEPS)
    check_cell(method, adapter, WAYS[1], accumulated, one_process[method, adapter])


def test_ppo_refuses_gradient_accumulation_before_training(tmp_path):
    """PPO's own optimizer steps per rollout make accumulation meaningless: refused, naming the key."""
    from stages.trainers.ppo_trainer import PPOConfig

    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        PPOConfig(**worker.common_args(tmp_path, "ppo", "full", 1, 2, STEPS))


def test_sft_rows_differ_in_loss_tokens(model):
    """What makes the accumulation test bite: per-micro-batch token means would weight rows unequally."""
    from transformers import AutoTokenizer

    from stages.data.tokenize import tokenize_sft

    rows = tokenize_sft(AutoTokenizer.from_pretrained(model), worker.sft_rows()[:8], max_length=256)
    counts = [sum(r["completion_mask"]) for r in rows]
    assert max(counts) >= 3 * min(counts), counts
