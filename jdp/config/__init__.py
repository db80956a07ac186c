"""The config: defaults, validation, the batch arithmetic and what may change on resume.

    from jdp.config import defaults   # an experiment's get_config starts here
"""

from jdp.config.batch import BatchSplit, batch_split, scaled_learning_rate
from jdp.config.defaults import defaults
from jdp.config.resume import RESUMABLE_CHANGES, flatten, resume_differences
from jdp.config.validate import validate

__all__ = ["RESUMABLE_CHANGES", "BatchSplit", "batch_split", "defaults", "flatten",
           "resume_differences", "scaled_learning_rate", "validate"]
