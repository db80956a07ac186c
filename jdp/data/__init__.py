"""Input data: the experiment's sources (TFDS by name, the built-in datasets, the
user's own files, text for language models, or anything random-access), the
global-index sampler that makes the example stream independent of the topology,
and preprocessing.

`core` defines `Data` (what an experiment's `build_data` returns) and its checks;
`splits` the interface the trainer reads batches through and the factory that picks
an implementation: `in_memory` (a split read once and batched by vectorised numpy,
with `index_shuffle`, grain's shuffle of a whole epoch) or `streamed` (grain, example
by example); `prefetch` moves batches onto the devices ahead of the step. The
sources: `default` (the data a config names), `tfds_source`, `files`, `digits`,
`addition`, `text/` (tokenizers, token stores, packed windows); `images` is image
preprocessing.
"""

from jdp.data.core import Data

__all__ = ["Data"]
