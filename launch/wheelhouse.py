"""A folder of wheels for installing jdp on a machine without network, holding only what
that machine lacks.

On a connected machine:

    python launch/wheelhouse.py --target_python=3.12 --platform=manylinux2014_x86_64 \
        --have=target_freeze.txt --out=wheels            # jdp and what it needs
    python launch/wheelhouse.py ... --out=wheels grain tensorflow-datasets   # named packages

then, on the target (`target_freeze.txt` is its `pip freeze`, or a list of names):

    pip install --no-index --find-links wheels jdp   # or the named packages

`--extras=cuda13` resolves `jdp[cuda13]` instead (install it the same way): a target that
has jax's CUDA wheels keeps them, one that lacks them gets them in the folder.

It resolves the requirements for the target's Python and platform with pip (binary
wheels only; a package published only as a source archive is built here into a wheel,
which works for pure-Python ones), drops every package the target already has at a
version that satisfies all requirements on it, and downloads the rest. A name in
`--have` without a version counts as satisfying any requirement.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The first pip whose `--python-version` also governs the Requires-Python of the packages'
# metadata (24.1 and earlier compare it with the running Python: pypa/pip#12216).
PIP_FOR_OTHER_PYTHONS = Version("24.2")


def read_have(path: str) -> dict[str, str | None]:
    """A `pip freeze` / `pip list` / one-name-a-line file -> {canonical name: version}."""
    have: dict[str, str | None] = {}
    with open(path) as f:
        for raw in f:
            line = raw.split("#", 1)[0].strip()
            if not line or line.startswith("-"):
                continue
            match = re.fullmatch(r"([A-Za-z0-9._-]+)\s*(?:==\s*|\s+)?([0-9][^\s;]*)?", line)
            if match is None:
                raise SystemExit(f"--have={path}: cannot read {line!r}. Fix: one package a "
                                 "line, as `pip freeze` writes (name==version) or a bare name.")
            have[canonicalize_name(match.group(1))] = match.group(2)
    return have


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _target_options(args) -> list[str]:
    options = ["--only-binary=:all:", f"--python-version={args.target_python}",
               "--implementation=cp"]
    for platform in args.platform:
        options.append(f"--platform={platform}")
    return options


def resolve(requirements: list[str], args, find_links: str) -> list[dict]:
    """pip's resolution of `requirements` for the target: the report's install items."""
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "report.json")
        _pip("install", "--quiet", "--dry-run", "--ignore-installed", "--report", report,
             "--target", os.path.join(scratch, "target"), "--find-links", find_links,
             *_target_options(args), *requirements)
        with open(report) as f:
            return json.load(f)["install"]


def build_source_only(requirements: list[str], wheel_dir: str) -> list[str]:
    """Builds wheels for the packages of this machine's resolution that come only as source
    archives (e.g. promise), so that the target's binary-only resolution finds them."""
    with tempfile.TemporaryDirectory() as scratch:
        report = os.path.join(scratch, "report.json")
        _pip("install", "--quiet", "--dry-run", "--ignore-installed", "--report", report,
             *requirements)
        with open(report) as f:
            items = json.load(f)["install"]
    sources = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items
               if not i["download_info"]["url"].endswith(".whl")
               and not i["download_info"]["url"].startswith("file:")]
    if sources:
        _pip("wheel", "--quiet", "--no-deps", "--wheel-dir", wheel_dir, *sources)
    return sources


def _target_environment(args) -> dict[str, str]:
    """Marker values for the target (its Python version; the rest as on Linux x86_64)."""
    env = default_environment()
    env.update(python_version=args.target_python, python_full_version=f"{args.target_python}.0",
               sys_platform="linux", platform_system="Linux", os_name="posix",
               platform_machine="x86_64" if "x86_64" in " ".join(args.platform) else "aarch64",
               implementation_name="cpython", platform_python_implementation="CPython")
    return env


def _requirements_of(items: list[dict], environment: dict[str, str]
                     ) -> dict[str, list[Requirement]]:
    """Each item's canonical name -> the requirements it applies on the target (its
    markers evaluated with the extras asked of it)."""
    extras: dict[str, set[str]] = {}
    for _ in range(2):  # a second pass sees the extras the first found requested
        applied: dict[str, list[Requirement]] = {}
        for item in items:
            name = canonicalize_name(item["metadata"]["name"])
            asked = {"", *extras.get(name, ()), *(item.get("requested_extras") or ())}
            applied[name] = []
            for text in item["metadata"].get("requires_dist") or []:
                requirement = Requirement(text)
                if requirement.marker is None or any(
                        requirement.marker.evaluate({**environment, "extra": extra})
                        for extra in asked):
                    applied[name].append(requirement)
                    extras.setdefault(canonicalize_name(requirement.name), set()).update(
                        requirement.extras)
    return applied


def missing(items: list[dict], requested: list[Requirement], have: dict[str, str | None],
            environment: dict[str, str]) -> tuple[list[dict], list[str]]:
    """(the items the target lacks, notes on what it has at an unfit version).

    A package the target has at a fitting version is left out with everything only it
    needs: the target already holds its dependencies."""
    applied = _requirements_of(items, environment)
    wanted: dict[str, list[Requirement]] = {}
    for requirement in [*requested, *(r for rs in applied.values() for r in rs)]:
        wanted.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    by_name = {canonicalize_name(i["metadata"]["name"]): i for i in items}
    lacking, unfit_notes = set(), {}
    for name, item in by_name.items():
        version = have.get(name, "absent")
        unfit = [str(r.specifier) for r in wanted.get(name, [])
                 if version not in (None, "absent") and r.specifier
                 and not r.specifier.contains(Version(version), prereleases=True)]
        if version == "absent" or unfit:
            lacking.add(name)
        if unfit:
            unfit_notes[name] = (f"{name} {version} is there but {', '.join(unfit)} is "
                                 f"needed: adding {item['metadata']['version']}")
    roots = [name for name, item in by_name.items() if item.get("requested")]
    reached, queue = set(), list(roots)
    while queue:  # what the lacking packages need, from what was asked for
        name = queue.pop()
        if name in reached or name not in by_name:
            continue
        reached.add(name)
        if name in lacking:
            queue += [canonicalize_name(r.name) for r in applied[name]]
    # Only what is added: a requirement of a package the target keeps (the resolution's
    # newer jax wanting its own jaxlib, say) is not the target's.
    added = [name for name in by_name if name in lacking & reached]
    return [by_name[name] for name in added], [unfit_notes[n] for n in added if n in unfit_notes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("requirements", nargs="*",
                        help="what to install on the target (default: jdp, from this checkout)")
    parser.add_argument("--target_python", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="the target's Python, e.g. 3.12 (default: this one's)")
    parser.add_argument("--platform", action="append",
                        help="a wheel platform tag the target accepts; repeat for several "
                        "(default: manylinux2014 and manylinux_2_17 .. 2_28, x86_64)")
    parser.add_argument("--have", help="the target's `pip freeze` (or package names), "
                        "whose packages are left out")
    parser.add_argument("--out", required=True, help="the wheelhouse folder (created)")
    parser.add_argument("--extras", default="",
                        help="jdp's extras to add, comma-separated, e.g. cuda13 (jdp only)")
    args = parser.parse_args(argv)
    if args.extras and args.requirements:
        parser.error(f"--extras={args.extras} applies to jdp, which is built only when no "
                     f"requirements are named (got {' '.join(args.requirements)}). Fix: drop "
                     "one of them.")
    # pip matches platform tags exactly: list every manylinux a glibc 2.28 host runs.
    args.platform = args.platform or ["manylinux2014_x86_64", *(
        f"manylinux_2_{minor}_x86_64" for minor in range(17, 29))]
    if not re.fullmatch(r"3\.\d+", args.target_python):
        parser.error(f"--target_python={args.target_python!r}: expected MAJOR.MINOR such as "
                     "3.12")
    this_python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    pip_version = Version(importlib.metadata.version("pip"))
    if args.target_python != this_python and pip_version < PIP_FOR_OTHER_PYTHONS:
        parser.error(f"--target_python={args.target_python}: pip {pip_version} checks a "
                     f"package's Requires-Python against this Python ({this_python}), not the "
                     f"target's, and would pick versions for {this_python} (jax 0.10.2 for a "
                     f"3.12 target; fixed in pip {PIP_FOR_OTHER_PYTHONS}). Fix: {sys.executable} "
                     f"-m pip install 'pip>={PIP_FOR_OTHER_PYTHONS}', or run this with Python "
                     f"{args.target_python}.")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    have = read_have(args.have) if args.have else {}

    requirements = args.requirements
    if not requirements:  # jdp itself, as a wheel in the wheelhouse
        _pip("wheel", "--quiet", "--no-deps", "--wheel-dir", out, REPO)
        wheel = [os.path.join(out, name) for name in sorted(os.listdir(out))
                 if name.startswith("jdp-") and name.endswith(".whl")][-1]
        requirements = [f"jdp[{args.extras}] @ file://{wheel}" if args.extras else wheel]
    with tempfile.TemporaryDirectory() as built_dir:
        built = build_source_only(requirements, built_dir)
        items = resolve(requirements, args, find_links=built_dir)
        requested = [Requirement(text) for text in requirements if not text.endswith(".whl")]
        lacking, notes = missing(items, requested, have, _target_environment(args))
        downloads = []
        for item in lacking:
            url = item["download_info"]["url"]
            if url.startswith("file://"):  # built here, jdp, or from a find-links folder
                path = urllib.parse.unquote(urllib.parse.urlparse(url).path)
                if os.path.dirname(path) != out:
                    shutil.copy(path, out)
            else:
                downloads.append(f"{item['metadata']['name']}=={item['metadata']['version']}")
        if downloads:
            _pip("download", "--quiet", "--no-deps", "--dest", out, *_target_options(args),
                 *downloads)
    wheels = sorted(name for name in os.listdir(out) if name.endswith(".whl"))
    total_bytes = sum(os.path.getsize(os.path.join(out, name)) for name in wheels)
    with open(os.path.join(out, "requirements.txt"), "w") as f:
        f.write("".join(f"{i['metadata']['name']}=={i['metadata']['version']}\n"
                        for i in lacking))
    for note in notes:
        print(f"note: {note}")
    if built:
        print(f"built from source: {', '.join(built)}")
    print(f"{len(wheels)} wheels, {total_bytes / 2**20:.1f} MiB in {out}:")
    for name in wheels:
        print(f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
