"""Exceptions users see. Each message is one line naming the field, the value and the fix."""


class PlanError(ValueError):
    """A plan file, model config or cluster profile is malformed or inconsistent.

    Raised before any process group exists. The CLI prints `str(err)` as one line and exits 2.
    """

    def __init__(self, message: str) -> None:
        # One line, always: a newline would break `mapfile`-style log parsing in Slurm scripts.
        super().__init__(" ".join(str(message).split()))


class InfeasiblePlanError(RuntimeError):
    """No layout fits: the search found no plan under the memory budget. The CLI exits 3."""
