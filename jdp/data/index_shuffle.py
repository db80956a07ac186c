"""grain's index shuffle for a whole epoch at once, in numpy.

grain shuffles epoch e with `index_shuffle(i, max_index=n-1, seed, rounds=4)` for
each index i: a 4-round Simon-style Feistel cipher over the smallest even number of
bits B >= 16 that holds max_index (its round keys are C++'s `std::seed_seq{seed}`),
applied again to any value above max_index until it is not ("cycle walking"). From
Python that costs 4-35 us per index (the walks are long when n is far below 2^16):
~3 ms of a 128-example batch. `permutation` computes the same values for every
index of an epoch with a few numpy operations (~1.5 ms for the 1,437 digits, once an
epoch); tests compare it with grain's own function, and `jdp.data.in_memory` checks
it against grain before using it.
"""

from __future__ import annotations

import math

import numpy as np

ROUNDS = 4  # what grain's ShuffleMapDataset passes
_MIN_BLOCK_BITS = 16
_UINT32 = 0xFFFFFFFF


def permutation(size: int, seed: int, rounds: int = ROUNDS) -> np.ndarray:
    """[index_shuffle(i, max_index=size - 1, seed, rounds) for i in range(size)], int64."""
    max_index = size - 1
    if max_index == 0:
        return np.zeros(1, np.int64)
    bits = _block_bits(max_index)
    keys = round_keys(seed, rounds)

    def encrypt(values: np.ndarray) -> np.ndarray:
        return _encrypt(values, keys, bits // 2)

    low_bits = np.arange(size, dtype=np.uint64) & np.uint64((1 << bits) - 1)  # all it reads
    if bits == _MIN_BLOCK_BITS:
        table = encrypt(np.arange(1 << bits, dtype=np.uint64)).astype(np.int32)  # < 2^16
        return _walk_table(table, max_index)[low_bits.astype(np.intp)].astype(np.int64)
    values = encrypt(low_bits)
    walking = np.flatnonzero(values > max_index)
    while walking.size:  # each value is above max_index with probability < 3/4
        values[walking] = encrypt(values[walking])
        walking = walking[values[walking] > max_index]
    return values.astype(np.int64)


def shuffle(indices: np.ndarray, size: int, seed: int, rounds: int = ROUNDS) -> np.ndarray:
    """`permutation(size, seed)[indices]` for the given indices alone (int64), with memory
    and time in proportion to them, not to `size`: for epochs too large to hold a
    permutation of (a token store's windows). Above 2^16 the walks are short (each
    value is above max_index with probability < 3/4); at or below it, the whole epoch's
    permutation (at most 2^16 values) is computed."""
    indices = np.asarray(indices, np.int64)
    max_index = size - 1
    bits = _block_bits(max(max_index, 1))
    if bits == _MIN_BLOCK_BITS:
        return permutation(size, seed, rounds)[indices]
    keys = round_keys(seed, rounds)
    values = _encrypt(indices.astype(np.uint64), keys, bits // 2)
    walking = np.flatnonzero(values > max_index)
    while walking.size:
        values[walking] = _encrypt(values[walking], keys, bits // 2)
        walking = walking[values[walking] > max_index]
    return values.astype(np.int64)


def _walk_table(table: np.ndarray, max_index: int) -> np.ndarray:
    """For every value v <= max_index of the block (and below its size): the first of
    table[v], table[table[v]], ... that is at most max_index.

    A walk is ~2^16 / (max_index + 1) steps long on average (each step lands at most
    max_index with that probability). Walking all starts together takes as many numpy
    passes as the longest walk, so the table first jumps 2^k steps at once (pointer
    doubling, stopping at values <= max_index), k chosen so that a few dozen passes of
    the starts still walking remain: ~0.6 ms for 1,437 starts, against ~2 ms for
    doubling until every walk ends.
    """
    starts = min(max_index + 1, len(table))
    mean_walk = len(table) / starts
    hop = table
    for _ in range(max(0, int(math.log2(mean_walk)) - 3)):
        hop = np.where(hop > max_index, hop[hop], hop)
    values = hop[:starts].copy()
    walking = np.flatnonzero(values > max_index)
    while walking.size:
        values[walking] = hop[values[walking]]
        walking = walking[values[walking] > max_index]
    return values


def _block_bits(max_index: int) -> int:
    """The cipher's block: ceil(log2(max_index)) rounded up to even, at least 16, computed
    in floating point as grain does (so max_index = 2^k gets k bits, not k + 1)."""
    bits = math.ceil(math.log2(float(max_index)))
    return max(bits + bits % 2, _MIN_BLOCK_BITS)


def round_keys(seed: int, rounds: int) -> list[int]:
    """`rounds` uint32 values of C++'s `std::seed_seq{seed}.generate` (the algorithm the
    C++ standard specifies in [rand.util.seedseq])."""
    n, entropy = rounds, [seed & _UINT32]
    keys = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(len(entropy) + 1, n)

    def mix(x: int) -> int:
        return x ^ (x >> 27)

    for k in range(m):
        r1 = 1664525 * mix(keys[k % n] ^ keys[(k + p) % n] ^ keys[(k - 1) % n]) & _UINT32
        if k == 0:
            r2 = r1 + len(entropy)
        elif k <= len(entropy):
            r2 = r1 + k % n + entropy[k - 1]
        else:
            r2 = r1 + k % n
        r2 &= _UINT32
        keys[(k + p) % n] = (keys[(k + p) % n] + r1) & _UINT32
        keys[(k + q) % n] = (keys[(k + q) % n] + r2) & _UINT32
        keys[k % n] = r2
    for k in range(m, m + n):
        total = (keys[k % n] + keys[(k + p) % n] + keys[(k - 1) % n]) & _UINT32
        r3 = 1566083941 * mix(total) & _UINT32
        r4 = (r3 - k % n) & _UINT32
        keys[(k + p) % n] ^= r3
        keys[(k + q) % n] ^= r4
        keys[k % n] = r4
    return keys


def _encrypt(values: np.ndarray, keys: list[int], word_bits: int) -> np.ndarray:
    """The Feistel cipher on uint64 `values` of 2 x word_bits bits: per pair of round
    keys, left ^= f(right) ^ k1, then right ^= f(left) ^ k2 (keys cut to word_bits)."""
    if word_bits == 8:  # the 2^16 block: in uint8, ~4x faster than in uint32
        return _encrypt_bytes(values, keys)
    word = np.uint32 if word_bits <= 16 else np.uint64  # uint32: ~5x faster in numpy
    mask = (1 << word_bits) - 1

    def rotate_left(x: np.ndarray, r: int) -> np.ndarray:
        return ((x << r) | (x >> (word_bits - r))) & mask

    def f(x: np.ndarray) -> np.ndarray:
        return (rotate_left(x, 1) & rotate_left(x, 8)) ^ rotate_left(x, 2)

    left = ((values >> word_bits) & mask).astype(word)
    right = (values & mask).astype(word)
    for k1, k2 in zip(keys[0::2], keys[1::2], strict=True):
        left ^= f(right) ^ word(k1 & mask)
        right ^= f(left) ^ word(k2 & mask)
    return (left.astype(np.uint64) << word_bits) | right


def _encrypt_bytes(values: np.ndarray, keys: list[int]) -> np.ndarray:
    """`_encrypt` with 8-bit words, held in uint8: its shifts drop the bits the mask
    would, and a rotation by 8 is none."""
    def f(x: np.ndarray) -> np.ndarray:
        return (((x << 1) | (x >> 7)) & x) ^ ((x << 2) | (x >> 6))

    eight, byte = np.uint64(8), np.uint64(0xFF)  # with Python ints: ~3x slower in all
    left = ((values >> eight) & byte).astype(np.uint8)
    right = (values & byte).astype(np.uint8)
    for k1, k2 in zip(keys[0::2], keys[1::2], strict=True):
        left ^= f(right) ^ np.uint8(k1 & 0xFF)
        right ^= f(left) ^ np.uint8(k2 & 0xFF)
    return (left.astype(np.uint64) << eight) | right
