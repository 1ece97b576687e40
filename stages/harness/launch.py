"""Run a training stage on many processes and machines through `accelerate launch`.

A training stage (sft, reward, policy) runs in-process when `run.launch.num_processes` and
`run.launch.num_machines` are 1 (the default). Otherwise it is started as `python -m
accelerate.commands.launch --config_file <run.launch.accelerate_config> --num_processes N ... -m stages <stage>
--params <the run's resolved params>`, each rank running the unchanged stage: the Trainer shards the data and
reduces gradients (DDP, FSDP or DeepSpeed, as the config says); only global rank 0 writes the output folder and
its manifest. The launcher runs in its own process group; its output is streamed line by line (`[defaultN]:`
prefixes local rank N's lines), a deadline kills every process it started, and a non-zero exit raises
`LaunchFailed` with the failing rank's last lines.

    python -m stages sft --set run.launch.num_processes=8            # 1 machine, 8 GPUs
    python -m stages.harness.launch sft --print --set run.launch.num_processes=8   # show the command only

On CPU the DDP config gives gloo processes: `accelerate launch --cpu` would start a single process, so `--cpu`
is never passed; Trainer's `use_cpu` picks gloo itself.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from stages.harness import artifacts, runner
from stages.harness.artifacts import CODE_ROOT
from stages.harness.config import LaunchConfig, Params
from stages.harness.params_loader import load_params
from stages.harness.processes import LAUNCHED_ENV, LaunchFailed, inside_launch, run_command, stage_target
from stages.harness.registry import STAGES, get_stage, resolve

CONFIG_DIR = CODE_ROOT / "configs" / "accelerate"
GPU_ONLY = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed"}


class LaunchError(ValueError):
    """A problem found before launching (config file, batch size, main process): nothing was started."""


def training_stages() -> list[str]:
    """The stages that train (`StageSpec.training_rows` set): the ones `accelerate launch` can run."""
    return [name for name, spec in STAGES.items() if spec.trains]


def needs_launch(stage: str, launch: LaunchConfig) -> bool:
    """Whether `stage` goes through `accelerate launch`: a training stage on more than one process."""
    return (get_stage(stage).trains and (launch.num_processes > 1 or launch.num_machines > 1)
            and not inside_launch())


# --------------------------------------------------------------------------- the command


def resolve_config(path: str) -> Path:
    """`run.launch.accelerate_config` as an existing file: as given, else relative to the repository."""
    given = Path(path)
    candidates = [given] if given.is_absolute() else [Path.cwd() / given, CODE_ROOT / given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    shipped = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
    raise LaunchError(f"run.launch.accelerate_config = {path!r}: file not found (looked in "
                      f"{', '.join(str(c.parent) for c in candidates)}); use one of configs/accelerate/ "
                      f"({shipped}) or write one with `accelerate config`")


def distributed_type(config: Path) -> str:
    return str((yaml.safe_load(config.read_text()) or {}).get("distributed_type", "NO")).upper()


def launch_command(target: list[str], launch: LaunchConfig, *, log_dir: str | None = None,
                   python: str = sys.executable) -> list[str]:
    """The `accelerate launch` command line running `target` (["-m", "stages", "sft", ...] or a script).

    Flags given here override the config file's values, so one config serves any number of
    processes and machines. `--tee 3 --log_dir` makes torchrun prefix each line with its rank.
    """
    config = resolve_config(launch.accelerate_config)
    cmd = [python, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", str(launch.num_processes), "--num_machines", str(launch.num_machines),
           "--machine_rank", str(launch.machine_rank), "--main_process_port", str(launch.main_process_port)]
    if launch.main_process_ip:
        cmd += ["--main_process_ip", launch.main_process_ip]
    if launch.mixed_precision != "auto":
        cmd += ["--mixed_precision", launch.mixed_precision]
    ds_file = ((yaml.safe_load(config.read_text()) or {}).get("deepspeed_config") or {}).get("deepspeed_config_file")
    if ds_file:  # accelerate reads it relative to the working directory; pin it to the file that exists
        cmd += ["--deepspeed_config_file", str(resolve_config(ds_file))]
    if distributed_type(config) != "NO":  # the rendezvous: fail after connect_timeout_s, not torchrun's 600 s
        cmd += ["--rdzv_conf", f"timeout={launch.connect_timeout_s}"]
        if log_dir:
            cmd += ["--tee", "3", "--log_dir", log_dir]
    return [*cmd, *target]


# --------------------------------------------------------------------------- checks before launching


def preflight(stage: str, params: Params) -> Path:
    """Every problem that would only show after the processes start, raised as LaunchError now.

    Returns the resolved accelerate config file.
    """
    config = check_config(params)
    check_batch(stage, params)
    launch = params.run.launch
    if launch.num_machines > 1 and launch.machine_rank > 0:
        wait_for_main(launch.main_process_ip, launch.main_process_port, launch.connect_timeout_s)
    return config


def check_config(params: Params) -> Path:
    """The accelerate config against the processes and the hardware (FSDP / DeepSpeed need CUDA), before
    anything else is looked at (even before the upstream stages): LaunchError naming the key."""
    launch = params.run.launch
    config = resolve_config(launch.accelerate_config)
    kind = distributed_type(config)
    if kind == "NO" and launch.num_processes > 1:
        raise LaunchError(f"run.launch.accelerate_config = {launch.accelerate_config} is a single-process config "
                          f"(distributed_type: NO) but run.launch.num_processes = {launch.num_processes}; use "
                          "configs/accelerate/ddp.yaml (or fsdp / deepspeed_zero*) for more than one process")
    if kind in GPU_ONLY:
        import importlib.util

        import torch

        if params.run.device == "cpu" or not torch.cuda.is_available():
            why = "run.device = cpu" if params.run.device == "cpu" else "none is visible"
            raise LaunchError(f"run.launch.accelerate_config = {launch.accelerate_config}: {GPU_ONLY[kind]} needs "
                              f"CUDA GPUs and {why}; use configs/accelerate/ddp.yaml on CPU (nothing was launched)")
        if kind == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
            raise LaunchError(f"run.launch.accelerate_config = {launch.accelerate_config} needs the deepspeed "
                              "package: pip install deepspeed")
    if params.run.device != "cpu":
        import torch

        local = launch.num_processes // launch.num_machines
        if torch.cuda.is_available() and local > torch.cuda.device_count():
            raise LaunchError(f"run.launch.num_processes = {launch.num_processes} over {launch.num_machines} "
                              f"machine(s) is {local} per machine, but this machine has "
                              f"{torch.cuda.device_count()} GPU(s): one process per GPU")
    return config


def training_rows(stage: str, params: Params) -> dict[str, Any] | None:
    """What `stage` trains on, counted by its `StageSpec.training_rows` from its upstream manifests:
    {"rows", "what", "per_device", "unit", "batch_key"}; None when not counted yet or the stage does not train."""
    spec = get_stage(stage)
    if not spec.trains:
        return None
    manifests = {up: artifacts.read_manifest(runner.output_dir(params, up)) or {} for up in spec.upstream}
    return resolve(spec.training_rows)(params, manifests)


def check_batch(stage: str, params: Params) -> None:
    """Every process must get its own rows in a step: rows >= processes x rows per device.

    Below that, accelerate pads the short ranks with repeated rows and the update silently
    differs from the single-process one.
    """
    n, found = params.run.launch.num_processes, training_rows(stage, params)
    if found is not None and found["rows"] < n * found["per_device"]:
        key = found["batch_key"]
        raise LaunchError(
            f"run.launch.num_processes = {n}: {stage} has {found['rows']} {found['what']}, fewer than one global "
            f"batch of {n} processes x {found['per_device']} {found['unit']} per device ({key} = "
            f"{params.select((key,))[key]}); lower run.launch.num_processes or {key}, or give the stage more data")


def wait_for_main(ip: str, port: int, timeout_s: float, *, interval_s: float = 2.0) -> None:
    """Wait until machine_rank 0's rendezvous port answers; LaunchError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((ip, port), timeout=min(5.0, max(timeout_s, 0.1))):
                return
        except OSError as e:
            last = e
        if time.monotonic() + interval_s > deadline:
            break
        time.sleep(interval_s)
    raise LaunchError(f"run.launch.main_process_ip = {ip}, main_process_port = {port}: no main process answered "
                      f"within {timeout_s:g} s ({last}); start machine_rank 0 first, check the address, and that "
                      "the port is open between the machines (run.launch.connect_timeout_s sets the wait)")


# --------------------------------------------------------------------------- running


def launch_stage(stage: str, params: Params, *, on_line: Callable[[str], Any] = print,
                 force: bool = False) -> dict[str, Any]:
    """Run `stage` through `accelerate launch` (all checks first); return its manifest, as `run_stage` does.

    The run's params are written out resolved (overrides included) and every rank reads that file.
    """
    check_config(params)
    state = runner.inspect(stage, params)
    if state.current and not force:
        return {**artifacts.read_manifest(state.folder), "executed": False}
    preflight(stage, params)
    work = Path(params.run.output_dir) / ".work"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"launch-{stage}-", dir=work) as tmp:
        params_file = Path(tmp) / "params.yaml"
        params_file.write_text(yaml.safe_dump(params.to_dict(), sort_keys=False))
        target = stage_target(stage, params_file) + (["--force"] if force else [])
        cmd = launch_command(target, params.run.launch, log_dir=str(Path(tmp) / "logs"))
        env = {**os.environ, LAUNCHED_ENV: "1", "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CODE_ROOT), env.get("PYTHONPATH")]))
        run_command(cmd, on_line=on_line, timeout_s=params.run.launch.timeout_s, env=env)
    manifest = artifacts.read_manifest(state.folder)
    if manifest is None or manifest.get("fingerprint") != state.fingerprint:
        raise LaunchFailed(f"{stage}: the launched run exited 0 but left no output with fingerprint "
                           f"{state.fingerprint} at {state.folder}", 0, [])
    return {**manifest, "executed": True}


def main(argv: list[str] | None = None) -> int:
    """`python -m stages.harness.launch <stage> [--params] [--set]`: run a training stage through accelerate launch,
    even on one process (e.g. to pick mixed precision through the launcher)."""
    import argparse
    import logging

    p = argparse.ArgumentParser(prog="python -m stages.harness.launch", description=main.__doc__)
    p.add_argument("stage", choices=training_stages())
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--force", action="store_true")
    p.add_argument("--print", action="store_true", help="print the command line and exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        params = load_params(args.params, args.overrides)
        if args.print:
            print(" ".join(launch_command(stage_target(args.stage, args.params, args.overrides),
                                          params.run.launch)))
            return 0
        manifest = launch_stage(args.stage, params, force=args.force)
    except (LaunchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LaunchFailed as e:  # a rank crashed or the deadline passed: every rank has ended
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # stages.harness.runner.UpstreamMissing: the message says which stage to run first
        print(f"error: {e}", file=sys.stderr)
        return 3
    print(f"{args.stage}: {'executed' if manifest['executed'] else 'current'} ({manifest['fingerprint']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
