"""One DPO step traced (benchmarks/forward_path.py): the model is unwrapped once per forward, where the forward
starts, and the blocks below (packing, the forward's hidden states, the head, the kernel) never unwrap again."""
from __future__ import annotations

from benchmarks.forward_path import counts, dpo_step, heights


def test_the_dpo_forward_unwraps_each_model_once_at_its_edge():
    calls = dpo_step()
    unwraps = [where for module, name, where in calls if (module, name) == ("stages.sharding", "unwrap_wrappers")]
    assert unwraps == ["stages.logprobs.causal_lm"] * 2, unwraps  # the policy's and the reference's view
    modules = [m for m, _, _ in calls]
    assert not [c for c in calls if c[2].startswith("stages.pair_packing.") and c[0] == "stages.sharding"]
    h = heights(set(modules))
    assert h["stages.trainers.dpo_trainer"] > h["stages.pair_packing"] > h["stages.sharding"] == h["stages.kernels"]
    policy = calls[:next(i for i, c in enumerate(calls) if c[1].endswith(".reference_logps"))]
    c = counts(policy, h)
    assert "stages.kernels" in c["modules"] and len(c["unwraps"]) == 1
    # was 9 when each block unwrapped the model itself; the shared-prefix block (stages.batch_prefix, above the
    # packing it runs on) adds one
    assert len(c["ups"]) <= 6
