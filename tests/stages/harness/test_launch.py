"""stages.harness.launch: the accelerate launch command of every shipped config, the checks before launching,
and the runner (streamed lines, its own deadline, a crashed rank ending the whole run)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from stages.harness import artifacts
from stages.harness.config import LaunchConfig
from stages.harness.launch import (
    CONFIG_DIR,
    LaunchError,
    check_batch,
    launch_command,
    needs_launch,
    preflight,
    training_rows,
    training_stages,
    wait_for_main,
)
from stages.harness.params_loader import ParamsError, load_params
from stages.harness.processes import LaunchFailed, run_command, stage_target
from tests.conftest import write_params

CONFIGS = {"single_process": "NO", "ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed_zero2": "DEEPSPEED",
           "deepspeed_zero3": "DEEPSPEED"}


def parse(cmd: list[str]):
    """The command as accelerate launch itself resolves it (config file merged), without launching."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(cmd[3:]))
    return args


@pytest.mark.parametrize("name", CONFIGS)
def test_command_line_of_each_config(name):
    processes, machines = (1, 1) if name == "single_process" else (16, 2)
    launch = LaunchConfig(num_processes=processes, num_machines=machines, machine_rank=machines - 1,
                          main_process_ip="10.0.0.1", main_process_port=29555, mixed_precision="bf16",
                          accelerate_config=f"configs/accelerate/{name}.yaml")
    cmd = launch_command(stage_target("sft", "run.yaml", ["sft.max_steps=3"]), launch, log_dir="/tmp/logs")
    config = str(CONFIG_DIR / f"{name}.yaml")
    assert cmd[3:15] == ["--config_file", config, "--num_processes", str(processes), "--num_machines",
                         str(machines), "--machine_rank", str(machines - 1), "--main_process_port", "29555",
                         "--main_process_ip", "10.0.0.1"]
    assert cmd[-7:] == ["-m", "stages", "sft", "--params", "run.yaml", "--set", "sft.max_steps=3"]
    assert "--cpu" not in cmd  # it would start a single process
    args = parse(cmd)
    kind = CONFIGS[name]
    assert (args.multi_gpu, args.use_fsdp, args.use_deepspeed) == (kind == "MULTI_GPU", kind == "FSDP",
                                                                  kind == "DEEPSPEED")
    assert (args.num_processes, args.num_machines, args.machine_rank) == (processes, machines, machines - 1)
    assert (args.main_process_ip, args.main_process_port, args.mixed_precision) == ("10.0.0.1", 29555, "bf16")
    assert args.module and args.training_script == "stages"
    assert args.training_script_args == ["sft", "--params", "run.yaml", "--set", "sft.max_steps=3"]
    if kind == "NO":
        assert "--tee" not in cmd and "--rdzv_conf" not in cmd
    else:
        assert args.tee == "3" and args.log_dir == "/tmp/logs" and args.rdzv_conf == "timeout=300"
    if kind == "FSDP":
        assert args.fsdp_version == 2 and args.fsdp_state_dict_type == "FULL_STATE_DICT"
    if kind == "DEEPSPEED":
        ds = json.loads(Path(args.deepspeed_config_file).read_text())
        assert Path(args.deepspeed_config_file).is_absolute()
        assert ds["zero_optimization"]["stage"] == int(name[-1])
        assert ds["train_micro_batch_size_per_gpu"] == ds["gradient_accumulation_steps"] == "auto"


def test_mixed_precision_auto_is_left_to_the_stage():
    cmd = launch_command(["x.py"], LaunchConfig(num_processes=2))
    assert "--mixed_precision" not in cmd and "--main_process_ip" not in cmd
    assert parse(cmd).mixed_precision == "no"  # ddp.yaml; the stage's own sft.mixed_precision decides


def test_missing_config_file_is_reported_before_launching(tmp_path):
    with pytest.raises(LaunchError, match=r"run.launch.accelerate_config = 'configs/accelerate/nope.yaml': "
                                          r"file not found.*ddp.yaml"):
        launch_command(["x.py"], LaunchConfig(num_processes=2, accelerate_config="configs/accelerate/nope.yaml"))


def test_launch_params_are_validated_together(tmp_path):
    path = write_params(tmp_path, {"run": {"launch": {"num_processes": 3, "num_machines": 2, "machine_rank": 2}}})
    with pytest.raises(ParamsError) as e:
        load_params(path)
    text = str(e.value)
    assert "run.launch.num_processes = 3: must be a multiple of num_machines (2)" in text
    assert "run.launch.machine_rank = 2: must be < num_machines (2)" in text
    assert "run.launch.main_process_ip is not set" in text


def test_only_training_stages_with_several_processes_are_launched(monkeypatch):
    assert training_stages() == ["sft", "reward", "policy"]  # the stages whose StageSpec counts training rows
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("ALIGN_LAUNCHED", raising=False)
    assert not needs_launch("sft", LaunchConfig())  # the default: in-process, as in the quickstart
    assert needs_launch("sft", LaunchConfig(num_processes=2)) and needs_launch("policy", LaunchConfig(num_processes=2))
    assert not needs_launch("score", LaunchConfig(num_processes=2))
    monkeypatch.setenv("LOCAL_RANK", "0")  # already a launched rank: never launch again
    assert not needs_launch("sft", LaunchConfig(num_processes=2))


def _with_preprocess_rows(tmp_path, rows: dict, extra: dict):
    params = load_params(write_params(tmp_path, extra))
    folder = Path(params.run.output_dir) / "preprocess"
    folder.mkdir(parents=True)
    artifacts.write_manifest(folder, {"stage": "preprocess", "metrics": {"rows": rows}})
    return params


def test_more_processes_than_the_global_batch_allows(tmp_path):
    params = _with_preprocess_rows(tmp_path, {"sft_train": 100, "prompts": 40},
                                   {"run": {"launch": {"num_processes": 8}}, "sft": {"per_device_train_batch_size": 16},
                                    "policy": {"method": "grpo", "num_prompts": -1,
                                               "grpo": {"num_generations": 2, "per_device_train_batch_size": 8}}})
    with pytest.raises(LaunchError, match=r"run.launch.num_processes = 8: sft has 100 SFT rows, fewer than one "
                                          r"global batch of 8 processes x 16 rows per device"):
        check_batch("sft", params)
    check_batch("policy", params)  # GRPO: 8 processes x 4 prompts = 32 <= 40 prompts
    params.run.launch.num_processes = 16
    with pytest.raises(LaunchError, match=r"policy has 40 prompts, fewer than one global batch of 16 processes x 4 "
                                          r"prompts"):
        check_batch("policy", params)


def test_each_training_stage_counts_its_own_rows(tmp_path):
    params = _with_preprocess_rows(tmp_path, {"sft_train": 100, "preference": 50, "unpaired": 30, "prompts": 40},
                                   {"policy": {"method": "kto", "data": "preprocess"}})
    assert training_rows("sft", params)["rows"] == 100
    assert training_rows("reward", params)["rows"] == 50 - round(50 * params.reward.eval_fraction)
    assert (training_rows("policy", params)["rows"], training_rows("policy", params)["what"]) == (30, "rows")
    params.policy.data = "score"  # pairs sampled by stage score: not counted until it has run
    assert training_rows("policy", params) is None and training_rows("score", params) is None


def test_single_process_config_with_several_processes_and_fsdp_on_cpu(tmp_path):
    params = load_params(write_params(tmp_path, {"run": {"device": "cpu", "launch": {
        "num_processes": 2, "accelerate_config": "configs/accelerate/single_process.yaml"}}}))
    with pytest.raises(LaunchError, match="single-process config.*use configs/accelerate/ddp.yaml"):
        preflight("sft", params)
    params.run.launch.accelerate_config = "configs/accelerate/fsdp.yaml"
    with pytest.raises(LaunchError, match="FSDP needs CUDA GPUs"):
        preflight("sft", params)


def test_unreachable_main_process_times_out_with_a_clear_message():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(LaunchError, match=rf"main_process_ip = 127.0.0.1, main_process_port = {port}: no main "
                                          r"process answered within 1 s.*start machine_rank 0 first"):
        wait_for_main("127.0.0.1", port, 1.0, interval_s=0.2)
    assert time.monotonic() - start < 5


@pytest.mark.slow
def test_a_crash_on_one_rank_ends_every_rank_and_names_its_error(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("import time\nfrom accelerate import PartialState\ns = PartialState(cpu=True)\n"
                      "if s.process_index == 1:\n    raise RuntimeError('boom on rank 1')\ntime.sleep(120)\n")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = launch_command([str(script)], LaunchConfig(num_processes=2, main_process_port=port),
                         log_dir=str(tmp_path / "logs"))
    start = time.monotonic()
    with pytest.raises(LaunchFailed) as e:
        run_command(cmd, on_line=lambda line: None, timeout_s=100)
    assert time.monotonic() - start < 60  # rank 0 was ended, not waited for
    assert "(local rank 1, the first to fail)" in str(e.value) and "RuntimeError: boom on rank 1" in str(e.value)
    assert all(line.startswith("[default1]:") for line in e.value.tail[1:])


@pytest.mark.slow
def test_sft_on_two_processes_writes_one_output_from_rank_0(tmp_path):
    """`python -m stages sft` with run.launch.num_processes = 2: launched, sealed once, then current."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = write_params(tmp_path, {"run": {"device": "cpu", "launch": {"num_processes": 2,
                                                                      "main_process_port": port}}})
    run = [sys.executable, "-m", "stages"]
    assert subprocess.run([*run, "preprocess", "--params", str(path)], capture_output=True).returncode == 0
    res = subprocess.run([*run, "sft", "--params", str(path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[default0]:" in res.stdout and "[default1]:" in res.stdout
    out = tmp_path / "artifacts" / "sft"
    ok, why = artifacts.verify(out)
    assert ok, why
    assert (out / "model" / "model.safetensors").is_file()
    assert not list(out.parent.glob(".tmp-sft-*")) and not list((out.parent / ".work").glob("sft-*"))
    assert json.loads(res.stdout[res.stdout.rindex('{\n  "stage"'):])["executed"] is True
    assert yaml.safe_load((out / "manifest.json").read_text())["metrics"]["steps"] == 4
    again = subprocess.run([*run, "sft", "--params", str(path)], capture_output=True, text=True)
    assert again.returncode == 0 and '"executed": false' in again.stdout and "[default" not in again.stdout
