"""Evaluation: the task's loss and metrics over a whole split, each example once."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from jdp.data.splits import EvalSplit
from jdp.parallel.backends import Backend

# The running totals plus one batch's sums, as one program (an add per metric was one
# dispatch each, per batch).
_add = jax.jit(lambda totals, sums: jax.tree.map(jnp.add, totals, sums))


def evaluate(backend: Backend, state, split: EvalSplit, *, global_batch_size: int,
             rows: slice, heartbeat=lambda: None) -> dict[str, float]:
    """`eval/<name>` = sum(value * weight) / sum(weight) over the whole split (padding
    masked out), and `eval/num_examples`."""
    totals = None
    batches = split.batches(global_batch_size=global_batch_size, rows=rows)
    with contextlib.closing(batches):  # its workers stop also when the loop is left early
        for local_batch in batches:
            heartbeat()
            sums = backend.eval_step(state, backend.put_batch(local_batch))
            # At most one batch in flight behind this one, as in the train loop. Unbounded,
            # the host queued ~70 programs per device (an eval step and an add per metric,
            # per batch), and a 2-process CPU job on a loaded machine deadlocked: one
            # device's launch of the eval step waited for a slot in the runtime's bounded
            # per-device queue while the other seven devices waited for it in the step's
            # all-reduce.
            if totals is not None:
                jax.block_until_ready(totals)
            totals = sums if totals is None else _add(totals, sums)
    sums, count = backend.fetch(totals)
    means = {name: float(total) / float(weight) if weight else 0.0
             for name, (total, weight) in sums.items()}
    if backend.task.derived is not None:
        means.update(backend.task.derived(means))
    return {**{f"eval/{name}": value for name, value in means.items()},
            "eval/num_examples": float(count)}
