"""tasks.stage: one Prefect task per stage of the table, made by one factory."""
from stages.harness.registry import ALL_STAGES
from tasks.stage import AFTER_RUN, STAGE_TASKS


def test_one_task_per_stage_named_after_it():
    assert list(STAGE_TASKS) == list(ALL_STAGES) and list(ALL_STAGES)[-1] == "promote"  # the on-request stage too
    assert [t.name for t in STAGE_TASKS.values()] == list(ALL_STAGES)
    keys = [t.task_key for t in STAGE_TASKS.values()]
    assert len(set(keys)) == len(keys)  # Prefect tells the tasks apart (run names, dynamic keys)
    assert all(key.startswith(f"{name}-") for name, key in zip(ALL_STAGES, keys, strict=True))
    assert set(AFTER_RUN) <= set(ALL_STAGES)
