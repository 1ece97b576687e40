"""How a stage tells the runner it stopped on purpose (a leaf module: stages import it, not `stages.harness.runner`)."""


class QualityGateFailed(RuntimeError):
    """A stage's output is not good enough to build on (e.g. a reward model below reward.min_accuracy)."""


class StageFailed(RuntimeError):
    """The stage stopped for a reason its message explains (disk full, a NaN loss); nothing was published."""
