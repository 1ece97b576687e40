"""A model sharded by FSDP2 (`torch.distributed.fsdp.fully_shard`, 2 processes over gloo on CPU) gives what the
unsharded model gives: chunked log-probs (the head gathered without gradients, the logits path with them),
gradients, greedy generation with ranks that stop at different steps, and the frozen reference.

Accelerate does not run FSDP on CPU, so sharded_worker.py shards the built-in tiny model with torch's own
`fully_shard` under `torch.distributed.run`, the way accelerate's FSDP2 plugin does on GPUs: each decoder
layer, then the root ("blocks"); and once more with the head wrapped on its own ("head"), which FSDP2
reshards after the forward, so reading its weight outside the forward needs a gather.
"""
import json
import sys

import pytest

from stages.harness.processes import run_command
from tests.distributed import sharded_worker
from tests.distributed.conftest import free_port

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ranks(model, tmp_path_factory):
    """[rank 0's measurements, rank 1's], each {sharding: {...}} (see sharded_worker.measure)."""
    out = tmp_path_factory.mktemp("sharded")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), sharded_worker.__file__, "--model", model, "--out", str(out)]
    run_command(cmd, on_line=lambda line: None, timeout_s=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("how", sharded_worker.SHARDINGS)
def test_sharded_model_matches_the_unsharded_one(ranks, how):
    for rank, measured in enumerate(ranks):
        got = measured[how]
        print(f"{how} rank {rank}: " + ", ".join(f"{k} {v:.2g}" for k, v in got.items() if k.endswith("diff")))
        assert got["engine"] == "fsdp2" and got["plain_engine"] is None and got["head_is_dtensor"]
        # without gradients the head is read outside the forward (gathered when FSDP2 resharded it) ...
        assert got["chunked_without_grad"]
        assert got["head_is_dtensor_after_forward"] == (how == "head")
        assert got["logps_nograd_diff"] <= TOLERANCE and got["rollout_logps_diff"] <= TOLERANCE
        # ... with gradients the logits path: FSDP2 reduces only the gradients of its own forward
        assert not got["chunked_with_grad"]
        assert got["logps_grad_diff"] <= TOLERANCE and got["grad_rel_diff"] <= 1e-4
        # every rank runs its forwards in lockstep: rank 0 stops after 2 tokens, rank 1 runs on to 12
        assert got["generate_kwargs"] == {"synced_gpus": True} and got["plain_generate_kwargs"] == {}
        assert got["generated_equal"]
        assert got["generated_lengths"] == ([2, 12] if rank == 0 else [12, 12])
        # the reference is loaded from the checkpoint and sharded, never a copy of the policy's shards
        assert got["reference_sharded"] and not got["reference_shares_storage"] and got["reference_frozen"]
        assert got["reference_logps_diff"] <= TOLERANCE
