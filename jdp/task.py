"""Objectives for experiment files: `Task`, `Objective`, `Weighted` and the built-in
`classification` and `next_token` tasks. Defined in `jdp.experiment.task`."""

from jdp.experiment.task import (
    LOSS,
    Objective,
    Sums,
    Task,
    Weighted,
    check_objective,
    classification,
    means,
    next_token,
    safe_divide,
    weighted_sums,
)

__all__ = ["LOSS", "Objective", "Sums", "Task", "Weighted", "check_objective", "classification",
           "means", "next_token", "safe_divide", "weighted_sums"]
