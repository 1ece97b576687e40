"""Run one pipeline stage: `python -m stages <stage> [--params params.yaml] [--set key=value ...]`.

The same command `dvc.yaml` runs and `align stage <stage>` calls. It validates all params
first (exit code 2 and every problem listed, nothing written), skips the stage if its
output folder is current, otherwise builds it atomically with a manifest.

    python -m stages preprocess
    python -m stages sft --set sft.learning_rate=1e-3
    python -m stages status          # which stages are current, and why not
    python -m stages dvc-yaml        # print the dvc.yaml derived from the stage table

Stages run as one process on one device (CPU or one GPU); multi-GPU launching is not wired yet.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from stages.config import ParamsError, load_params
from stages.registry import STAGES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stages", description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=[*STAGES, "status", "dvc-yaml"], help="stage to run, or a helper command")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a param by its dotted key, e.g. sft.learning_rate=1e-4 (repeatable)")
    p.add_argument("--force", action="store_true", help="rebuild even if the output is current")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.stage == "dvc-yaml":
        from stages.dvcgen import render_dvc_yaml

        sys.stdout.write(render_dvc_yaml())
        return 0
    try:
        params = load_params(args.params, args.overrides)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from stages import runner

    if args.stage == "status":
        for row in runner.status(params):
            mark = "current" if row["current"] else f"stale: {row['reason']}"
            print(f"{row['stage']:<12} {mark}")
        return 0
    try:
        manifest = runner.run_stage(args.stage, params, force=args.force)
    except runner.UpstreamMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except runner.QualityGateFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    except (ValueError, FileNotFoundError) as e:  # bad data, bad model path: the message says what to fix
        print(f"error: {args.stage}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"stage": args.stage, "executed": manifest["executed"],
                      "metrics": runner.flat_metrics(manifest.get("metrics", {}))}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
