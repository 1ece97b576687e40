"""Training progress reaches the Prefect task log, rate-limited (tasks/stage.py forwards the `stages` logger)."""
import logging
import re
import time

import pytest

from stages.harness.params_loader import load_params
from tests.conftest import write_params

pytestmark = pytest.mark.slow
PROGRESS = re.compile(r"^step \d+/300 steps \(\d+%\), [\d.e+]+ steps/s, ETA \w+")


def test_sft_progress_in_the_task_log_at_most_one_line_a_second(tmp_path, prefect_server, monkeypatch):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from tasks.stage import STAGE_TASKS

    preprocess, sft = STAGE_TASKS["preprocess"], STAGE_TASKS["sft"]

    monkeypatch.setenv("ALIGN_PROGRESS_EVERY_S", "1")
    prefect_logger = logging.getLogger("prefect")  # tests/conftest.py sets PREFECT_LOGGING_LEVEL=WARNING
    monkeypatch.setattr(prefect_logger, "level", logging.INFO)
    params = load_params(write_params(tmp_path, {"sft": {"max_steps": 300, "logging_steps": 10}}))

    @flow(name="progress-log")
    def two_stages():
        return sft(params, [preprocess(params)])

    state = two_stages(return_state=True)
    assert state.is_completed(), state.message
    wall = state.result()["wall_time_s"]
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        for _ in range(20):  # the API log handler sends in batches
            lines = [log.message for log in client.read_logs(log_filter=log_filter) if log.task_run_id]
            if any(line.startswith("step 300/300") for line in lines):
                break
            time.sleep(0.5)
    progress = [line for line in lines if PROGRESS.match(line)]
    print(f"\nsft {wall} s: {len(progress)} progress lines in the task log, e.g. {progress[-1] if progress else None}")
    assert progress, lines
    assert len(progress) <= wall + 1  # one a second at most (300 steps, a line per step without the limit)
    assert any(re.match(r"^step 300/300 steps \(100%\), .* done in \w+, loss=", line) for line in lines), lines
