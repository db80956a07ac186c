"""Input data: TFDS sources (the built-in `digits` among them), the global-index
sampler that makes the example stream independent of the topology, and
preprocessing."""
