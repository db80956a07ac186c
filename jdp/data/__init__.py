"""Input data: the experiment's sources (TFDS by name, the built-in datasets, the
user's own files or anything random-access), the global-index sampler that
makes the example stream independent of the topology, and preprocessing.

`core` defines `Data` (what an experiment's `build_data` returns) and its
checks; `pipeline` the sampler, batching and prefetch; `in_memory` the same
batches for splits read into memory, with `index_shuffle` (grain's shuffle of
a whole epoch); `default` the data a config names; `tfds_source`, `files`,
`digits` and `addition` the sources; `images` image preprocessing.
"""

from jdp.data.core import Data

__all__ = ["Data"]
