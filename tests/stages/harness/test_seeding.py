"""Every stage is seeded before it draws anything: a rebuild gives byte-identical weights whatever the process
drew before (a fresh reward head, a PPO value head, GRPO's sampling), and the manifest says what else they
depend on."""
import pytest
import torch

from stages.harness import artifacts, runner, seeding


@pytest.fixture(scope="module")
def upstream(built_pipeline, tmp_path_factory):
    """A copy of the session's small pipeline (no fingerprint reads run.output_dir, so it is current there)."""
    import dataclasses
    import shutil

    params, _ = built_pipeline
    folder = tmp_path_factory.mktemp("seeding") / "artifacts"
    shutil.copytree(params.run.output_dir, folder)
    return dataclasses.replace(params, run=dataclasses.replace(params.run, output_dir=str(folder)))


def rebuild(stage: str, params) -> dict:
    torch.manual_seed(torch.seed())  # as if other work had run in this process before, with any RNG state
    return runner.run_stage(stage, params, force=True)


def test_reward_rebuilt_from_the_same_sft_is_byte_identical(upstream):
    first = artifacts.read_manifest(runner.output_dir(upstream, "reward"))
    again = rebuild("reward", upstream)
    assert again["executed"]
    assert again["outputs"]["files"]["model/model.safetensors"] == first["outputs"]["files"]["model/model.safetensors"]
    assert again["outputs"]["hash"] == first["outputs"]["hash"]
    assert again["metrics"]["accuracy"] == first["metrics"]["accuracy"]
    assert again["metrics"]["mean_margin"] == first["metrics"]["mean_margin"]  # to the 4th decimal, not only the count


@pytest.mark.parametrize("method, lora", [("grpo", False), ("ppo", False), ("online_dpo", False), ("kto", False),
                                          ("dpo", True)])
def test_policy_rebuilt_is_byte_identical(upstream, method, lora):
    """Every method (dpo through the flow test); PPO's fresh value head and LoRA's random A matrices too."""
    import dataclasses

    pol = upstream.policy
    section = getattr(pol, method)
    section = dataclasses.replace(section, lora=dataclasses.replace(section.lora, enabled=lora, r=4))
    pol = dataclasses.replace(pol, method=method, **{method: section})
    params = dataclasses.replace(upstream, policy=pol)
    runner.run_stage("reference", params)  # its fingerprint reads policy.method
    first = runner.run_stage("policy", params)
    again = rebuild("policy", params)
    assert again["executed"]
    weights = {f for f in first["outputs"]["files"] if f.endswith(".safetensors")}
    assert weights == {"model/adapter_model.safetensors"} if lora else "model/model.safetensors" in weights
    if method == "ppo":
        assert "model/value_head.safetensors" in weights
    assert again["outputs"]["files"] == first["outputs"]["files"]
    assert again["outputs"]["hash"] == first["outputs"]["hash"]


def test_seed_everything_fixes_every_generator():
    import random

    import numpy as np

    draws = []
    for _ in range(2):
        seeding.seed_everything(7)
        draws.append((random.random(), np.random.rand(), torch.rand(3).tolist(), torch.nn.Linear(4, 1).weight.tolist()))
    assert draws[0] == draws[1]
    seeding.seed_everything(8)
    assert torch.rand(3).tolist() != draws[0][2]


def test_manifest_records_what_outputs_depend_on(upstream):
    m = artifacts.read_manifest(runner.output_dir(upstream, "reward"))
    assert m["determinism"]["torch_num_threads"] == torch.get_num_threads()
    assert m["determinism"]["deterministic_algorithms"] is True
    assert {"machine", "cpu"} <= set(m["determinism"])
    assert set(m["logs"]["files"]) >= {"log_history.json"} and not set(m["logs"]["files"]) & set(m["outputs"]["files"])


def test_run_threads_sets_torchs_threads_for_the_stage(upstream):
    """run.threads reaches torch before the stage runs, is recorded in the manifest, and is not in the
    fingerprint (the same outputs computed with another thread count stay current)."""
    import dataclasses

    before = torch.get_num_threads()
    try:
        params = dataclasses.replace(upstream, run=dataclasses.replace(upstream.run, threads=2))
        assert runner.inspect("reward", params).current
        m = runner.run_stage("reference", params, force=True)  # upstream sft and score: no other test here moves them
        assert m["determinism"]["torch_num_threads"] == 2 == torch.get_num_threads()
        seeding.set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_auto_threads_are_the_available_cores_split_between_processes(monkeypatch):
    monkeypatch.setattr(seeding, "available_cores", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert seeding.resolve_threads("auto") == 8
    assert seeding.resolve_threads("auto", sharing=3) == 2  # 3 shards at once: 2 threads each, no oversubscription
    assert seeding.resolve_threads(3, sharing=4) == 3  # a number is taken as given
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 launched ranks on this machine
    assert seeding.resolve_threads("auto") == 2
    monkeypatch.setattr(seeding, "available_cores", lambda: 1)
    assert seeding.resolve_threads("auto", sharing=4) == 1


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "200000 100000\n"}, 2.0),  # cgroup v2, a container limited to 2 CPUs
    ({"cpu.max": "max 100000\n"}, None),  # v2, unlimited
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),  # no cgroup files (macOS, a bare host)
])
def test_cgroup_quota_caps_the_available_cores(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert seeding._cgroup_cpu_quota(str(tmp_path)) == expected


def test_params_refuse_zero_threads():
    from stages.harness.params_loader import ParamsError, load_params

    with pytest.raises(ParamsError, match=r"run.threads = 0: must be >= 1, or auto"):
        load_params("params.yaml", ["run.threads=0"])
    assert load_params("params.yaml", ["run.threads=auto"]).run.threads == "auto"
