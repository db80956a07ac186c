"""The tuner's search space: the knobs it varies, the candidates they make (each a dict of
`--config.` overrides for every searched key), and the dominance order that lets a
candidate that fits rule out others without compiling them.

The global batch, model, optimizer, data and seed never change. Every knob but two keeps
the float32 trajectory (`model_parallel` too: the same global batch, split over fewer
data-parallel devices, each layer over more model devices); `compute_dtype` and
`cross_host_reduce` change the numerics and are searched only when asked for
(`allow_numerics_change`). Which combinations are legal is what `jdp.config.validate`
says, never a second copy of its rules.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os

from jdp import config as config_lib
from jdp.config.checks import get
from jdp.config.defaults import BACKENDS, COMPUTE_DTYPES, CROSS_HOST_REDUCE_DTYPES, REDUCTIONS
from jdp.errors import ConfigError
from jdp.models.remat import REMAT_BY_STRENGTH

ACCUM, REMAT = "grad_accum_steps", "remat"
MODEL_PARALLEL = "model_parallel"  # searched only for a model whose params name their axes
# `--search` names, in the order the product is formed: remat and accumulation are the
# innermost loops, so that within a group of the other knobs they run weakest first.
PROGRAM_KNOBS = ("backend", MODEL_PARALLEL, "sharding", "reduction", "compute_dtype",
                 "cross_host_reduce", REMAT, ACCUM)
NUMERICS_KNOBS = ("compute_dtype", "cross_host_reduce")
INPUT_KNOB = "input"  # input workers: the same program, so searched on the fastest one only
KNOBS = (*PROGRAM_KNOBS, INPUT_KNOB)
INPUT_KEYS = ("data.num_workers", "data.num_threads")
# (shard_optimizer_state, shard_params): replicated, ZeRO-1, FSDP, and each inside hosts.
_SHARDING = ((False, False), (True, False), (False, True), ("host", False), (False, "host"))


@dataclasses.dataclass(frozen=True)
class Topology:
    device_count: int
    process_count: int
    hosts: int  # groups of devices with a fast interconnect (parallel.hosts, or processes)


@dataclasses.dataclass(frozen=True)
class Candidate:
    index: int  # its row number in the table, from 1
    overrides: dict  # config key -> value, one for every searched key
    numerics_change: bool  # leaves the float32 trajectory (bfloat16, compressed reduction)
    remat_rank: int  # position in REMAT_BY_STRENGTH
    grad_accum_steps: int

    @property
    def group(self) -> tuple:
        """The settings of every knob other than remat and accumulation."""
        return tuple(sorted((k, repr(v)) for k, v in self.overrides.items()
                            if k not in (ACCUM, REMAT)))


def topology(config, device_count: int, process_count: int) -> Topology:
    return Topology(device_count, process_count, config.parallel.hosts or process_count)


def configured(config, overrides: dict):
    """A copy of `config` with `overrides` (dotted keys) applied."""
    result = copy.deepcopy(config)
    result.update_from_flattened_dict(overrides)
    return result


def check_knobs(knobs: tuple[str, ...], allow_numerics_change: bool) -> None:
    """Raises ConfigError for a `--search` name that is unknown or needs numerics changes."""
    for knob in knobs:
        if knob not in KNOBS:
            raise ConfigError(f"--search={','.join(knobs)}: unknown knob {knob!r}. Fix: name "
                              f"some of {', '.join(KNOBS)}.")
        if knob in NUMERICS_KNOBS and not allow_numerics_change:
            raise ConfigError(f"--search={','.join(knobs)}: {knob} changes the numerics (not "
                              "the float32 trajectory). Fix: add --allow_numerics_change, or "
                              f"leave {knob} out.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _base_first(values, base) -> list:
    return [base] + [v for v in values if v != base]


def _knob_options(knob: str, config, topo: Topology) -> list[dict]:
    """Each setting of `knob` as partial overrides, the config's own first (except
    remat and accumulation, which run weakest to strongest)."""
    parallel = config.parallel
    several_hosts = topo.hosts > 1
    if knob == ACCUM:
        split = config_lib.batch_split(config.batch_size, 1, topo.device_count,
                                       topo.process_count)
        return [{ACCUM: d} for d in _divisors(split.per_device_batch_size)]
    if knob == REMAT:
        return [{REMAT: name} for name in REMAT_BY_STRENGTH]
    if knob == "backend":
        return [{"parallel.backend": b} for b in _base_first(BACKENDS, parallel.backend)]
    if knob == MODEL_PARALLEL:  # the model axis stays inside a host
        per_host = topo.device_count // topo.hosts
        return [{"parallel.model_parallel": m}
                for m in _base_first(_divisors(per_host), parallel.model_parallel)]
    if knob == "sharding":
        base = (parallel.shard_optimizer_state, parallel.shard_params)
        return [{"parallel.shard_optimizer_state": o, "parallel.shard_params": p}
                for o, p in _base_first(_SHARDING, base)]
    if knob == "reduction" and several_hosts:
        return [{"parallel.reduction": r} for r in _base_first(REDUCTIONS, parallel.reduction)]
    if knob == "compute_dtype":
        return [{"compute_dtype": d} for d in _base_first(COMPUTE_DTYPES, config.compute_dtype)]
    if knob == "cross_host_reduce" and several_hosts:
        return [{"parallel.cross_host_reduce": d}
                for d in _base_first(CROSS_HOST_REDUCE_DTYPES, parallel.cross_host_reduce)]
    return [{}]  # a knob that means nothing on this topology


def input_options(config) -> list[dict]:
    """Input settings besides the config's own: trainer threads, or worker processes
    (as many as the machine has cores, at most 4)."""
    base = {"data.num_workers": config.data.num_workers,
            "data.num_threads": config.data.num_threads}
    threads = [{"data.num_workers": 0, "data.num_threads": t} for t in (2, 4, 8)]
    workers = [{"data.num_workers": w, "data.num_threads": config.data.num_threads}
               for w in (2, 4) if w <= (os.cpu_count() or 1)]
    return [option for option in threads + workers if option != base]


def _is_legal(config, topo: Topology) -> bool:
    """What validation allows (it also checks that accumulation divides the batch)."""
    try:
        config_lib.validate(config, topo.device_count, topo.process_count)
    except ConfigError:
        return False
    return True


def make_candidates(config, overrides_list: list[dict], topo: Topology) -> list[Candidate]:
    """The legal ones of `overrides_list`, numbered in order, each marked for numerics."""
    candidates = []
    for overrides in overrides_list:
        resolved = configured(config, overrides)
        if not _is_legal(resolved, topo):
            continue
        numerics = any(get(resolved, key) != get(config, key)
                       for key in ("compute_dtype", "parallel.cross_host_reduce"))
        candidates.append(Candidate(len(candidates) + 1, dict(overrides), numerics,
                                    REMAT_BY_STRENGTH.index(resolved.remat),
                                    resolved.grad_accum_steps))
    return candidates


def search_space(config, knobs: tuple[str, ...], topo: Topology,
                 input_searched: bool) -> list[dict]:
    """Every combination of the program knobs in `knobs` (legal or not), in dominance order;
    with `input_searched`, each also names the config's own input settings."""
    options = [_knob_options(knob, config, topo) for knob in PROGRAM_KNOBS if knob in knobs]
    base_input = ({key: get(config, key) for key in INPUT_KEYS} if input_searched else {})
    combined = []
    for parts in itertools.product(*options):
        overrides = {}
        for part in parts:
            overrides.update(part)
        combined.append({**overrides, **base_input})
    return combined


class Dominance:
    """Within a group of the other knobs, a candidate with at least as much remat and at
    least as much accumulation as one that fits is not compiled: it needs no less memory
    and recomputes or loops more, so it cannot be faster. Fed in dominance order (remat
    weakest first, accumulation smallest first), that leaves at each remat level only the
    accumulation steps below the first that fits."""

    def __init__(self):
        self._fitting: dict[tuple, list[Candidate]] = {}

    def dominated_by(self, candidate: Candidate) -> Candidate | None:
        for fit in self._fitting.get(candidate.group, []):
            if (candidate.remat_rank >= fit.remat_rank
                    and candidate.grad_accum_steps >= fit.grad_accum_steps):
                return fit
        return None

    def fits(self, candidate: Candidate) -> None:
        self._fitting.setdefault(candidate.group, []).append(candidate)
