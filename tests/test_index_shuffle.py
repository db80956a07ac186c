"""jdp's numpy copy of grain's index shuffle gives grain's permutation of every epoch."""

import numpy as np
import pytest
from grain.experimental import index_shuffle as grain_index_shuffle

from jdp.data import index_shuffle


@pytest.mark.parametrize("size", [1, 2, 40, 1437, 5000, 65536, 65537, 100_003, 2**20 + 7])
@pytest.mark.parametrize("seed", [0, 12345, 2**32 - 1])
def test_the_epoch_permutation_is_grains_index_shuffle(size, seed):
    # 65537: max_index 2^16 gets 16 bits in grain (its log2 in floating point), and the
    # permutation repeats a value; reproduced as it is.
    indices = np.arange(size)
    if size > 2000:  # the ends and a sample: grain's function takes ~4 us an index
        indices = np.r_[0, 1, size - 2, size - 1, np.random.default_rng(0).integers(size, size=300)]
    expected = [grain_index_shuffle(int(i), max_index=size - 1, seed=seed, rounds=4)
                for i in indices]
    np.testing.assert_array_equal(index_shuffle.permutation(size, seed)[indices], expected)


@pytest.mark.parametrize("size", [1, 40, 65536, 65537, 100_003, 2**20 + 7, 3 * 2**30 + 5])
@pytest.mark.parametrize("seed", [0, 2**32 - 1])
def test_shuffling_some_indices_alone_is_grains_index_shuffle(size, seed):
    indices = np.r_[0, size - 1, np.random.default_rng(1).integers(size, size=200)]
    expected = [grain_index_shuffle(int(i), max_index=size - 1, seed=seed, rounds=4)
                for i in indices]
    np.testing.assert_array_equal(index_shuffle.shuffle(indices, size, seed), expected)


def test_an_epoch_too_large_to_keep_a_permutation_of_is_shuffled_batch_by_batch(monkeypatch):
    from jdp.data import in_memory

    indices = np.arange(4990, 5030)  # across two epochs
    kept = in_memory.Order(5000, seed=4)
    expected = kept.positions(indices)
    assert len(kept._permutations) == 2
    monkeypatch.setattr(in_memory.Order, "PERMUTATION_MAX_EXAMPLES", 1000)
    unkept = in_memory.Order(5000, seed=4)
    np.testing.assert_array_equal(unkept.positions(indices), expected)
    assert not unkept._permutations
    unkept.check_against_grain()
