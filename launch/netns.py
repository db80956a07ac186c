"""Emulated hosts on one machine: network namespaces joined by a shaped link, for the
tests and benchmarks of what loopback cannot show (a slow or a broken link between hosts).

    sudo python launch/netns.py --num_processes=2 --devices_per_process=4 --rate_mbit=200 \\
        -- python -m jdp.main --config=experiments/vit.py --workdir=runs/vit

runs launch/local.py's job (every option of it applies: --max_restarts, --grace_s, ...)
with process i inside emulated host i, and prints the bytes each host sent and received
over its link. A test tool, not a way to run jobs: it needs root (CAP_NET_ADMIN) and
iproute2 (`ip`, `tc`).

The testbed: one namespace per host (`jdpnet<OWNER>-<i>`), and a switch namespace
(`jdpnet<OWNER>-switch`) holding a bridge with one port per host; host i's interface
`uplink` (address 198.18.0.<i+1>/24) is a veth whose other end is that port. Each end's
egress is shaped by a token bucket (tbf) to --rate_mbit, so every host has a full-duplex
link of that rate to the others, as a host's network card has to a switch. The kernel
here has no netem, so no latency is added (tbf's queue adds a little). Nothing is added
to the machine's own namespace: the only addresses are the hosts' own, in 198.18.0.0/15
(set aside for network benchmarks, RFC 2544), and loopback; nothing leaves the machine.

Inside host i the machine's name resolves to 198.18.0.<i+1> (`/etc/netns/<ns>/hosts`,
which `ip netns exec` puts over /etc/hosts): jax's CPU collectives (gloo) advertise the
address the host's name resolves to, so each process is reached through its link.

Teardown: everything is deleted on exit (a `finally`); a testbed whose owner (OWNER, a
process id) was killed is deleted by the next one made (`remove_leftovers`), and
`python launch/netns.py --cleanup` deletes those at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence

from jdp.runtime.leftovers import alive

PREFIX = "jdpnet"
# Host i is 198.18.0.<i + 1>; the /24 bounds a testbed to 254 hosts.
SUBNET = "198.18.0"
MAX_HOSTS = 254
LINK = "uplink"  # each host's interface to the others
BRIDGE = "bridge"
# Names this module makes: jdpnet<OWNER>-<host index> | -switch | -probe.
_NAME = re.compile(rf"{PREFIX}(\d+)-(?:\d+|switch|probe)")
NETNS_ETC = "/etc/netns"
_IP_TIMEOUT_S = 30


class TestbedError(RuntimeError):
    """A namespace, link or queue could not be made or changed; the message names the
    command and what it printed."""


def ip(*args: str) -> str:
    """Runs `ip ARGS`, returning what it printed."""
    return _run("ip", *args)


def tc(*args: str) -> str:
    return _run("tc", *args)


def _run(*command: str) -> str:
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TestbedError(f"{' '.join(command)}: {e}") from None
    if proc.returncode:
        raise TestbedError(f"{' '.join(command)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be made here (for a test's skip), or None if they can:
    makes and deletes one namespace."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "emulated hosts need iproute2 (ip, tc)"
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces; CI runs as root)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b")
    except TestbedError as e:
        return f"emulated hosts cannot be made here: {e}"
    finally:
        with contextlib.suppress(TestbedError):
            ip("netns", "del", probe)
    return None


def burst_bytes(rate_mbit: float) -> int:
    """tbf's bucket: 8 ms at the rate, at least 256 KiB. A smaller bucket holds a 1 Gbit/s
    link below its rate (measured: 256 KiB gave 620-660 Mbit/s through a 1000 Mbit/s cap,
    1 MiB 880-980)."""
    return max(256 * 1024, int(rate_mbit * 1e6 / 8 * 0.008))


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """What one host's interface counted: bytes it sent to and received from the others
    (the IP packets and their Ethernet headers)."""

    sent: int
    received: int


@dataclasses.dataclass(frozen=True)
class Testbed:
    """The names and operations of one testbed of `hosts` emulated hosts, made by process
    `owner`. `create` makes it, `remove` deletes it; the other methods act on it as made
    (from any process, e.g. a test cutting the link of a job it started)."""

    hosts: int
    owner: int = dataclasses.field(default_factory=os.getpid)

    def namespace(self, host: int) -> str:
        return f"{PREFIX}{self.owner}-{host}"

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.owner}-switch"

    def namespaces(self) -> list[str]:
        return [*(self.namespace(host) for host in range(self.hosts)), self.switch]

    @staticmethod
    def address(host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host `host`."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def create(self, rate_mbit: float | None) -> None:
        """Makes the hosts, the switch and their links, shaped to `rate_mbit` (None: not
        shaped). Removes what it made if a step fails."""
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"a testbed has 1 to {MAX_HOSTS} hosts, not {self.hosts}")
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "name", BRIDGE, "type", "bridge")
            ip("-n", self.switch, "link", "set", "dev", BRIDGE, "up")
            for host in range(self.hosts):
                self._add_host(host)
            self.set_rate(rate_mbit)
        except BaseException:
            self.remove()
            raise

    def _add_host(self, host: int) -> None:
        namespace, port = self.namespace(host), self._port(host)
        ip("netns", "add", namespace)
        _write_hosts_file(namespace, self.address(host))
        ip("-n", self.switch, "link", "add", "name", port, "type", "veth",
           "peer", "name", LINK, "netns", namespace)
        ip("-n", self.switch, "link", "set", "dev", port, "master", BRIDGE, "up")
        ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", LINK)
        ip("-n", namespace, "link", "set", "dev", LINK, "up")
        ip("-n", namespace, "link", "set", "dev", "lo", "up")

    @staticmethod
    def _port(host: int) -> str:
        return f"port{host}"

    def _ends(self, host: int) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of host `host`'s link: the host's sending
        side, and the switch port's, which sends to the host."""
        return [(self.namespace(host), LINK), (self.switch, self._port(host))]

    def set_rate(self, rate_mbit: float | None) -> None:
        """Shapes every link to `rate_mbit` in each direction (None: unshaped)."""
        for host in range(self.hosts):
            for namespace, device in self._ends(host):
                if rate_mbit is not None:
                    tc("-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf",
                       "rate", f"{rate_mbit:g}mbit", "burst", str(burst_bytes(rate_mbit)),
                       "latency", "50ms")
                elif any(qdisc["kind"] == "tbf" for qdisc in json.loads(
                        tc("-n", namespace, "-j", "qdisc", "show", "dev", device))):
                    tc("-n", namespace, "qdisc", "del", "dev", device, "root")

    def set_link(self, host: int, up: bool) -> None:
        """Cuts (up=False) or restores host `host`'s link, at the switch: the host keeps
        its interface and address, and its packets to the others are lost, as when a
        cable or a switch port fails."""
        ip("-n", self.switch, "link", "set", "dev", self._port(host), "up" if up else "down")

    def link_bytes(self, host: int) -> LinkBytes:
        """The byte counters of host `host`'s interface."""
        (info,) = json.loads(ip("-n", self.namespace(host), "-j", "-s", "link", "show",
                                "dev", LINK))
        stats = info["stats64"]
        return LinkBytes(sent=stats["tx"]["bytes"], received=stats["rx"]["bytes"])

    def remove(self) -> None:
        """Deletes whatever of this testbed exists (safe to call again)."""
        for namespace in self.namespaces():
            _delete_namespace(namespace)


def _write_hosts_file(namespace: str, address: str) -> None:
    """/etc/hosts inside `namespace`: this machine's name is the host's own address."""
    directory = os.path.join(NETNS_ETC, namespace)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")


def _delete_namespace(namespace: str) -> None:
    """Deletes a namespace (its interfaces go with it, a veth's other end too) and its
    /etc/netns files."""
    if namespace in existing_namespaces():
        ip("netns", "del", namespace)
    shutil.rmtree(os.path.join(NETNS_ETC, namespace), ignore_errors=True)


def existing_namespaces() -> list[str]:
    """The names of the network namespaces `ip netns` knows."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def remove_leftovers() -> list[str]:
    """Deletes the namespaces (and /etc/netns files) of testbeds whose owner process is
    gone (killed before its `finally` ran); returns their names. Those of live owners
    are left alone: another test may be using them."""
    named = set(existing_namespaces())
    if os.path.isdir(NETNS_ETC):
        named |= set(os.listdir(NETNS_ETC))
    removed = []
    for name in sorted(named):
        match = _NAME.fullmatch(name)
        if match and not alive(int(match.group(1))):
            _delete_namespace(name)
            removed.append(name)
    return removed


@contextlib.contextmanager
def testbed(hosts: int, rate_mbit: float | None) -> Iterator[Testbed]:
    """A new testbed of this process (leftovers of killed ones removed first), deleted on
    leaving the block, however it is left."""
    remove_leftovers()
    bed = Testbed(hosts)
    bed.create(rate_mbit)
    try:
        yield bed
    finally:
        bed.remove()


def _local_launcher():
    """launch/local.py, beside this file (a script, not a package module)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "local.py")
    spec = importlib.util.spec_from_file_location("jdp_launch_local", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="launch/netns.py", description=__doc__.split("\n\n")[0],
        usage="%(prog)s [--rate_mbit=R] [launch/local.py options] -- command [args...]\n"
              "       %(prog)s --cleanup")
    parser.add_argument("--rate_mbit", type=float, default=None,
                        help="each host's link, Mbit/s in each direction (default: unshaped)")
    parser.add_argument("--cleanup", action="store_true",
                        help="delete the testbeds of owners no longer running, and exit")
    split = argv.index("--") if "--" in argv else len(argv)
    own, rest = parser.parse_known_args(argv[:split])
    if own.cleanup:
        for name in remove_leftovers():
            print(f"launch/netns.py: deleted {name}")
        return 0
    if own.rate_mbit is not None and own.rate_mbit <= 0:
        parser.error(f"--rate_mbit must be positive, got {own.rate_mbit:g}")
    reason = unavailable_reason()
    if reason is not None:
        print(f"launch/netns.py: {reason}", file=sys.stderr)
        return 2
    local = _local_launcher()
    args, command = local.parse_args([*rest, *argv[split:]])
    if args.num_processes > MAX_HOSTS:
        parser.error(f"--num_processes={args.num_processes}: a testbed has at most "
                     f"{MAX_HOSTS} hosts")
    with testbed(args.num_processes, own.rate_mbit) as bed:
        # Process i in host i; process 0 serves the coordinator at host 0's address.
        status = local.launch(args, lambda num_processes: [
            (bed.command(host, command), env)
            for host, env in enumerate(local.job_envs(args, num_processes, bed.address(0)))])
        for host in range(bed.hosts):
            counted = bed.link_bytes(host)
            print(f"launch/netns.py: host {host} ({bed.address(host)}) sent "
                  f"{counted.sent / 2**20:.1f} MiB, received {counted.received / 2**20:.1f} "
                  "MiB over its link", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
