"""`python -m jdp.bench <subcommand> [options]`: see jdp/bench/__init__.py."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import jdp.bench

# subcommand -> module of jdp.bench defining add_arguments(parser) and run(args).
SUBCOMMANDS = {
    "overhead": "overhead",
    "overhead_e2e": "overhead_e2e",
    "step_overhead": "step_overhead",
    "scaling": "steps",
    "checkpoint": "checkpoint",
    "memory": "memory",
    "compile": "compile",
    "input": "input",
    "tokenize": "tokenize",
    "communication": "communication",
    "network": "network",
    "gpu": "gpu",
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:  # its wheels hold packages the other benchmarks import
        from jdp.bench import gpu

        gpu.install_first(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m jdp.bench", description=jdp.bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="benchmark", required=True, metavar="benchmark")
    modules = {}
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"jdp.bench.{module_name}")
        sub = commands.add_parser(name, help=(module.__doc__ or "").splitlines()[0])
        module.add_arguments(sub, name)
        modules[name] = module
    args, unknown = parser.parse_known_args(argv)
    # `--config.FIELD=VALUE` overrides go to the benchmarks that load an experiment.
    args.config_overrides = [arg for arg in unknown if arg.startswith("--config.")]
    rest = [arg for arg in unknown if not arg.startswith("--config.")]
    if rest or (args.config_overrides
                and not getattr(modules[args.benchmark], "TAKES_CONFIG_OVERRIDES", False)):
        parser.error(f"unrecognized arguments: {' '.join(rest or args.config_overrides)}")
    import jax  # after parsing: --help stays fast

    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"{os.cpu_count()} CPU cores", flush=True)
    modules[args.benchmark].run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
