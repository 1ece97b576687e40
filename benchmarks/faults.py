"""Fault-injection campaign: inject the faults production throws at a pipeline into real `align run`s and
check that each run recovers to the bytes of an uninterrupted run, leaving nothing behind.

    python -m benchmarks faults                 # the whole campaign (10-25 minutes on 2 cores)
    python -m benchmarks faults --tiny          # one run of a few faults (the CI subset, about 2 minutes)
    python -m benchmarks faults --seed 3 --only sigkill --only flipped-byte

Everything happens in temporary copies of this repository (git + DVC initialised, small params, a
Prefect server of their own on 127.0.0.1), never in your checkout. One uninterrupted `align run`
is the reference. The faults (docs/faults.md says how each is injected):

- sigkill: `align run` SIGKILLed at seeded time offsets into every stage, inside a checkpoint save,
  inside the manifest write, between the two renames that publish an output, and inside `dvc commit`;
- disk-full: run.output_dir on a small tmpfs that fills during a stage's save;
- server-death: the Prefect server SIGKILLed while a stage runs, then started again;
- concurrent: manual `align run`s and a run of the nightly deployment at once (2 to 4), with the same params
  and with other params;
- flipped-byte: one bit flipped in cached weights, a jsonl file, a manifest;
- worker-kill: one rank of a 2-process training stage SIGKILLed after a checkpoint.

After each fault, the next run (`align run`, or the stage's own command for worker-kill) must
finish; every stage's output files must hash to the reference's; no temporary folder, held lock
or live process may be left; `align status` and `dvc status` must both say current. It prints
one row per fault: runs, recovered, byte-identical, leftovers, median time to recover.
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks import faults_lib as lib

# The quick faults first: the 34 SIGKILL points take the longest.
FAULTS = ("flipped-byte", "disk-full", "concurrent", "server-death", "worker-kill", "sigkill")


class Campaign:
    """The shared state of one campaign: its folder, Prefect server, reference project and outputs."""

    def __init__(self, work: Path, seed: int, log=print, on_outcome=lambda outcome: None):
        self.work, self.rng, self.log, self.on_outcome = work, random.Random(seed), log, on_outcome
        self.env = lib.base_env(work)
        self.count = 0
        self.points: str | None = None  # --points A:B
        template = lib.make_template(work / "template", self.env)
        self.server_pids: set[int] = set()
        self.api_url = self.start_server(template, self.env)
        self.reference = lib.Project(template, self.env, self.api_url)
        run = self.reference.align("run")
        if run.rc != 0:
            raise RuntimeError(f"the reference `align run` failed:\n{run.out[-4000:]}")
        self.reference_s = run.seconds
        self.outputs = lib.outputs(self.reference)
        self.wall = {s: self.reference.manifest(s)["wall_time_s"] for s in lib.STAGE_ORDER}
        problems = lib.leftovers(self.reference, self.server_pids) + [lib.status_agrees(self.reference)[1]]
        if any(problems):
            raise RuntimeError(f"the reference run is not clean: {problems}")

    def start_server(self, repo: Path, env: dict, port: int = 0) -> str:
        """`align server start` (PREFECT_HOME from `env`); its API URL."""
        import json

        res = lib.sh([str(lib.BIN / "align"), "server", "start", "--port", str(port or free_port())], repo, env)
        if res.returncode:
            raise RuntimeError(f"align server start failed: {res.stdout}{res.stderr}")
        state = json.loads((Path(env["PREFECT_HOME"]) / "align-server.json").read_text())
        self.server_pids |= server_tree(state["pid"])
        return state["api_url"]

    def slice(self, points: list) -> list:
        """The points --points A:B selects of a fault's list."""
        if not self.points:
            return points
        first, _, last = self.points.partition(":")
        return points[int(first or 0):int(last) if last else None]

    def project(self, name: str, source: lib.Project | None = None) -> lib.Project:
        self.count += 1
        return lib.Project.copy_of(source or self.reference, self.work / f"{self.count:02d}-{name}", self.api_url)

    def recover(self, project: lib.Project, outcome: lib.Outcome, *args: str) -> lib.Run:
        """The next `align run`, then every check; fills `outcome`."""
        run = project.align("run", *args)
        outcome.recovery_s = run.seconds
        if run.rc != 0:
            outcome.notes.append(f"the rerun failed ({run.rc}): {run.last_line()}")
            return run
        self.check(project, outcome)
        return run

    def check(self, project: lib.Project, outcome: lib.Outcome) -> None:
        agree, detail = lib.status_agrees(project)
        outcome.recovered = agree
        if not agree:
            outcome.notes.append(detail)
        diff = lib.differences(project, self.outputs)
        outcome.identical = not diff
        outcome.notes += diff[:5]
        outcome.leftovers = lib.leftovers(project, self.server_pids)

    def close(self) -> None:
        for pid in self.server_pids:
            lib.kill(pid)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def server_tree(pid: int) -> set[int]:
    import psutil

    try:
        return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return {pid}


# --------------------------------------------------------------------------- sigkill


def kill_points(camp: Campaign, tiny: bool) -> list[tuple[str, str, float]]:
    """(kind, stage, argument) of each SIGKILL, spread over every stage; seeded by --seed."""
    rng = camp.rng
    if tiny:
        return [("checkpoint", "sft", 0)]
    points = []
    for stage in lib.STAGE_ORDER:
        points += [("time", stage, round(rng.uniform(0.05, 0.95) * camp.wall[stage], 3)) for _ in range(2)]
        points.append((rng.choice(["manifest-half", "manifest-unrenamed"]), stage, 0))
    points += [("checkpoint", stage, after) for stage in lib.TRAINING for after in (0, lib.SAVE_STEPS[stage])]
    points.append(("between-renames", rng.choice(lib.STAGE_ORDER), 0))
    points += [("dvc-commit", "evaluate", round(rng.uniform(0.2, 1.2), 2)) for _ in range(3)]
    return points


def sigkill(camp: Campaign, tiny: bool) -> list[lib.Outcome]:
    hook = camp.work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(lib.HOOK)
    variant = None
    outcomes = []
    for kind, stage, arg in camp.slice(kill_points(camp, tiny)):
        point = f"{kind} {stage}" + (f" +{arg}s" if kind in ("time", "dvc-commit") else "") + \
            (f" after step {arg}" if kind == "checkpoint" and arg else "")
        outcome = lib.Outcome("sigkill", point)
        try:
            variant = kill_once(camp, outcome, kind, stage, arg, hook, variant)
        except Exception as e:  # noqa: BLE001 -- recorded as a run that did not recover
            outcome.notes.append(f"{type(e).__name__}: {e}"[:1000])
        camp.log(f"  {outcome.point}: {report(outcome)}")
        outcomes.append(outcome)
    return outcomes


def kill_once(camp: Campaign, outcome: lib.Outcome, kind: str, stage: str, arg: float, hook: Path,
              variant: lib.Project | None) -> lib.Project | None:
    """One SIGKILL at point (kind, stage, arg) of a fresh project, then the recovery; -> the dvc variant."""
    if kind == "dvc-commit":  # the last evaluate was built with other params: dvc.lock must change
        variant = variant or dvc_variant(camp)
        project = camp.project("dvc-commit", variant)
        project.set_params({"evaluate": {"max_new_tokens": lib.SMALL["evaluate"]["max_new_tokens"]}})
    else:
        project = camp.project(f"kill-{kind}-{stage}")
        if kind == "between-renames":
            flip_bit(first_output(project, stage), camp.rng)
        else:
            project.remove(*lib.downstream(stage))
    env = dict(project.env)
    mark = project.repo.parent / f"{project.repo.name}.mark"
    if kind.startswith(("manifest", "between")):
        env.update(PYTHONPATH=f"{hook}:{project.repo}", ALIGN_FAULT_AT=f"{kind}:{stage}", ALIGN_FAULT_MARK=str(mark))
    proc = project.start("run", env=env)
    landed = inject(project, proc, kind, stage, arg, mark)
    outcome.point += "" if landed else " (the run ended before the point)"
    lib.kill(proc.pid)
    proc.wait()
    camp.recover(project, outcome)
    return variant


def inject(project: lib.Project, proc: subprocess.Popen, kind: str, stage: str, arg: float, mark: Path) -> bool:
    """Wait for the kill point of `kind` in `stage`; True when it was reached (the caller SIGKILLs)."""
    timeout = 300
    if kind == "time":
        if not lib.wait_for(lambda: lib.building(project, stage), proc, timeout):
            return False
        time.sleep(arg)
        return proc.poll() is None
    if kind == "checkpoint":
        return bool(lib.wait_for(lambda: lib.partial_checkpoint(project, stage, int(arg)), proc, timeout, 0.001))
    if kind == "dvc-commit":
        child = lib.wait_for(lambda: lib.dvc_commit_process(proc), proc, timeout, 0.01)
        if not child:
            return False
        time.sleep(arg)
        try:
            landed = child.status() != psutil.STATUS_ZOMBIE  # still committing: the kill lands inside it
        except psutil.Error:
            landed = False
        lib.kill(child.pid)
        proc.wait(timeout)  # the flow itself carries on and ends (it logs that dvc.lock was not updated)
        return landed
    return bool(lib.wait_for(mark.exists, proc, timeout, 0.01))


def dvc_variant(camp: Campaign) -> lib.Project:
    """A project whose evaluate, dvc.lock included, was built with evaluate.max_new_tokens one higher."""
    project = camp.project("dvc-variant")
    project.set_params({"evaluate": {"max_new_tokens": lib.SMALL["evaluate"]["max_new_tokens"] + 1}})
    run = project.align("run")
    if run.rc != 0 or "in step" not in project.status()[1]:
        raise RuntimeError(f"building the dvc-commit variant failed:\n{run.out[-3000:]}")
    return project


def first_output(project: lib.Project, stage: str) -> Path:
    return project.artifacts / stage / sorted(project.manifest(stage)["outputs"]["files"])[0]


def flip_bit(path: Path, rng: random.Random) -> int:
    """Flip one bit of `path` at a seeded position; -> the position."""
    data = bytearray(path.read_bytes())
    pos = rng.randrange(len(data))
    data[pos] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return pos


# --------------------------------------------------------------------------- flipped byte


FLIPS = (("sft", "model/model.safetensors"), ("score", "pairs.jsonl"), ("reward", "manifest.json"))


def flipped_byte(camp: Campaign, tiny: bool) -> list[lib.Outcome]:
    outcomes = []
    for stage, name in FLIPS[:1] if tiny else FLIPS:
        outcome = lib.Outcome("flipped-byte", f"{stage}/{name}")
        project = camp.project(f"flip-{stage}")
        pos = flip_bit(project.artifacts / stage / name, camp.rng)
        outcome.point += f" @{pos}"
        rows, _ = project.status()
        if name not in rows.get(stage, ""):
            outcome.notes.append(f"align status does not name {name}: {stage} {rows.get(stage)!r}")
        run = camp.recover(project, outcome)
        executed = {s for s, how in run.summary().items() if how == "executed"}
        if stage not in executed or not executed <= set(lib.downstream(stage)):
            outcome.recovered = False
            outcome.notes.append(f"rebuilt {sorted(executed)}: expected {stage} and only stages below it")
        outcomes.append(outcome)
        camp.log(f"  {outcome.point}: rebuilt {sorted(executed)}; {report(outcome)}")
    return outcomes


# --------------------------------------------------------------------------- concurrent


# (label, manual `align run`s with the project's params, manual runs with other params), each beside one run of
# the nightly deployment (`align serve`, `prefect deployment run align/nightly`): 2, 3 and 4 runs at once
RACES = (("1 run + nightly, same params", 1, 0), ("1 run + nightly + 1 other params", 1, 1),
         ("2 runs + nightly + 1 other params", 2, 1))
OTHER = ["--set", "run.output_dir=artifacts-other", "--set", "policy.dpo.learning_rate=0.0002"]


def concurrent(camp: Campaign, tiny: bool) -> list[lib.Outcome]:
    """Manual `align run`s and a run of the nightly deployment at once, on a project whose stages from score down
    are missing: those with the project's params share one output folder, others with other params (and their
    own run.output_dir) build their own fingerprint."""
    outcomes = []
    for label, same, other in camp.slice(RACES[:1] if tiny else list(RACES)):
        outcome = lib.Outcome("concurrent", label)
        project = camp.project(f"concurrent-{same}-{other}")
        project.remove(*lib.downstream("score"))
        try:
            builds = race(camp, project, outcome, same, other)
            camp.log(f"  {label}: builds {builds}; {report(outcome)}")
        except Exception as e:  # noqa: BLE001 -- recorded as a run that did not recover
            outcome.notes.append(f"{type(e).__name__}: {e}"[:1000])
            camp.log(f"  {label}: {report(outcome)}")
        outcomes.append(outcome)
    return outcomes


def race(camp: Campaign, project: lib.Project, outcome: lib.Outcome, same: int, other: int) -> dict[str, int]:
    """One race: the nightly flow run is triggered, and the manual runs start the moment `align serve` picks it
    up (both then import and start their flow at once); -> builds per stage among the same-params runs."""
    serve, procs = lib.Serve(project), []
    try:
        t0 = time.perf_counter()
        watch, flow_run = serve.trigger()
        procs.append(watch)
        lib.wait_for(lambda: lib.flow_run_state(serve.url, flow_run) != "SCHEDULED", watch, 120, 0.1)
        procs += [project.start("run") for _ in range(same)] + [project.start("run", *OTHER) for _ in range(other)]
        for proc in procs:
            proc.wait(900)
        outcome.recovery_s = time.perf_counter() - t0
        state = lib.flow_run_state(serve.url, flow_run)
        nightly = lib.run_table(serve.url, flow_run)
    finally:
        for proc in procs:  # a race that raised: nothing of it may run on into the next one
            if proc.poll() is None:
                for pid in [c.pid for c in lib.descendants(proc)] + [proc.pid]:
                    lib.kill(pid)
        stopped = serve.stop()
    procs = procs[1:]  # the manual runs: the same params first
    runs = [lib.Run(p.returncode, Path(p.log).read_text(), 0) for p in procs]
    failed = [f"run {i}: {r.last_line()}" for i, r in enumerate(runs) if r.rc != 0]
    if watch.returncode != 0 or state != "COMPLETED":
        failed.append(f"the nightly flow run {flow_run} ended {state} (--watch exit {watch.returncode}): "
                      f"{lib.Run(1, serve.log(), 0).last_line()[:300]}")
    outcome.notes += failed
    tables = [r.summary() for r in runs[:same]] + [nightly]
    builds = {s: sum(t.get(s) == "executed" for t in tables) for s in lib.STAGE_ORDER}
    wrong = {s: n for s, n in builds.items() if n != (1 if s in lib.downstream("score") else 0)}
    if wrong:
        outcome.notes.append(f"builds per stage among the same-params runs (nightly included): {wrong} "
                             "(expected exactly one)")
    logs = [*(Path(p.log).read_text() for p in procs[:same]), serve.log()]
    waited = sum("built by a concurrent run" in text for text in logs)
    unlocked = sum("Unable to acquire lock" in text for text in logs)  # DVC's lock, held by another run's commit
    outcome.notes.append(f"nightly built {[s for s, how in nightly.items() if how == 'executed']}; "
                         f"{waited} of {same + 1} same-params runs reused a stage built meanwhile; "
                         f"{unlocked} could not take DVC's lock for their dvc commit")
    camp.check(project, outcome)
    promoted = promotion_problems(project, camp.reference)
    outcome.identical = outcome.identical and not promoted
    outcome.notes += promoted
    outcome.leftovers += stopped
    outcome.recovered = outcome.recovered and not failed and not wrong and not promoted
    for i, run in enumerate(runs[same:]):  # one per race: the only one to build in its run.output_dir
        rows, _ = project.status(*OTHER)
        if set(run.summary().values()) != {"executed"} or \
                not all(v == "current" for v in rows.values()) or len(rows) != len(lib.STAGE_ORDER):
            outcome.recovered = False
            outcome.notes.append(f"other-params run {i} did not build its own outputs, or they are not current: "
                                 f"{run.summary()}, {rows}")
    return builds


def promotion_problems(project: lib.Project, reference: lib.Project) -> list[str]:
    """The nightly's promotion, checked against the reference: one decision in models/history.jsonl, "promoted"
    (there was no production model), and models/production holding the reference's merged model, file for file."""
    import json

    from stages.adapter_merge import model_identity

    models = project.repo / "models"
    history = (models / "history.jsonl").read_text().splitlines() if (models / "history.jsonl").is_file() else []
    if len(history) != 1:
        return [f"models/history.jsonl has {len(history)} decisions (expected the nightly's one)"]
    event, candidate = json.loads(history[0]), reference.artifacts / "merge" / "model"
    problems = [] if event["event"] == "promoted" else [f"the nightly did not promote: {event['reason']}"]
    if event["candidate_hash"] != model_identity(candidate):
        problems.append(f"the nightly's candidate {event['candidate_hash']} is not the reference's merged model")
    ref, mine = lib.all_bytes(candidate), lib.all_bytes(models / "production")
    changed = sorted(k for k in ref if k not in ("README.md", "lineage.json") and mine.get(k) != ref[k])
    problems += [f"models/production/{k}: not the reference's merged bytes" for k in changed]
    problems += [f"temporary models/{p.relative_to(models)}" for p in models.rglob("*.tmp")]
    return problems


# --------------------------------------------------------------------------- disk full


def disk_full(camp: Campaign, tiny: bool) -> list[lib.Outcome]:
    """run.output_dir on a tmpfs with less room than sft's rebuild needs; the previous sft must stay in place."""
    outcomes = []
    if not lib.can_mount_tmpfs(camp.work):
        camp.log("  skipped: a tmpfs cannot be mounted here (it needs root)")
        return outcomes
    for margin in ((0.5,) if tiny else (0.25, 0.75)):
        outcome = lib.Outcome("disk-full", f"sft save, tmpfs {margin:.0%} of the output short")
        project = camp.project("disk-full")
        if tiny:  # cheaper: sft is rebuilt over a damaged previous version (one flipped bit), nothing built first
            flip_bit(project.artifacts / "sft" / "model" / "model.safetensors", camp.rng)
        else:  # the previous version was built with another learning rate, and is current for it
            rate = project.params()["sft"]["learning_rate"]
            project.set_params({"sft": {"learning_rate": rate * 3}})
            run = project.align("run")
            if run.rc != 0:
                raise RuntimeError(f"building the disk-full variant failed:\n{run.out[-3000:]}")
            project.set_params({"sft": {"learning_rate": rate}})
        before = lib.all_bytes(project.artifacts / "sft")
        need = lib.folder_size(camp.reference.artifacts / "sft")
        with lib.tmpfs(project.artifacts, int(need * (1 - margin))) as mounted:
            if not mounted:
                raise RuntimeError(f"cannot mount a tmpfs at {project.artifacts}")
            failed = project.align("run")
            line = failed.last_line()
            folder = str(project.artifacts / "sft")
            if failed.rc != 5 or folder not in line or "needs at least" not in line or "bytes" not in line:
                outcome.notes.append(f"the full-disk run did not fail with the folder and bytes: rc {failed.rc}: "
                                     f"{line[:300]}")
            else:
                outcome.notes.append(f"message: {line[:400]}")
            if lib.all_bytes(project.artifacts / "sft") != before:
                outcome.notes.append("the previous sft version was not kept in place")
            lib.remount(project.artifacts, 1 << 30)  # space freed: the rerun must finish
            camp.recover(project, outcome)
            kept = not any(n.startswith(("the full-disk", "the previous")) for n in outcome.notes)
            outcome.recovered = outcome.recovered and kept
        outcomes.append(outcome)
        camp.log(f"  {outcome.point}: {report(outcome)}")
    return outcomes


# --------------------------------------------------------------------------- server death


def server_death(camp: Campaign, tiny: bool) -> list[lib.Outcome]:
    """A Prefect server of its own, SIGKILLed while `stage` builds, started again on the same port."""
    import json

    import psutil

    outcomes = []
    # back within Prefect's client retries (the run carries on), or not (the run fails and says so)
    points = (("sft", 1.0),) if tiny else (("sft", 1.0), ("evaluate", 20.0), ("sft", 150.0))
    for stage, down_s in camp.slice(points):
        outcome = lib.Outcome("server-death", f"during {stage}, down {down_s:g}s")
        env = {**camp.env, "PREFECT_HOME": str(camp.work / f"prefect-death-{stage}")}
        port = free_port()
        url = camp.start_server(camp.reference.repo, env, port)
        project = camp.project(f"server-death-{stage}")
        project.env.update(PREFECT_HOME=env["PREFECT_HOME"], PREFECT_API_URL=url)
        project.remove(*lib.downstream(stage))
        proc = project.start("run")
        # wait_for calls its lambdas before returning, inside this iteration (B023 guards against late calls)
        lib.wait_for(lambda: lib.building(project, stage), proc, 300)  # noqa: B023
        pid = json.loads((Path(env["PREFECT_HOME"]) / "align-server.json").read_text())["pid"]
        for p in server_tree(pid):
            lib.kill(p)
        psutil.wait_procs([psutil.Process(p) for p in server_tree(pid) if psutil.pid_exists(p)], timeout=10)
        time.sleep(down_s)
        lib.wait_for(lambda: port_free(port), None, 60, 0.2)  # noqa: B023
        project.env["PREFECT_API_URL"] = camp.start_server(camp.reference.repo, env, port)
        if project.env["PREFECT_API_URL"] != url:
            outcome.notes.append(f"the server came back at {project.env['PREFECT_API_URL']}, not {url}")
        proc.wait(900)
        first = lib.Run(proc.returncode, Path(proc.log).read_text(), 0)
        built = [s for s in lib.downstream(stage) if project.manifest(s)]
        if first.rc == 0:
            outcome.notes.append("the flow run carried on")
        else:
            line = first.last_line()
            says = "prefect server" in line.lower()
            outcome.notes.append(f"the flow run failed ({'says so' if says else 'does not say why'}): {line[:300]}")
            if not says:
                outcome.recovered = False
        rerun = camp.recover(project, outcome)
        rebuilt = [s for s in built if rerun.summary().get(s) == "executed"]
        if rebuilt:
            outcome.recovered = False
            outcome.notes.append(f"stages finished before the rerun were rebuilt: {rebuilt}")
        if first.rc != 0 and "prefect server" not in first.last_line().lower():
            outcome.recovered = False
        outcomes.append(outcome)
        camp.log(f"  {outcome.point}: finished before the rerun {built}; {report(outcome)}")
    return outcomes


# --------------------------------------------------------------------------- worker kill


def worker_kill(camp: Campaign, tiny: bool) -> list[lib.Outcome]:
    """Rank 1 of a 2-process sft SIGKILLed after a complete checkpoint: the launcher names the rank and the
    signal, no process is left, the rerun resumes from that checkpoint to the uninterrupted 2-process bytes."""
    import psutil

    launch = ["--set", "run.launch.num_processes=2"]
    clean = camp.project("worker-clean")
    clean.remove(*lib.downstream("sft"))
    ref = lib.stage(clean, "sft", *launch)
    if ref.rc != 0:
        raise RuntimeError(f"the uninterrupted 2-process sft failed:\n{ref.out[-3000:]}")
    reference = lib.outputs(clean)["sft"]
    save = lib.SAVE_STEPS["sft"]
    outcomes = []
    for after in ((save,) if tiny else (save, 2 * save)):
        outcome = lib.Outcome("worker-kill", f"rank 1 of 2, sft after checkpoint-{after}")
        project = camp.project("worker-kill")
        project.remove(*lib.downstream("sft"))
        proc = lib.stage_process(project, "sft", *launch)
        found = lib.wait_for(lambda: lib.complete_checkpoint_at(project, "sft", after) and lib.rank_process(proc, 1),  # noqa: B023
                             proc, 300)
        tree = lib.descendants(proc)
        if not found:
            outcome.notes.append("the run ended before the checkpoint")
        else:
            lib.kill(found.pid)
        proc.wait(300)
        last = lib.last_complete_checkpoint(project, "sft")  # what the rerun must resume from (`after` or later)
        out = Path(proc.log).read_text()
        line = lib.Run(proc.returncode, out, 0).last_line()
        named = "rank 1" in line and ("SIGKILL" in line or "signal 9" in line.lower())
        if proc.returncode == 0 or not named:
            outcome.notes.append(f"the launcher's last line does not name the rank and the signal: {line[:300]}")
        time.sleep(1)
        orphans = [p for p in tree if psutil.pid_exists(p.pid) and p.is_running() and p.status() != "zombie"]
        outcome.leftovers += [f"orphan process {p.pid}" for p in orphans]
        rerun = lib.stage(project, "sft", *launch)
        outcome.recovery_s = rerun.seconds
        resumed = (project.manifest("sft") or {}).get("metrics", {}).get("resumed_from") or ""
        mine = lib.outputs(project)["sft"]
        outcome.identical = mine == reference
        if not outcome.identical:
            diff = sorted(k for k in reference["files"] if (mine["files"] or {}).get(k) != reference["files"][k])
            outcome.notes.append(f"not the uninterrupted 2-process bytes: {diff}")
        published = last == 0 and "executed\": false" in rerun.out  # rank 0 published before rank 1 died
        resumed_right = resumed.endswith(f"checkpoint-{last}") if last else published
        outcome.recovered = rerun.rc == 0 and resumed_right and named
        if rerun.rc == 0 and not resumed_right:
            outcome.notes.append(f"resumed from {resumed!r}, not checkpoint-{last}, the last complete one")
        outcome.notes.append("the kill landed after rank 0 published the output: nothing to resume" if published
                             else f"resumed from checkpoint-{last}")
        outcome.leftovers += lib.leftovers(project, camp.server_pids)
        outcome.notes.append(f"launcher: {line[:240]}")
        outcomes.append(outcome)
        camp.log(f"  {outcome.point}: {report(outcome)}")
    return outcomes


CURRENT: Campaign | None = None  # the running campaign, told of each finished run

RUNNERS = {"sigkill": sigkill, "disk-full": disk_full, "server-death": server_death, "concurrent": concurrent,
           "flipped-byte": flipped_byte, "worker-kill": worker_kill}
TINY = ("sigkill", "flipped-byte", "disk-full")


def report(o: lib.Outcome) -> str:
    """One line on outcome `o` (each fault calls it once per finished run)."""
    if CURRENT is not None:
        CURRENT.on_outcome(o)
    return (f"recovered={o.recovered} identical={o.identical} leftovers={o.leftovers} "
            f"recovery={o.recovery_s and round(o.recovery_s, 1)}s {'; '.join(o.notes)[:600]}")


def table(outcomes: list[lib.Outcome]) -> list[dict]:
    rows = []
    for fault in FAULTS:
        mine = [o for o in outcomes if o.fault == fault]
        if not mine:
            continue
        times = [o.recovery_s for o in mine if o.recovery_s is not None]
        rows.append({"fault": fault, "runs": len(mine), "recovered": sum(o.recovered for o in mine),
                     "identical": sum(o.identical for o in mine), "leftovers": sum(len(o.leftovers) for o in mine),
                     "median_recovery_s": round(statistics.median(times), 1) if times else None})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'fault':<14} {'runs':>4} {'recovered':>9} {'identical bytes':>15} {'leftovers':>9} "
          f"{'median recovery s':>17}")
    for r in rows:
        print(f"{r['fault']:<14} {r['runs']:>4} {r['recovered']:>9} {r['identical']:>15} {r['leftovers']:>9} "
              f"{r['median_recovery_s']!s:>17}")
    total = {k: sum(r[k] for r in rows) for k in ("runs", "recovered", "identical", "leftovers")}
    print(f"{'total':<14} {total['runs']:>4} {total['recovered']:>9} {total['identical']:>15} "
          f"{total['leftovers']:>9}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="one run of a few faults (the CI subset)")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill points and the flipped bits")
    p.add_argument("--only", action="append", choices=FAULTS, help="run only this fault (repeatable)")
    p.add_argument("--points", metavar="A:B", help="only points A to B-1 of each fault's list (to spread the "
                   "campaign over processes or machines; the same --seed gives the same lists)")
    p.add_argument("--keep", action="store_true", help="keep the temporary projects (their path is printed)")
    p.add_argument("--json", metavar="FILE", help="also write the table and every run's outcome here")
    args = p.parse_args(argv)
    faults = args.only or (TINY if args.tiny else FAULTS)
    work = Path(tempfile.mkdtemp(prefix="align-faults-"))
    print(f"campaign folder: {work}", flush=True)
    t0 = time.perf_counter()
    global CURRENT
    camp = None
    outcomes: list[lib.Outcome] = []
    done: list[lib.Outcome] = []

    def save(outcome: lib.Outcome) -> None:  # the table so far, after every run: a cut-short campaign keeps it
        done.append(outcome)
        if args.json:
            write_json(args.json, done)

    try:
        camp = CURRENT = Campaign(work, args.seed, log=lambda line: print(line, flush=True), on_outcome=save)
        camp.points = args.points
        print(f"reference align run: {camp.reference_s:.1f} s", flush=True)
        for fault in faults:
            print(f"{fault}:", flush=True)
            try:
                outcomes += RUNNERS[fault](camp, args.tiny)
            except Exception as e:  # noqa: BLE001 -- one broken fault must not hide the others' rows
                outcomes.append(lib.Outcome(fault, "setup", notes=[f"{type(e).__name__}: {e}"[:2000]]))
                print(f"  {fault} failed to run: {outcomes[-1].notes[0]}", flush=True)
    finally:
        if camp is not None:
            camp.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = table(outcomes)
    print_table(rows)
    print(f"\nseed {args.seed}, {time.perf_counter() - t0:.0f} s in all")
    if args.json:
        write_json(args.json, outcomes)
    return 0 if all(o.ok for o in outcomes) else 1


def write_json(path: str, outcomes: list[lib.Outcome]) -> None:
    import dataclasses
    import json

    Path(path).write_text(json.dumps({"table": table(outcomes), "runs": [dataclasses.asdict(o) for o in outcomes]},
                                     indent=2))


if __name__ == "__main__":
    sys.exit(main())
