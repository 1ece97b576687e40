"""DVC comparisons and plots, offline: a commit carries the metrics, `dvc metrics show` is one short row
per model, `dvc exp run -S` / `dvc exp show` / `dvc metrics diff` compare experiments and commits, and
`dvc plots show` writes a page that a real headless browser renders without network."""
import json
import re
import shutil
import subprocess

import pytest

from stages.metrics.report import HEADLINE
from tests.conftest import STAGE_ORDER
from tests.test_dvc import commit, make_dvc_repo, ran, sh

pytestmark = pytest.mark.slow

HEADLINE_DIR = "artifacts/metrics/models"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A git + DVC checkout with the small pipeline reproduced and committed."""
    repo = make_dvc_repo(tmp_path_factory.mktemp("compare") / "repo")
    assert ran(sh("dvc", "repro", cwd=repo).stdout) == list(STAGE_ORDER)
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
