"""python -m jdp.export --workdir=W --out=DIR [--step=N] [--dtype=float32|bfloat16]
[--overwrite]: writes the run's model as a transformers directory (see jdp.export)."""

import argparse
import os
import sys

from jdp.errors import ConfigError
from jdp.runtime.exit_codes import BAD_CONFIG, FAILED


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdp.export", description=__doc__)
    parser.add_argument("--workdir", required=True, help="a training run's workdir")
    parser.add_argument("--out", required=True, help="the directory to write (new or empty)")
    parser.add_argument("--step", type=int, default=None, help="a checkpoint's step (default: "
                        "the newest)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--max_shard_mb", type=float, default=5000.0,
                        help="split model.safetensors into shards of at most this many MB")
    args = parser.parse_args(argv)
    # All of it (the self-check's forward pass too) runs on the CPU: accelerators, which
    # a training run may be using, are left alone.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jdp.checkpoint import CheckpointError
    from jdp.export import directory, verify

    try:
        result = directory.export_run(args.workdir, args.out, step=args.step, dtype=args.dtype,
                                   overwrite=args.overwrite,
                                   max_shard_bytes=int(args.max_shard_mb * 10**6))
    except (ConfigError, CheckpointError) as e:
        print(f"jdp: error: {e}", file=sys.stderr)
        return BAD_CONFIG
    except verify.ExportMismatch as e:
        print(f"jdp: error: the export failed its check, nothing was written to {args.out}: "
              f"{e}", file=sys.stderr)
        return FAILED
    checked = ("not verified" if result.max_abs_diff is None else
               f"transformers' logits within {result.max_abs_diff:.2g} of jdp's")
    print(f"exported {result.architecture} ({result.num_tensors} tensors, "
          f"{result.tensor_bytes / 2**20:.1f} MiB) to {result.out} in {result.seconds:.1f} s; "
          f"{checked}")
    return 0


sys.exit(main())
