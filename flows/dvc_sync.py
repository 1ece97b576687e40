"""Keep `dvc.lock` in step with what the Prefect flow built.

After a flow run that used `params.yaml` as it is (no overrides) and the default output
folder, the outputs on disk are exactly what `dvc.yaml` describes, so `dvc commit` records
them: a following `dvc repro` / `dvc status` agrees they are current instead of rebuilding.
With overrides the workspace differs from params.yaml on purpose and nothing is recorded
(DVC then rightly reports the stages as changed).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from prefect import get_run_logger

from stages.dvcgen import OUTPUT_DIR


def record_in_dvc_lock(params_file: str, output_dir: str) -> bool:
    logger = get_run_logger()
    root = Path(params_file).resolve().parent
    if Path(params_file).name != "params.yaml" or Path(output_dir) != Path(OUTPUT_DIR):
        return False
    if not (root / "dvc.yaml").exists() or not (root / ".dvc").is_dir() or shutil.which("dvc") is None:
        return False
    res = subprocess.run(["dvc", "commit", "--force", "--quiet"], cwd=root, capture_output=True, text=True,
                         timeout=600, env=_env())
    if res.returncode != 0:
        logger.warning("dvc commit failed (dvc.lock not updated; `dvc repro` will re-check the stages): %s",
                       res.stderr.strip()[-500:])
        return False
    logger.info("recorded the outputs in dvc.lock")
    return True


def _env() -> dict[str, str]:
    return {**os.environ, "DVC_NO_ANALYTICS": "1"}
