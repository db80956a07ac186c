"""jdp: data-parallel training of Flax models with JAX, from one device to many hosts."""

__version__ = "0.1.0"

# The mesh axis that the global batch is split over. Models that need a
# cross-device collective (BatchNorm over the global batch) name this axis;
# both backends bind it while computing gradients.
DATA_AXIS = "data"
