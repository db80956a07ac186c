"""python -m jdp.sample --workdir=W --prompt="def " [--max_new_tokens=200 --temperature=0.8
--top_k=40 --seed=0 --step=N --shard_params]: prints the prompt and the model's continuation
(see jdp.sample)."""

import argparse
import sys

from jdp.errors import ConfigError
from jdp.runtime.exit_codes import BAD_CONFIG


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdp.sample", description=__doc__)
    parser.add_argument("--workdir", required=True, help="a training run's workdir")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=200,
                        help="past the model's context, a sliding window (see jdp.sample)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=40, help="0: no cut-off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint to sample (default: the newest)")
    parser.add_argument("--shard_params", action=argparse.BooleanOptionalAction, default=None,
                        help="split the params over all local devices (default: where they "
                             "take more than half of one device's memory)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens={args.max_new_tokens}: ask for at least 1")
    from jdp import sample
    from jdp.checkpoint import CheckpointError

    try:
        sampler = sample.load(args.workdir, step=args.step, shard_params=args.shard_params)
        text = sampler.continuation(args.prompt, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, top_k=args.top_k,
                                    seed=args.seed)
    except (ConfigError, CheckpointError) as e:
        print(f"jdp.sample: error: {e}", file=sys.stderr)
        return BAD_CONFIG
    print(args.prompt + text)
    return 0


sys.exit(main())
