"""Run one pipeline stage: `python -m stages <stage> [--params params.yaml] [--set key=value ...]`.

The same command `dvc.yaml` runs and `align stage <stage>` calls. It validates all params first (exit code 2
and every problem listed, nothing written), skips the stage if its output folder is current, otherwise builds
it atomically with a manifest. A failure ends with `error: <stage>: <cause>` as the last line; its traceback is
in the log file named just above (`<run.output_dir>/logs/`). Training stages with `run.launch.num_processes`
> 1 go through `accelerate launch` (`stages.harness.launch`); everything else runs in this process.

    python -m stages sft --set sft.learning_rate=1e-3
    python -m stages status          # which stages are current, and why not
    python -m stages dvc-yaml        # print the dvc.yaml derived from the stage table and params.yaml
    python -m stages params --write  # params.yaml rendered from the schema (defaults and help)
    python -m stages score --shard 0 --num-shards 4   # one share of score's prompts, on any machine
                                                      # sharing run.output_dir; then `python -m stages score`
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from stages.harness.params_loader import ParamsError, load_params
from stages.harness.registry import ALL_STAGES, STAGES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stages", description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=[*ALL_STAGES, "status", "dvc-yaml", "params"],
                   help="stage to run, or a helper command (params: print params.yaml rendered from the schema)")
    p.add_argument("--write", action="store_true", help="params: write the rendering to --params")
    p.add_argument("--from", dest="source", metavar="FILE", help="params: render the values of this params file "
                   "(a partial one, such as configs/smollm2.yaml, with the defaults for every key it leaves out) "
                   "instead of the defaults, so that `dvc repro` and `align run` run it from params.yaml")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a param by its dotted key, e.g. sft.learning_rate=1e-4 (repeatable)")
    p.add_argument("--force", action="store_true", help="rebuild even if the output is current")
    p.add_argument("--shard", type=int, metavar="K", help="score/evaluate: compute only share K (0-based) of "
                   "--num-shards into the stage's work folder and publish nothing; the plain stage run assembles")
    p.add_argument("--num-shards", type=int, metavar="N", help="how many shares --shard counts (with --shard)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; a failure ends with `error: <cause>` as the last line and its traceback in the log file."""
    args = build_parser().parse_args(argv)
    from stages.harness import logs, processes

    logs.setup(logging.INFO if processes.process_rank() == 0 else logging.WARNING)  # ranks > 0 repeat rank 0's lines
    if args.stage == "params":
        from stages.harness.params_yaml import render

        try:
            text = render(load_params(args.source, args.overrides, preflight=False) if args.source else None)
        except ParamsError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        Path(args.params).write_text(text) if args.write else sys.stdout.write(text)
        return 0
    try:  # status opens no data file or model folder (preflight): it reads the manifests only
        params = load_params(args.params, args.overrides, preflight=args.stage != "status",
                             rows=args.stage == "preprocess" and args.shard is None)
        if args.stage in STAGES and STAGES[args.stage].trains:  # what transformers refuses, before the model
            from stages.harness.preflight import trainer_config_problems

            if problems := trainer_config_problems(params):
                raise ParamsError(args.params, problems)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.stage == "dvc-yaml":  # the input files params.yaml names become deps too
        from stages.harness.dvcgen import render_dvc_yaml

        sys.stdout.write(render_dvc_yaml(params=params))
        return 0
    if (args.shard is None) != (args.num_shards is None) or (args.shard is not None and
                                                              (args.force or args.stage not in STAGES)):
        print("error: --shard K needs --num-shards N, a stage and no --force", file=sys.stderr)
        return 2
    if args.stage != "status":
        rank = processes.process_rank()
        name = f"stage-{args.stage}" + (f"-rank{rank}" if rank else "")
        logs.attach_log_file(Path(params.run.output_dir) / "logs", name)
    ok = False
    try:
        code = run(args, params)
        ok = True
        return code
    except Exception as e:  # noqa: BLE001 -- every failure ends the same way: the cause last, the traceback logged
        logs.report_failure(failure_line(args.stage, e), e)
        return exit_code(e)
    finally:
        logs.detach_log_file()
        if processes.inside_launch():  # a launched rank: leave the process group before the interpreter exits
            processes.shutdown_distributed(barrier=ok)


def run(args, params) -> int:
    from stages.harness import launch, processes, runner

    if args.shard is not None:
        print(json.dumps(runner.run_shard(args.stage, params, args.shard, args.num_shards), indent=2))
        return 0
    if args.stage == "status":
        for row in runner.status(params):
            mark = "current" if row["current"] else f"stale: {row['reason']}"
            print(f"{row['stage']:<12} {mark}")
        return 0
    if launch.needs_launch(args.stage, params.run.launch):
        manifest = launch.launch_stage(args.stage, params, on_line=lambda line: print(line, flush=True),
                                       force=args.force)
    else:
        manifest = runner.run_stage(args.stage, params, force=args.force)
    if processes.process_rank() > 0:  # rank 0 reports for the launched run
        return 0
    print(json.dumps({"stage": args.stage, "executed": manifest["executed"],
                      "metrics": runner.flat_metrics(manifest.get("metrics", {}))}, indent=2))
    return 0


def exit_code(error: BaseException) -> int:
    """3: an upstream output is missing; 4: a quality gate failed; 5: the stage stopped (disk full, a NaN
    loss; nothing published, the previous output intact); 6: a launched rank crashed or ran out of time
    (every rank has ended); 1: anything else (bad data, a bad model path: the message says what to fix)."""
    from stages.harness import launch, runner

    codes = {runner.UpstreamMissing: 3, runner.QualityGateFailed: 4, runner.StageFailed: 5, launch.LaunchFailed: 6}
    return next((code for kind, code in codes.items() if isinstance(error, kind)), 1)


def failure_line(stage: str | None, error: BaseException) -> str:
    """`<stage>: <the error's message on one line>`; the type's name too for errors that are not ours to raise."""
    from stages.harness import logs

    message = logs.one_line(error)
    if not isinstance(error, (ValueError, OSError, RuntimeError, FloatingPointError)):
        message = f"{type(error).__name__}: {message}"
    if stage and not message.startswith((f"{stage}:", "stage ")):
        message = f"{stage}: {message}"
    return message


if __name__ == "__main__":
    sys.exit(main())
