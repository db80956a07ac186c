"""jdp: data-parallel training of Flax models with JAX, from one device to many hosts."""

__version__ = "0.1.0"

# The global batch is split over two mesh axes: `hosts` (groups of devices that
# share a fast interconnect: by default one per process) and `local` (the devices
# of one host). Together they are the data axis: models that need a cross-device
# collective (BatchNorm over the global batch) name DATA_AXIS, a tuple that every
# JAX collective accepts (`jax.lax.pmean(x, DATA_AXIS)`); both backends bind both
# names while computing gradients. The two-level gradient reduction
# (`parallel.reduction=two_level`) reduces over `local` and `hosts` in turn.
HOSTS_AXIS = "hosts"
LOCAL_AXIS = "local"
DATA_AXIS = (HOSTS_AXIS, LOCAL_AXIS)
# With `parallel.model_parallel` > 1 the mesh has a third axis, inside each host: the
# devices along it compute on the same rows of the batch, each with its share of every
# layer's weights (tensor parallelism). The batch and the gradient reduction stay on the
# data axes.
MODEL_AXIS = "model"
