"""`align`: the command-line entry point.

    align run [--params params.yaml] [--set sft.learning_rate=1e-3 ...] [--promote]   run the flow now
    align serve [--params params.yaml]          serve the align/full and align/nightly deployments
    align server start|stop                     a background Prefect server on 127.0.0.1 for fast reruns + UI
    align stage <stage> [--set ...]             one stage, without Prefect (= python -m stages <stage>)
    align status                                which stages are current, and why not
    align dvc-yaml                              print the dvc.yaml derived from the stage table
    align params [--write]                      params.yaml rendered from the schema (defaults and help)

A failed command ends with `error: <cause>` as its last line (the failed stage, file:line, key or
fix); the full log with tracebacks is in `<run.output_dir>/logs/`, its path printed just above.
One SIGTERM stops `align run` (exit 143) and `align serve` within seconds, with every process
they started (flows/shutdown.py).

Which Prefect server a run talks to: PREFECT_API_URL if set; else the background server of
`align server start` if it is running; else Prefect's ephemeral mode (a temporary server
started and stopped around the run, several seconds each time).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

SERVE_STOPPED = ("align serve: stopped; the deployments' schedules stay active (pause_on_shutdown=False); "
                 "`align serve` serves them again")
RUN_STOPPED = ("error: align run: stopped by SIGTERM; every process it started has ended; rerun `align run` to "
               "continue after the last finished stage")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="align", description="End-to-end alignment pipeline.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("run", "run the align flow"), ("serve", "serve the deployments")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--params", default="params.yaml")
        if name == "run":
            p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
            p.add_argument("--promote", action="store_true",
                           help="then stage promote: the merged model replaces models/production if it is better")
    srv = sub.add_parser("server", help="start or stop a background Prefect server on 127.0.0.1")
    srv.add_argument("action", choices=["start", "stop"])
    srv.add_argument("--port", type=int, default=4200)
    for name in ("stage", "status", "dvc-yaml", "params"):
        sub.add_parser(name, add_help=False, help="see python -m stages --help")
    args, rest = parser.parse_known_args(argv)

    from stages.harness import logs

    logs.setup()  # before Prefect is imported: its records then go through our console and log-file handlers
    from stages.__main__ import main as stages_main
    from stages.harness.params_loader import ParamsError, load_params

    if args.command == "server":
        return server_command(args.action, args.port)
    if args.command == "stage":
        return stages_main(rest)
    if args.command in ("status", "dvc-yaml", "params"):
        dvc_line = None
        if args.command == "status":  # and whether DVC agrees: `dvc status` runs beside our own table
            from flows.dvc_sync import lock_status_started

            dvc_line = lock_status_started(os.getcwd())
        rc = stages_main([args.command, *rest])
        if dvc_line is not None and (line := dvc_line()) and rc == 0:
            print(line)
        return rc
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    temporary = None
    try:  # validate before starting Prefect: bad params cost nothing and write nothing
        params = load_params(args.params, getattr(args, "overrides", []), rows=args.command == "run")
        if args.command == "run":  # and what transformers refuses in the sections of the stages it will train
            from stages.harness.preflight import stale_training_stages, trainer_config_problems

            temporary = temporary_server()  # boots while the stages' state is read and Prefect is imported

            if problems := trainer_config_problems(params, stale_training_stages(params)):
                raise ParamsError(args.params, problems)
    except ParamsError as e:
        if temporary is not None:
            temporary.stop()
        print(f"error: {e}", file=sys.stderr)
        return 2
    logs.attach_log_file(Path(params.run.output_dir) / "logs", f"align-{args.command}")
    use_background_server()
    try:
        return serve(args.params) if args.command == "serve" else run(args.params, args.overrides, args.promote,
                                                                        ready=temporary.wait if temporary else None)
    finally:
        logs.detach_log_file()


def run(params_file: str, overrides: list[str], promote: bool = False, ready=None) -> int:
    """The flow, now; a failure ends with the failed stage's one-line cause, its traceback in the log file.
    `ready()`: waits for the temporary server, after Prefect is imported (which takes as long as it boots)."""
    from flows import shutdown
    from stages.__main__ import exit_code, failure_line
    from stages.harness import logs

    shutdown.stop_on_sigterm("align run", RUN_STOPPED)  # no temporary Prefect server or training process left
    try:
        from flows.align import align

        if ready is not None:
            ready()
        state = align(params_file=params_file, overrides=overrides, promote=promote, return_state=True)
        error = None if state.is_completed() else state.result(raise_on_failure=False)
    except Exception as e:  # noqa: BLE001 -- Prefect could not start, or the flow raised outside a task
        state, error = None, e
    logs.console_level(logging.WARNING)  # Prefect's teardown lines would come after the result's last line
    if isinstance(error, BaseException):
        lost = server_lost(error)
        logs.report_failure(lost or failure_line(failed_stage(error), error), error)
        if lost:  # Prefect's log and event workers would retry the dead server for minutes before exiting
            shutdown.end_process_tree()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code(error))
        return exit_code(error)
    if state is None or not state.is_completed():
        logs.report_failure(f"flow run {state.name}: {state.message}" if state else "the flow did not run")
        return 1
    print_summary(state.result())
    return 0


def server_lost(error: BaseException | None) -> str | None:
    """The cause line when `error` is the Prefect API going away mid-run (the server stopped or restarted): the
    stages keep running in this process and publish their outputs, but the flow cannot record them."""
    import httpx

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, httpx.TransportError):
            url = os.environ.get("PREFECT_API_URL") or "its temporary address"
            return (f"the Prefect server at {url} stopped answering during the run ({type(error).__name__}: "
                    f"{error}); the stages that finished are kept in run.output_dir: start the server again "
                    "(`align server start`) and rerun `align run`, which reuses them")
        error = error.__cause__ or error.__context__
    return None


def failed_stage(error: BaseException) -> str | None:
    """The stage whose task raised `error`: the `name` of the `run_stage_task(name, params)` frame it passed."""
    import traceback

    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_name == "run_stage_task":
            return frame.f_locals.get("name")
    return None


def serve(params_file: str) -> int:
    from flows import shutdown
    from flows.deploy import serve_deployments

    serve_deployments(params_file, last_line=SERVE_STOPPED)  # returns once stopped (SIGTERM, Ctrl-C)
    shutdown.exit_now("align serve", SERVE_STOPPED, code=0)  # and Prefect's temporary server, if it started one
    return 0


def server_command(action: str, port: int) -> int:
    from flows import server

    if action == "start":
        url = server.start_server(port)
        print(f"Prefect server: {url.removesuffix('/api')} (align run uses it; `align server stop` stops it)")
    else:
        print("stopped" if server.stop_server() else "no align server recorded")
    return 0


def temporary_server():
    """Without PREFECT_API_URL or a background server (`align server start`): Prefect's temporary server, started
    now (flows.server.TemporaryServer), else None."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    from flows.server import TemporaryServer, find_server

    if find_server():
        return None
    server = TemporaryServer()
    os.environ["PREFECT_API_URL"] = server.start()  # before Prefect is imported; `wait()` before it is called
    return server


def use_background_server() -> None:
    """Point Prefect at `align server start`'s server when no API URL is configured (before prefect loads)."""
    # ephemeral mode: Prefect's 20 s default for its temporary server to start was exceeded on a busy 2-core machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if os.environ.get("PREFECT_API_URL"):
        return
    from flows.server import find_server

    if url := find_server():
        os.environ["PREFECT_API_URL"] = url


def print_summary(summary: dict) -> None:
    print("\nstage        status     wall_s  fingerprint")
    for s in summary["stages"]:
        print(f"{s['stage']:<12} {s['status']:<10} {s['wall_time_s']:>6}  {s['fingerprint']}")
    if summary["evaluation"]:
        # every row's columns, in order of appearance: the judge's baseline row (sft) has no judge.* columns
        cols = list(dict.fromkeys(c for row in summary["evaluation"] for c in row))
        cols = ["model", *(c for c in cols if c != "model")] if "model" in cols else cols
        print("\n" + "  ".join(f"{c:>22}" if i else f"{c:<8}" for i, c in enumerate(cols)))
        for row in summary["evaluation"]:
            print("  ".join(f"{row.get(c, '-')!s:>22}" if i else f"{row.get(c, '-')!s:<8}"
                            for i, c in enumerate(cols)))
    if promotion := summary.get("promotion"):
        earlier = " (current: decided by an earlier run on these outputs)" if promotion.get("cached") else ""
        print(f"\npromotion{earlier}: {promotion['event']}: {promotion['reason']}")


if __name__ == "__main__":
    sys.exit(main())
