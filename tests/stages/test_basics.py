"""Progress lines: rate-limited, with the rate and the ETA of what this run did."""
import logging

from stages.basics import Progress, duration


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "t.progress"]


def test_lines_are_rate_limited_with_rate_and_eta(caplog):
    """600 steps, 10 s between lines; 2 steps/s: at step 40 (20 s in) 560 steps remain -> ETA 280 s = 4m40s."""
    clock, log = Clock(), logging.getLogger("t.progress")
    with caplog.at_level(logging.INFO, logger="t.progress"):
        p = Progress(log, total=600, unit="steps", what="step", every=10, clock=clock)
        for step in range(1, 41):  # one step every 0.5 s
            clock.now += 0.5
            p.update(step, loss=1.23456)
        assert lines(caplog) == ["step 20/600 steps (3%), 2 steps/s, ETA 4m50s, loss=1.235",
                                 "step 40/600 steps (7%), 2 steps/s, ETA 4m40s, loss=1.235"]
        clock.now += 1
        p.finish(loss=0.5)
    assert lines(caplog)[-1] == "step 40/600 steps (7%), 1.9 steps/s, done in 21s, loss=0.5"


def test_resumed_run_counts_only_its_own_steps(caplog):
    """Resumed at step 500 of 600: 50 steps in 10 s is 5 steps/s, 50 left -> ETA 10 s (not 500 steps in 10 s)."""
    clock, log = Clock(), logging.getLogger("t.progress")
    with caplog.at_level(logging.INFO, logger="t.progress"):
        p = Progress(log, total=600, unit="steps", start=500, every=10, clock=clock)
        clock.now += 10
        p.update(550)
    assert lines(caplog) == ["550/600 steps (92%), 5 steps/s, ETA 10s"]


def test_a_short_loop_prints_nothing(caplog):
    clock, log = Clock(), logging.getLogger("t.progress")
    with caplog.at_level(logging.INFO, logger="t.progress"):
        p = Progress(log, total=3, unit="models", every=5, clock=clock)
        for _ in range(3):
            clock.now += 1
            p.advance()
        p.finish()
    assert lines(caplog) == []


def test_duration():
    assert [duration(s) for s in (0, 59.4, 60, 188, 3599, 3600, 3720)] == \
        ["0s", "59s", "1m00s", "3m08s", "59m59s", "1h00m", "1h02m"]
