"""Measured step time of each gradient reduction between emulated hosts joined by a
shaped link, beside what the communication model predicts for that link.

    sudo python -m jdp.bench network   # 2 hosts x 4 CPU devices, links of 1000 and 200 Mbit/s
    sudo python -m jdp.bench network --rates_mbit=200 --modes=flat,int8

Each link speed is one job of 2 processes, each in its own emulated host
(launch/netns.py: network namespaces, the link shaped by a token bucket in each
direction). Each process runs the train step of every reduction (flat, two-level,
two-level with bfloat16 or int8 across hosts, ZeRO-1 and FSDP over every device, the
host modes) on a wide MLP whose gradient crossing the link dominates the step: a few
steps to warm up, then `--steps` steps, each waited for, and their median time; and
reads its host's interface counters around them: the bytes that crossed the link per
step (what the host sent; loopback, inside the host, separately).

The model (`jdp.bench.communication`): the same step's collectives as XLA compiles them
here for 8 CPU devices split into 2 virtual hosts, each collective at the link's rate
across hosts (less the TCP/IP and Ethernet headers) and `--loopback_gb_s` inside a host,
one after another; the rest of the step, measured without any link (`--rates_mbit`
includes 0: unshaped), is added to every reduction's time. The speed-up over flat,
measured and modelled, is printed per reduction and link; the model also predicts the
bytes per step the counters show.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

MIB = 2**20
# What a TCP segment of a full 1500-byte packet carries (1448 of the 1514 bytes on the
# wire, with timestamps): the link's rate in payload.
PAYLOAD_PER_FRAME = 1448 / 1514
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_NETNS = os.path.join(_REPO, "launch", "netns.py")
_LINE = "network-job: "  # each job process's result lines start with this
# In-host collectives at no cost: the communication model as `bench communication` uses
# it for accelerators, whose in-host links are 10-100x faster than the network.
_FREE_IN_HOST = collections.defaultdict(lambda: math.inf)


def add_arguments(parser, name: str) -> None:
    from jdp.bench.communication import REDUCTIONS

    parser.add_argument("--rates_mbit", default="1000,200",
                        help="link speeds in Mbit/s, comma-separated (0: unshaped)")
    parser.add_argument("--modes", default=",".join(REDUCTIONS),
                        help=f"reductions to measure, of {', '.join(REDUCTIONS)}")
    _add_model_arguments(parser)
    parser.add_argument("--loopback_gb_s", type=float, default=1.0,
                        help="the model's bandwidth of one device inside a host, GB/s (gloo "
                             "over loopback TCP on this machine)")


def _add_model_arguments(parser) -> None:
    parser.add_argument("--width", type=int, default=2048, help="the MLP's hidden width")
    parser.add_argument("--depth", type=int, default=2, help="the MLP's hidden layers")
    parser.add_argument("--features", type=int, default=768, help="input features")
    parser.add_argument("--batch_size", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per reduction")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing")


# -- the model and its step (in each job process, and in the modelling) -----------------

def _mlp(width: int, depth: int, num_classes: int = 10):
    import flax.linen as nn

    from jdp.experiment import adapters

    class WideMlp(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            del train
            x = x.reshape(x.shape[0], -1)
            for _ in range(depth):
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(num_classes)(x)

    return adapters.from_linen(WideMlp())


def _optimizer():
    import optax

    # Momentum SGD: one state tensor, so that ZeRO-1 has a state to split while the
    # update stays a small part of the step.
    return optax.sgd(1e-3, momentum=0.9)


def _example(features: int) -> dict[str, np.ndarray]:
    return {"image": np.zeros((features,), np.float32), "label": np.zeros((), np.int32)}


# -- one process of the job: measures every reduction -------------------------------------

def _interface_bytes() -> tuple[int, int, int]:
    """(sent over the link, received over it, sent over loopback) by this host's
    interfaces, from this network namespace's sysfs."""
    def counter(device: str, name: str) -> int:
        with open(f"/sys/class/net/{device}/statistics/{name}") as f:
            return int(f.read())

    links = [d for d in os.listdir("/sys/class/net") if d != "lo"]
    return (sum(counter(d, "tx_bytes") for d in links),
            sum(counter(d, "rx_bytes") for d in links), counter("lo", "tx_bytes"))


def _measure(mode: str, args) -> dict:
    import jax
    import optax  # noqa: F401  (the optimizer's import, before timing)

    from jdp.bench.communication import REDUCTIONS
    from jdp.experiment.task import classification
    from jdp.parallel import StepOptions, compiler_options, make_backend
    from jdp.parallel.mesh import make_mesh

    fields = REDUCTIONS[mode]
    options = StepOptions(**fields, compiler_options=compiler_options(
        "cpu", "none", fields.get("shard_params", False)))
    mesh = make_mesh()  # one host per process
    backend = make_backend("pjit", mesh, _mlp(args.width, args.depth), classification(),
                           _optimizer(), options)
    example = _example(args.features)
    state = backend.from_global(backend.init_global(jax.random.key(0),
                                                    (example["image"][None],)))
    rows = args.batch_size // jax.process_count()
    rng = np.random.default_rng(jax.process_index())
    batch = backend.put_batch({
        "image": rng.normal(size=(rows, args.features)).astype(np.float32),
        "label": rng.integers(0, 10, size=(rows,)).astype(np.int32)})
    step = backend.compiled_train_step(state, batch)
    for _ in range(args.warmup):
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
    before = _interface_bytes()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    after = _interface_bytes()
    sent, received, loopback = ((b - a) / args.steps for a, b in zip(before, after,
                                                                       strict=True))
    return {"process": jax.process_index(), "mode": mode, "step_s": statistics.median(times),
            "sent": sent, "received": received, "loopback": loopback}


def _calibration(floats: int, repeats: int = 3) -> list[dict]:
    """The seconds of one collective of each kind inside a host, and of an all-reduce
    across hosts, of `floats` float32 per device (the all-gather's result, the cross-host
    all-reduce's a host's share: 1/L of it), with the traffic the model gives each (jdp's
    reading of its compiled program)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jdp import DATA_AXIS, HOSTS_AXIS, LOCAL_AXIS
    from jdp.dryrun import hlo
    from jdp.parallel import mesh as mesh_lib

    mesh = mesh_lib.make_mesh()
    local = mesh.shape[LOCAL_AXIS]
    floats -= floats % (local * local)
    spec = P(DATA_AXIS)
    values = jax.make_array_from_callback((mesh.size * floats,), NamedSharding(mesh, spec),
                                          lambda index: np.ones(floats, np.float32))
    part = floats // local
    ops = {"all-reduce": lambda v: jax.lax.psum(v, LOCAL_AXIS),
           "reduce-scatter": lambda v: jax.lax.psum_scatter(v, LOCAL_AXIS, tiled=True),
           "all-gather": lambda v: jax.lax.all_gather(v[:part], LOCAL_AXIS, tiled=True),
           "all-to-all": lambda v: jax.lax.all_to_all(v, LOCAL_AXIS, 0, 0, tiled=True),
           "across hosts": lambda v: jax.lax.psum(v[:part], HOSTS_AXIS)}
    rows = []
    for kind, op in ops.items():
        step = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=spec, out_specs=spec,
                                     check_vma=False)).lower(values).compile()
        traffic = [c.traffic(mesh_lib.host_of(mesh)) for c in hlo.collectives(step.as_text())]
        jax.block_until_ready(step(values))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(values))
            times.append(time.perf_counter() - start)
        rows.append({"calibration": kind, "seconds": statistics.median(times),
                     "intra": sum(t.intra_device_bytes for t in traffic),
                     "cross": sum(t.cross_host_bytes for t in traffic)})
    return rows


def job_main(argv: list[str]) -> None:
    """One process of the job: joins it (JDP_* variables), times the collectives of the
    model's calibration, then measures each mode; prints one `network-job: {json}` line
    per figure."""
    parser = argparse.ArgumentParser(prog="python -m jdp.bench.network")
    parser.add_argument("--modes", required=True)
    _add_model_arguments(parser)
    args = parser.parse_args(argv)
    import jax

    from jdp.runtime import distributed

    distributed.initialize(None, None, None, timeout_s=120)
    floats = _param_count(args)
    for row in _calibration(floats):
        print(_LINE + json.dumps({**row, "process": jax.process_index()}), flush=True)
    for mode in args.modes.split(","):
        print(_LINE + json.dumps(_measure(mode, args)), flush=True)


def _param_count(args) -> int:
    import jax

    from jdp.parallel.two_level import param_count

    model, example = _mlp(args.width, args.depth), _example(args.features)
    params, _ = jax.eval_shape(model.init, jax.random.key(0), (example["image"][None],))
    return param_count(params)


# -- the benchmark: a job per link speed, the model beside ----------------------------------

def _load_netns():
    """launch/netns.py (a script of the checkout, not a module of the package)."""
    spec = importlib.util.spec_from_file_location("jdp_launch_netns", _NETNS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Job:
    """One job's figures: per mode the slower process's step time and the busier host's
    bytes per step; per calibration kind its seconds and modelled bytes."""

    steps: dict[str, dict[str, float]]
    calibration: dict[str, dict[str, float]]

    def intra_bytes_per_s(self) -> dict[str, float]:
        """Per collective kind: a device's in-host bytes per second."""
        return {kind: row["intra"] / row["seconds"] for kind, row in self.calibration.items()
                if row["intra"]}

    def cross_bytes_per_s(self) -> float:
        """A host's bytes per second across hosts, in the cross-host all-reduce."""
        row = self.calibration["across hosts"]
        return row["cross"] / row["seconds"]


def _run_job(rate_mbit: float, args) -> Job:
    """The job at `rate_mbit` (0: unshaped link)."""
    rate = [f"--rate_mbit={rate_mbit:g}"] if rate_mbit else []
    command = [sys.executable, _NETNS, *rate, "--num_processes=2", "--devices_per_process=4",
               "--", sys.executable, "-m", "jdp.bench.network", f"--modes={args.modes}",
               *(f"--{name}={getattr(args, name)}" for name in
                 ("width", "depth", "features", "batch_size", "steps", "warmup"))]
    proc = subprocess.run(command, cwd=_REPO, capture_output=True, text=True)
    rows = [json.loads(line.split(_LINE, 1)[1]) for line in proc.stdout.splitlines()
            if _LINE in line]
    if proc.returncode or not rows:
        raise SystemExit(f"network: the job at {rate_mbit:g} Mbit/s failed (status "
                         f"{proc.returncode}):\n{proc.stderr[-4000:]}")

    def slowest(key: str, name: str) -> dict[str, float]:
        of_name = [row for row in rows if row.get(key) == name]
        return {field: max(row[field] for row in of_name) for field in of_name[0]
                if field not in (key, "process")}

    return Job({mode: slowest("mode", mode) for mode in args.modes.split(",")},
               {kind: slowest("calibration", kind) for kind in
                {row["calibration"] for row in rows if "calibration" in row}})


def _modelled(args) -> dict[str, list]:
    """mode -> the traffic of each collective of its step as compiled here for 8 CPU
    devices in 2 virtual hosts (what the job's processes run)."""
    import jax

    from jdp.bench.communication import step_traffic

    if jax.device_count() != 8:
        raise SystemExit(f"network: the model reads the step for 8 CPU devices, this process "
                         f"has {jax.device_count()}; run with XLA_FLAGS="
                         "--xla_force_host_platform_device_count=8")
    model, example = _mlp(args.width, args.depth), _example(args.features)
    return {mode: step_traffic(model, example, 2, mode, tx=_optimizer(), as_run_here=True)[0]
            for mode in args.modes.split(",")}


def _communication_s(traffic: list, intra: dict[str, float], cross: float) -> float:
    """The model's communication time of a step: each collective at its kind's in-host
    bandwidth and the link's, one after another."""
    return sum(max(t.intra_device_bytes / intra[t.kind] if t.intra_device_bytes else 0.0,
                   t.cross_host_bytes / cross) for t in traffic)


def run(args) -> None:
    reason = _load_netns().unavailable_reason()
    if reason is not None:
        raise SystemExit(f"network: {reason}")
    modes = args.modes.split(",")
    if modes[0] != "flat":
        raise SystemExit("network: --modes must start with flat (the speed-ups' base)")
    rates = [float(rate) for rate in args.rates_mbit.split(",") if float(rate) > 0]
    modelled = _modelled(args)
    print(f"2 hosts x 4 CPU devices; MLP {args.depth} x {args.width} on {args.features} "
          f"features ({_param_count(args) * 4 / MIB:.1f} MiB of gradients), global batch "
          f"{args.batch_size}, {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}",
          flush=True)
    # The unshaped job calibrates the model: the in-host bandwidth of each kind of
    # collective, and the rest of each step (its compute).
    base = _run_job(0, args)
    intra, open_link = base.intra_bytes_per_s(), base.cross_bytes_per_s()
    print("in-host, per device: " + ", ".join(f"{kind} {value / MIB:.0f} MiB/s"
                                              for kind, value in intra.items())
          + f"; unshaped link {open_link * 8 / 1e6:.0f} Mbit/s", flush=True)
    rest = {mode: max(base.steps[mode]["step_s"]
                      - _communication_s(modelled[mode], intra, open_link), 0.0)
            for mode in modes}
    summary = []
    for rate in rates:
        job = _run_job(rate, args)
        link = rate * 1e6 / 8 * PAYLOAD_PER_FRAME
        print(f"{rate:g} Mbit/s link: gloo measured {job.cross_bytes_per_s() * 8 / 1e6:.0f} "
              f"Mbit/s across hosts, the model {link * 8 / 1e6:.0f}", flush=True)
        predicted = {mode: rest[mode] + _communication_s(modelled[mode], intra, link)
                     for mode in modes}
        # The communication model alone, in-host collectives free: `bench communication`.
        link_only = {mode: _communication_s(modelled[mode], _FREE_IN_HOST, link) for mode in modes}
        measured = {mode: job.steps[mode]["step_s"] for mode in modes}
        for mode in modes:
            cross = sum(t.cross_host_bytes for t in modelled[mode]) / MIB
            print(f"{rate:6g} Mbit/s {mode:14s} step {measured[mode] * 1e3:7.0f} ms, modelled "
                  f"{predicted[mode] * 1e3:7.0f}; over flat: measured "
                  f"{measured['flat'] / measured[mode]:5.2f}x, modelled "
                  f"{predicted['flat'] / predicted[mode]:5.2f}x (link alone "
                  f"{link_only['flat'] / link_only[mode]:5.2f}x); link "
                  f"{job.steps[mode]['sent'] / MIB:6.2f} MiB/step (modelled {cross:6.2f}), "
                  f"loopback {job.steps[mode]['loopback'] / MIB:6.1f}", flush=True)
        summary.append(f"{rate:g} Mbit/s " + ", ".join(
            f"{mode} {measured['flat'] / measured[mode]:.2f}x" for mode in modes[1:]))
    print("network: measured speed-up over flat: " + "; ".join(summary))


if __name__ == "__main__":
    job_main(sys.argv[1:])
