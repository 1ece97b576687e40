"""`dvc repro` in a real git repository agrees with the stage manifests and with the Prefect flow; DVC's
comparisons and plots work offline: a commit carries the metrics, `dvc metrics show` is one short row per
model, `dvc exp run -S` / `dvc exp show` / `dvc metrics diff` compare experiments and commits, and
`dvc plots show` writes a page that a real headless browser renders without network.

One `dvc repro` of the small pipeline serves every test (a module fixture; they run in file order)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from stages.metrics.report import HEADLINE
from tests.conftest import ROOT, STAGE_ORDER, write_params

pytestmark = pytest.mark.slow

HEADLINE_DIR = "artifacts/metrics/models"


def bin_path(path: str = os.environ["PATH"]) -> str:
    """PATH with this interpreter's bin folder first (what `. .venv/bin/activate` does)."""
    return f"{os.path.dirname(sys.executable)}:{path}"


def sh(*cmd, cwd, check=True, path=None):
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": path or bin_path()}
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # 20 s is short on a loaded machine
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


def commit(repo, message):
    sh("git", "add", "-A", cwd=repo)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", message, cwd=repo)


def make_dvc_repo(repo):
    """A fresh git + DVC checkout of the project's stages, dvc.yaml, DVC config and (small) params.yaml."""
    repo.mkdir()
    shutil.copytree(ROOT / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(ROOT / name, repo / name)
    params = write_params(repo)
    text = params.read_text().replace(str(repo / "artifacts"), "artifacts")  # dvc.yaml's relative output_dir
    params.write_text(text)
    sh("git", "init", "-q", cwd=repo)
    sh("dvc", "init", "-q", cwd=repo)
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")  # analytics off, the offline plots page
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    commit(repo, "init")
    return repo


@pytest.fixture
def dvc_repo(tmp_path):
    return make_dvc_repo(tmp_path / "repo")


def set_param(repo, old, new):
    path = repo / "params.yaml"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def ran(output: str) -> list[str]:
    return [s for s in STAGE_ORDER if f"Running stage '{s}'" in output]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A git + DVC checkout with the small pipeline reproduced by `dvc repro` (every stage ran) and committed.

    One build serves the whole module: the tests below run in file order and each leaves the checkout
    clean for the next (the comparisons commit an experiment; the flow test changes a policy param)."""
    repo = make_dvc_repo(tmp_path_factory.mktemp("dvc") / "repo")
    assert ran(sh("dvc", "repro", cwd=repo).stdout) == list(STAGE_ORDER)
    metrics = json.loads((repo / "artifacts" / "metrics" / "evaluate.json").read_text())
    assert 0 <= metrics["accuracy"] <= 1
    commit(repo, "baseline")
    return repo


def test_commit_carries_compact_metrics(built):
    tracked = sh("git", "ls-files", "artifacts", cwd=built).stdout.split()
    assert sorted(tracked) == sorted(["artifacts/metrics/.gitignore",  # DVC's: the stages' flat files are cached
                                      *(f"{HEADLINE_DIR}/{m}.json" for m in ("base", "sft", "policy", "merged"))])
    assert sh("git", "status", "--porcelain", cwd=built).stdout == ""  # the outputs themselves are ignored
    lines = sh("dvc", "metrics", "show", cwd=built).stdout.strip().splitlines()
    assert lines[0].split() == ["Path", *HEADLINE], lines
    assert [line.split()[0] for line in lines[1:]] == [f"{HEADLINE_DIR}/{m}.json" for m in
                                                       ("base", "sft", "policy", "merged")], lines
    assert max(map(len, lines)) <= 80, "\n".join(lines)


def test_repro_noop_partial_rerun_and_run_cache(built):
    t0 = time.perf_counter()
    again = sh("dvc", "repro", cwd=built).stdout
    print(f"dvc repro no-op: {time.perf_counter() - t0:.2f}s")
    assert ran(again) == [], again
    status = sh(sys.executable, "-m", "stages", "status", cwd=built).stdout
    assert status.count("current") == len(STAGE_ORDER), status  # the manifests agree with DVC

    set_param(built, "max_new_tokens: 4", "max_new_tokens: 5")
    assert ran(sh("dvc", "repro", cwd=built).stdout) == ["evaluate"]
    set_param(built, "max_new_tokens: 5", "max_new_tokens: 4")
    assert ran(sh("dvc", "repro", cwd=built).stdout) == []  # restored from DVC's run-cache
    status = sh(sys.executable, "-m", "stages", "status", cwd=built).stdout
    # ... and the restored files verify against their manifest
    assert status.count("current") == len(STAGE_ORDER), status
    assert sh("git", "status", "--porcelain", cwd=built).stdout == ""


def test_editing_the_judge_prompt_or_a_shipped_task_makes_evaluate_stale(built):
    """Both `dvc status` and `python -m stages status` see an edit of the shipped judge prompt or lm-eval task
    (the evaluate stage's code) and name evaluate alone; undone, both are clean again."""
    for rel in ("stages/evaluation/prompts/pairwise.txt", "stages/evaluation/tasks/align_arithmetic.yaml"):
        path = built / rel
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        try:
            dvc = sh("dvc", "status", cwd=built).stdout
            ours = sh(sys.executable, "-m", "stages", "status", cwd=built).stdout
        finally:
            path.write_bytes(original)
        assert re.search(rf"modified:\s+{re.escape(rel)}", dvc) and dvc.splitlines()[0].strip() == "evaluate:", dvc
        assert [line.split()[0] for line in ours.splitlines() if "stale" in line] == ["evaluate"], ours
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=built).stdout


def test_exp_run_show_and_metrics_diff_between_commits(built):
    # an experiment: a param through -S reruns only what reads it; exp show lists it with its metrics
    out = sh("dvc", "exp", "run", "-S", "evaluate.max_new_tokens=6", "-n", "longer", cwd=built).stdout
    assert ran(out) == ["evaluate"], out
    shown = json.loads(sh("dvc", "exp", "show", "--json", cwd=built).stdout)
    workspace, head = shown[0], shown[1]  # then the commit's experiments
    exps = {x.get("name"): x for r in head.get("experiments") or [] for x in r["revs"]}
    assert workspace["rev"] == "workspace" and set(exps) == {"longer"}, shown
    for row, max_new_tokens in ((workspace, 6), (exps["longer"], 6), (head, 4)):
        data = row["data"]
        assert data["params"]["params.yaml"]["data"]["evaluate"]["max_new_tokens"] == max_new_tokens
        metrics = data["metrics"]
        assert set(metrics) == {f"{HEADLINE_DIR}/{m}.json" for m in ("base", "sft", "policy", "merged")}, row
        assert all(set(m["data"]) == set(HEADLINE) for m in metrics.values()), metrics

    # committed: dvc metrics diff compares the two revisions, file by file, value by value
    commit(built, "longer completions")
    diff = json.loads(sh("dvc", "metrics", "diff", "HEAD~1", "--all", "--json", cwd=built).stdout)
    assert set(diff) == {f"{HEADLINE_DIR}/{m}.json" for m in ("base", "sft", "policy", "merged")}, diff
    for path, values in diff.items():
        assert set(values) == set(HEADLINE), (path, values)
        assert all({"old", "new"} <= set(v) for v in values.values()), (path, values)
    assert json.loads(sh("dvc", "params", "diff", "HEAD~1", "--json", cwd=built).stdout) == {
        "params.yaml": {"evaluate.max_new_tokens": {"old": 4, "new": 6, "diff": 2}}}


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browse(url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--virtual-time-budget=10000", "--window-size=1200,2400", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)")
def test_plots_page_renders_offline_in_chromium(built, tmp_path):
    sh("dvc", "plots", "show", cwd=built)
    page = built / "dvc_plots" / "index.html"
    html = page.read_text()
    assert not re.search(r"<script[^>]+src=", html), "the page loads a script from elsewhere"
    assert "vegaEmbed(" in html and 'id = "training_loss"' in html
    assert "dvc_plots" not in sh("git", "status", "--porcelain", cwd=built).stdout  # git-ignored

    # the network is unreachable here anyway; --proxy-server to nowhere makes sure of it elsewhere
    offline = "--proxy-server=127.0.0.1:9"
    dom = browse(page.as_uri(), offline, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    svgs = re.findall(r"<svg[^>]*class=\"marks\".*?</svg>", dom.stdout, flags=re.S)
    assert len(svgs) == 2, f"expected the 2 vega plots as SVG, found {len(svgs)}:\n{dom.stdout[-3000:]}"
    loss, accuracy = svgs
    lines = re.findall(r'<path aria-label="[^"]*filename: (loss_\w+)\.json" role="graphics-symbol" '
                       r'aria-roledescription="line mark" d="M[\d.]+,[\d.]+(?:L[\d.]+,[\d.]+)+"', loss)
    assert set(lines) == {"loss_sft", "loss_reward", "loss_policy"}, lines  # a drawn curve per training stage
    bars = re.findall(r'<path aria-label="accuracy: [\d.]+; model: (\w+);[^"]*" role="graphics-symbol" '
                      r'aria-roledescription="bar"', accuracy)
    assert sorted(bars) == ["base", "merged", "policy", "sft"], bars

    shot = tmp_path / "plots.png"
    res = browse(page.as_uri(), offline, f"--screenshot={shot}")
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    import numpy as np
    from PIL import Image

    top = np.asarray(Image.open(shot).convert("RGB"), dtype=int)[:400]  # the vega plots; DVC's PNGs follow
    purple = np.array([148, 93, 214])  # DVC's colour of the workspace revision (#945dd6): the curves drawn
    marks = int((np.abs(top - purple).max(axis=2) <= 24).sum())
    assert marks >= 200, f"only {marks} pixels of the curves' colour in the top of {shot}"


def without_venv(path: str = os.environ["PATH"]) -> str:
    """PATH without this interpreter's bin folder: `make run` runs `.venv/bin/align` with the venv inactive."""
    here = os.path.realpath(os.path.dirname(sys.executable))
    return ":".join(p for p in path.split(":") if p and os.path.realpath(p) != here)


def set_key(repo, dotted: str, value) -> None:
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    *parents, last = dotted.split(".")
    node = params
    for key in parents:
        node = node[key]
    node[last] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def test_flow_keeps_dvc_lock_in_step_without_dvc_on_path(built):
    """What `make run` then the README's DVC section do: the flow (dvc not on PATH) sees DVC's build as
    current, records the stages it executes in dvc.lock, so `dvc status` is clean and `dvc repro` runs
    nothing; a missing or unrecordable lock is reported."""
    flow = sh(sys.executable, "-m", "flows.cli", "run", cwd=built, path=without_venv()).stdout
    assert flow.count(" cached ") == len(STAGE_ORDER), flow  # the Prefect path agrees with DVC's build

    set_key(built, "policy.dpo.learning_rate", 0.0002)  # a change through the flow: policy and below execute
    flow = sh(sys.executable, "-m", "flows.cli", "run", cwd=built, path=without_venv()).stdout
    rows = [line.split()[:2] for line in flow.splitlines()]
    below = STAGE_ORDER.index("policy")
    assert [r for r in rows if len(r) == 2 and r[1] in ("cached", "executed")] == [
        *([s, "cached"] for s in STAGE_ORDER[:below]), *([s, "executed"] for s in STAGE_ORDER[below:])], flow
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=built).stdout
    t0 = time.perf_counter()
    again = sh("dvc", "repro", cwd=built).stdout
    print(f"dvc repro right after the flow: {time.perf_counter() - t0:.2f}s")
    assert ran(again) == [], again
    status = sh(sys.executable, "-m", "flows.cli", "status", cwd=built).stdout.splitlines()
    assert status[-1].startswith("dvc.lock     in step"), status

    # a lost lock: `align status` says so and how to fix it; the next (all cached) run records it again
    (built / "dvc.lock").unlink()
    status = sh(sys.executable, "-m", "flows.cli", "status", cwd=built, path=without_venv()).stdout
    assert "dvc.lock     missing" in status and "-m dvc commit --force" in status, status
    flow = sh(sys.executable, "-m", "flows.cli", "run", cwd=built, path=without_venv())
    assert flow.stdout.count(" cached ") == len(STAGE_ORDER), flow.stdout
    assert (built / "dvc.lock").is_file(), flow.stdout + flow.stderr
    assert ran(sh("dvc", "repro", cwd=built).stdout) == []

    # DVC cannot record it (a broken .dvc/config): the run still succeeds, and its log says why, loudly
    (built / "dvc.lock").unlink()
    config = built / ".dvc" / "config"
    config.write_text(config.read_text() + "[no_such_section]\n    x = 1\n")
    flow = sh(sys.executable, "-m", "flows.cli", "run", cwd=built, path=without_venv())
    log = flow.stdout + flow.stderr
    assert "WARNING" in log and "dvc.lock not updated" in log and "no_such_section" in log, log
    assert not (built / "dvc.lock").exists()


def test_sync_says_why_it_cannot_record(tmp_path, monkeypatch):
    from flows import dvc_sync

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    params = str(tmp_path / "params.yaml")
    out = str(tmp_path / "artifacts")
    assert dvc_sync.why_not_recorded(params, out, []) == (
        "warning", f"dvc.lock not updated: {tmp_path} has dvc.yaml but no .dvc/ folder; run `dvc init` there")
    (tmp_path / ".dvc").mkdir()
    assert dvc_sync.why_not_recorded(params, out, []) is None
    level, why = dvc_sync.why_not_recorded(params, out, ["sft.learning_rate=1e-3"])
    assert level == "info" and "sft.learning_rate=1e-3" in why
    level, why = dvc_sync.why_not_recorded(params, str(tmp_path / "elsewhere"), [])
    assert level == "info" and "run.output_dir" in why
    monkeypatch.setitem(sys.modules, "dvc", None)  # as if dvc were not installed in this environment
    level, why = dvc_sync.why_not_recorded(params, out, [])
    assert level == "warning" and f"dvc is not installed for {sys.executable}" in why
    assert dvc_sync.lock_status(tmp_path).startswith("dvc.lock     unknown: dvc is not installed")
