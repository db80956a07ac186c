"""Measured step time of each gradient reduction between emulated hosts joined by a
shaped link, beside what the communication model predicts for that link.

    sudo python -m jdp.bench network   # 2 hosts x 4 CPU devices, links of 1000 and 200 Mbit/s
    sudo python -m jdp.bench network --rates_mbit=200 --modes=flat,int8

Each link speed is one job of 2 processes, each in its own emulated host
(launch/netns.py: network namespaces, the link shaped by a token bucket in each
direction). Each process runs the train step of every reduction (flat, two-level,
two-level with bfloat16 or int8 across hosts, ZeRO-1 and FSDP over every device, the
host modes) on a wide MLP whose gradients are most of the step's work: a few steps to
warm up, then `--steps` steps, each waited for, and their median time; and reads its
host's interface counters around them: the bytes that crossed the link per step (what
the host sent; loopback, inside the host, separately).

The model: the collectives of the same step as XLA compiles it here for 8 CPU devices in
2 virtual hosts (`communication.step_traffic`), each at its kind's bandwidth inside a
host and the link's rate (less the TCP/IP and Ethernet headers) across, one after
another. The bandwidths inside a host are measured, not assumed: between processes
XLA:CPU runs every collective over gloo's TCP, inside a host too (through loopback, at
a few hundred MiB/s, where NVLink moves hundreds of GB/s). So a first job, on an
unshaped link, times one collective of each kind inside a host and one across hosts,
and the rest of each step (its compute) is what that job's step time leaves after its
modelled communication. A ring's hops inside and across hosts overlap; gloo's
reduce-scatter (halving-doubling) does its in-host exchanges first, then the
cross-host ones. Where the modelled speed-up over flat is more than 25% off the
measured one, the line ends its figure with `!`. Beside it, the speed-up the link alone
gives, in-host collectives free: what `bench communication` models for accelerators.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from jdp.dryrun import hlo

MIB = 2**20
# What a TCP segment of a full 1500-byte packet carries (1448 of the 1514 bytes on the
# wire, with timestamps): the link's rate in payload.
PAYLOAD_PER_FRAME = 1448 / 1514
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_NETNS = os.path.join(_REPO, "launch", "netns.py")
_LINE = "network-job: "  # each job process's result lines start with this
# In-host collectives at no cost: the communication model as `bench communication` uses
# it for accelerators, whose in-host links are 10-100x faster than the network.
_FREE_IN_HOST = dict.fromkeys(hlo.KINDS, math.inf)


def add_arguments(parser, name: str) -> None:
    from jdp.bench.communication import REDUCTIONS

    parser.add_argument("--rates_mbit", type=_rates, default="1000,200",
                        help="link speeds in Mbit/s, comma-separated (a phase on an unshaped "
                             "link runs first: the model's calibration)")
    parser.add_argument("--modes", type=_modes, default=",".join(REDUCTIONS),
                        help=f"reductions to measure, flat first: {', '.join(REDUCTIONS)}")
    parser.add_argument("--silence_limit_s", type=float, default=900,
                        help="give up when the job has measured nothing for this long "
                             "(compiling every mode's step comes first)")
    _add_model_arguments(parser)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(rate) for rate in text.split(",")]
    except ValueError:
        rates = []
    if not rates or any(rate <= 0 for rate in rates):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of link speeds. Fix: pass positive Mbit/s separated by "
            "commas, e.g. 1000,200 (a phase on an unshaped link always runs first)")
    return rates


def _modes(text: str) -> list[str]:
    from jdp.bench.communication import REDUCTIONS

    modes = text.split(",")
    unknown = [mode for mode in modes if mode not in REDUCTIONS]
    if unknown or modes[0] != "flat":
        what = f"unknown {', '.join(unknown)}" if unknown else "flat is not first"
        raise argparse.ArgumentTypeError(
            f"{text!r}: {what}. Fix: start with flat (the speed-ups' base), then any of "
            f"{', '.join(REDUCTIONS)}")
    return modes


def _add_model_arguments(parser) -> None:
    parser.add_argument("--width", type=int, default=2048, help="the MLP's hidden width")
    parser.add_argument("--depth", type=int, default=2, help="the MLP's hidden layers")
    parser.add_argument("--features", type=int, default=768, help="input features")
    parser.add_argument("--batch_size", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps per reduction, per repeat")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds over every reduction per link speed (interleaved: a "
                             "change of the machine's load reaches every reduction alike)")
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


class _Timed:
    """Something the job times, prepared once: a reduction's compiled step with its state
    and batch, or one calibration collective."""

    def __init__(self, name: str, run, steps: int):
        self.name, self._run, self._steps = name, run, steps

    def measure(self) -> dict:
        """The median of `steps` runs, each waited for, and the interface bytes per run."""
        before = _interface_bytes()
        times = []
        for _ in range(self._steps):
            start = time.perf_counter()
            self._run()
            times.append(time.perf_counter() - start)
        after = _interface_bytes()
        sent, received, loopback = ((b - a) / self._steps for a, b in zip(before, after,
                                                                           strict=True))
        return {"name": self.name, "seconds": statistics.median(times), "sent": sent,
                "received": received, "loopback": loopback}


def _train_step(mode: str, args) -> _Timed:
    """Mode `mode`'s train step on the job's mesh (one host per process), compiled with
    jdp's XLA options and warmed up."""
    import jax

    from jdp.bench.communication import REDUCTIONS
    from jdp.experiment.task import classification
    from jdp.parallel import StepOptions, compiler_options, make_backend
    from jdp.parallel.mesh import make_mesh

    fields = REDUCTIONS[mode]
    options = StepOptions(**fields, compiler_options=compiler_options(
        "cpu", "none", fields.get("shard_params", False)))
    backend = make_backend("pjit", make_mesh(), _mlp(args.width, args.depth),
                           classification(), _optimizer(), options)
    example = _example(args.features)
    held = [backend.from_global(backend.init_global(jax.random.key(0),
                                                    (example["image"][None],)))]
    rows = args.batch_size // jax.process_count()
    rng = np.random.default_rng(jax.process_index())
    batch = backend.put_batch({
        "image": rng.normal(size=(rows, args.features)).astype(np.float32),
        "label": rng.integers(0, 10, size=(rows,)).astype(np.int32)})
    step = backend.compiled_train_step(held[0], batch)

    def run() -> None:
        held[0], metrics = step(held[0], batch)  # the state is donated: keep the new one
        jax.block_until_ready((held[0], metrics))

    for _ in range(args.warmup):
        run()
    return _Timed(mode, run, args.steps)


def _calibration(floats: int, steps: int) -> list[tuple[_Timed, dict]]:
    """One collective of each kind inside a host, and an all-reduce across hosts, of
    `floats` float32 per device (the all-gather's result; the cross-host all-reduce's a
    host's share, 1/L of it), compiled and warmed up, with the bytes the model gives
    each (jdp's reading of its compiled program)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jdp import DATA_AXIS, HOSTS_AXIS, LOCAL_AXIS
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
    timed = []
    for kind, op in ops.items():
        compiled = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=spec, out_specs=spec,
                                         check_vma=False)).lower(values).compile()
        traffic = [c.traffic(mesh_lib.host_of(mesh))
                   for c in hlo.collectives(compiled.as_text())]

        def run(compiled=compiled) -> None:
            jax.block_until_ready(compiled(values))

        run()
        timed.append((_Timed(kind, run, steps),
                      {"intra": sum(t.intra_device_bytes for t in traffic),
                       "cross": sum(t.cross_host_bytes for t in traffic)}))
    return timed


def job_main(argv: list[str]) -> None:
    """One process of the job: joins it (JDP_* variables), prepares every mode's step and
    the calibration's collectives, then for each phase (a link speed the benchmark sets)
    waits for the file `<phase_dir>/<phase>` and measures them all `--repeats` times,
    interleaved; prints one `network-job: {json}` line per figure, and one per phase
    done."""
    parser = argparse.ArgumentParser(prog="python -m jdp.bench.network")
    parser.add_argument("--modes", type=_modes, required=True)
    parser.add_argument("--phases", type=int, required=True)
    parser.add_argument("--phase_dir", required=True)
    _add_model_arguments(parser)
    args = parser.parse_args(argv)
    import jax

    from jdp.runtime import distributed

    distributed.initialize(None, None, None, timeout_s=120)
    me = jax.process_index()
    steps = [_train_step(mode, args) for mode in args.modes]
    calibration = _calibration(_param_count(args), args.steps)
    for phase in range(args.phases):
        while not os.path.exists(os.path.join(args.phase_dir, str(phase))):
            time.sleep(0.1)
        for repeat in range(args.repeats):
            for timed, traffic in calibration:
                print(_LINE + json.dumps({"phase": phase, "repeat": repeat, "process": me,
                                          "calibration": True, **timed.measure(), **traffic}),
                      flush=True)
            for timed in steps:
                print(_LINE + json.dumps({"phase": phase, "repeat": repeat, "process": me,
                                          **timed.measure()}), flush=True)
        print(_LINE + json.dumps({"phase": phase, "process": me, "done": True}), flush=True)


def _param_count(args) -> int:
    import jax

    from jdp.parallel.two_level import param_count

    model, example = _mlp(args.width, args.depth), _example(args.features)
    params, _ = jax.eval_shape(model.init, jax.random.key(0), (example["image"][None],))
    return param_count(params)


# -- the benchmark: one job through every link speed, the model beside ---------------------

def _load_netns():
    """launch/netns.py (a script of the checkout, not a module of the package)."""
    spec = importlib.util.spec_from_file_location("jdp_launch_netns", _NETNS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Phase:
    """The figures at one link speed, each the median over the repeats of the slower
    process's seconds and the busier host's bytes: per mode (`steps`), and per
    collective of the calibration with the bytes the model gives it."""

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


def _phase(rows: list[dict], phase: int) -> Phase:
    """Phase `phase`'s figures from the job's rows (each process's, each repeat's)."""
    of_phase = [row for row in rows if row.get("phase") == phase and "name" in row]
    out: dict[bool, dict[str, dict[str, float]]] = {True: {}, False: {}}
    for calibration in (True, False):
        mine = [row for row in of_phase if row.get("calibration", False) == calibration]
        for name in dict.fromkeys(row["name"] for row in mine):
            repeats = collections.defaultdict(list)  # repeat -> both processes' rows
            for row in mine:
                if row["name"] == name:
                    repeats[row["repeat"]].append(row)
            out[calibration][name] = {
                field: statistics.median(max(row[field] for row in both)
                                         for both in repeats.values())
                for field in ("seconds", "sent", "loopback", "intra", "cross")
                if field in mine[0]}
    return Phase(out[False], out[True])


def _stop(proc: subprocess.Popen, netns) -> None:
    """Stops the launcher: its first SIGTERM is forwarded to the job (a stop notice, which
    a job stuck in a collective does not act on), its second kills the job's processes,
    after which it deletes its testbed; SIGKILL if it is still there, and then the
    testbed of the dead launcher is deleted here."""
    for _ in range(2):
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()
    netns.remove_leftovers()


def _run_job(rates: list[float], args) -> list[Phase]:
    """One job on 2 emulated hosts, measuring at each of `rates` (Mbit/s; 0: unshaped)
    in turn: the link is set, then the job is told to go on (a file per phase)."""
    netns = _load_netns()
    with tempfile.TemporaryDirectory(prefix="jdp-bench-network-") as phase_dir:
        command = [sys.executable, _NETNS, "--num_processes=2", "--devices_per_process=4",
                   "--", sys.executable, "-m", "jdp.bench.network",
                   f"--modes={','.join(args.modes)}",
                   f"--phases={len(rates)}", f"--phase_dir={phase_dir}",
                   *(f"--{name}={getattr(args, name)}" for name in
                     ("width", "depth", "features", "batch_size", "steps", "repeats",
                      "warmup"))]
        proc = subprocess.Popen(command, cwd=_REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        rows: list[dict] = []
        errors: list[str] = []
        readers = [threading.Thread(target=lambda: rows.extend(
                       json.loads(line.split(_LINE, 1)[1]) for line in proc.stdout
                       if _LINE in line), daemon=True),
                   threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)]
        for reader in readers:
            reader.start()

        heard = [0, time.monotonic()]  # rows seen, when the last one came

        def wait_for(condition, what: str) -> None:
            while not condition():
                if len(rows) != heard[0]:
                    heard[:] = [len(rows), time.monotonic()]
                if proc.poll() is not None:
                    for reader in readers:
                        reader.join(timeout=10)
                    raise SystemExit(f"network: the job ended (status {proc.returncode}) "
                                     f"before {what}:\n{''.join(errors)[-4000:]}")
                if time.monotonic() - heard[1] > args.silence_limit_s:
                    _stop(proc, netns)
                    raise SystemExit(
                        f"network: the job measured nothing for {args.silence_limit_s:g} s "
                        f"before {what} (a collective that never completes?); killed. "
                        f"Its last output:\n{''.join(errors)[-4000:]}")
                time.sleep(0.1)

        bed = netns.Testbed(2, owner=proc.pid)
        try:
            wait_for(lambda: set(bed.namespaces()) <= set(netns.existing_namespaces()),
                     "its testbed was made")
            for phase, rate in enumerate(rates):
                bed.set_rate(rate or None)
                open(os.path.join(phase_dir, str(phase)), "w").close()
                wait_for(lambda phase=phase: sum(row.get("phase") == phase and "done" in row
                                                 for row in rows) == 2,
                         f"it measured at {rate:g} Mbit/s")
            proc.wait()
            for reader in readers:
                reader.join(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    return [_phase(rows, phase) for phase in range(len(rates))]


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
            for mode in args.modes}


def _communication_s(traffic: list, intra: dict[str, float], cross: float) -> float:
    """The model's communication time of a step: the collectives one after another, each
    at its kind's in-host bandwidth and the link's. A ring's hops inside and across
    hosts overlap (the slower sets the time); gloo's reduce-scatter (halving-doubling)
    exchanges with the near devices first, then the far ones: a reduce-scatter over
    several hosts takes its in-host time, then its cross-host time."""
    def inside(t) -> float:  # a kind not calibrated goes at the slowest one's bandwidth
        if not t.intra_device_bytes:
            return 0.0
        return t.intra_device_bytes / (intra.get(t.kind) or min(intra.values()))

    return sum(inside(t) + t.cross_host_bytes / cross if t.kind == "reduce-scatter"
               else max(inside(t), t.cross_host_bytes / cross) for t in traffic)


def run(args) -> None:
    reason = _load_netns().unavailable_reason()
    if reason is not None:
        raise SystemExit(f"network: {reason}")
    modes, rates = args.modes, args.rates_mbit
    modelled = _modelled(args)
    print(f"2 hosts x 4 CPU devices; MLP {args.depth} x {args.width} on {args.features} "
          f"features ({_param_count(args) * 4 / MIB:.1f} MiB of gradients), global batch "
          f"{args.batch_size}; {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}",
          flush=True)
    base, *shaped = _run_job([0.0, *rates], args)
    # The unshaped phase calibrates the model: the in-host bandwidth of each kind of
    # collective, and the rest of each step (its compute).
    intra, open_link = base.intra_bytes_per_s(), base.cross_bytes_per_s()
    print("unshaped: in-host bandwidth per device " + ", ".join(
        f"{kind} {value / MIB:.0f} MiB/s" for kind, value in intra.items())
        + f"; across hosts {open_link * 8 / 1e6:.0f} Mbit/s; step " + ", ".join(
        f"{mode} {base.steps[mode]['seconds'] * 1e3:.0f} ms" for mode in modes), flush=True)
    rest = {mode: max(base.steps[mode]["seconds"]
                      - _communication_s(modelled[mode], intra, open_link), 0.0)
            for mode in modes}
    summary = []
    for rate, phase in zip(rates, shaped, strict=True):
        link = rate * 1e6 / 8 * PAYLOAD_PER_FRAME
        print(f"{rate:g} Mbit/s: gloo measured {phase.cross_bytes_per_s() * 8 / 1e6:.0f} "
              f"Mbit/s across hosts, the model {link * 8 / 1e6:.0f}", flush=True)
        predicted = {mode: rest[mode] + _communication_s(modelled[mode], intra, link)
                     for mode in modes}
        link_only = {mode: _communication_s(modelled[mode], _FREE_IN_HOST, link)
                     for mode in modes}
        measured = {mode: phase.steps[mode]["seconds"] for mode in modes}
        for mode in modes:
            cross = sum(t.cross_host_bytes for t in modelled[mode]) / MIB
            speedup = measured["flat"] / measured[mode]
            modelled_speedup = predicted["flat"] / predicted[mode]
            off = modelled_speedup / speedup - 1
            print(f"{rate:6g} Mbit/s {mode:14s} step {measured[mode] * 1e3:7.0f} ms, modelled "
                  f"{predicted[mode] * 1e3:7.0f}; over flat: measured {speedup:5.2f}x, "
                  f"modelled {modelled_speedup:5.2f}x ({off:+4.0%}{' !' if abs(off) > 0.25 else ''}"
                  f"; link alone {link_only['flat'] / link_only[mode]:5.2f}x); link "
                  f"{phase.steps[mode]['sent'] / MIB:6.2f} MiB/step (modelled {cross:6.2f}), "
                  f"loopback {phase.steps[mode]['loopback'] / MIB:6.1f}", flush=True)
        summary.append(f"{rate:g} Mbit/s " + ", ".join(
            f"{mode} {measured['flat'] / measured[mode]:.2f}x" for mode in modes[1:]))
    print("network: measured speed-up over flat: " + "; ".join(summary))


if __name__ == "__main__":
    job_main(sys.argv[1:])
