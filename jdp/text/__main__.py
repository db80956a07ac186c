"""python -m jdp.text {tokenizer,prepare}: see jdp.text."""

import argparse
import sys

from jdp.config import defaults, paths
from jdp.errors import ConfigError
from jdp.runtime.exit_codes import BAD_CONFIG


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jdp.text",
                                     description="Tokenizers and token stores for jdp's LMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("tokenizer", help="train a tokenizer on your files, offline")
    train.add_argument("--files", required=True, help="a glob, comma-separated globs, or stdlib")
    train.add_argument("--vocab_size", type=int, required=True)
    train.add_argument("--out", required=True, help="the .model or tokenizer.json to write")
    train.add_argument("--kind", choices=("sentencepiece", "bpe"), default="sentencepiece")
    train.add_argument("--text_field", default="text", help="as data.text_field")
    data = defaults().data
    prepare = commands.add_parser(
        "prepare", help="tokenize files into a token directory that a run names with "
        "--config.data.token_dir alone")
    prepare.add_argument("--files", required=True, help="a glob, comma-separated globs, or stdlib")
    prepare.add_argument("--tokenizer", default=data.tokenizer,
                         help="bytes, bpe:N (trained on --files), sentencepiece:PATH or hf:PATH")
    prepare.add_argument("--out", required=True, help="the token directory (data.token_dir)")
    prepare.add_argument("--eval_files", default="",
                         help="held-out text (as data.eval_text_files); default: --eval_fraction")
    prepare.add_argument("--eval_fraction", type=float, default=data.eval_fraction,
                         help="documents held out for evaluation (as data.eval_fraction)")
    prepare.add_argument("--rebuild", action="store_true",
                         help="replace a token directory made from other inputs")
    prepare.add_argument("--text_field", default=data.text_field,
                         help="the field of .jsonl, Parquet and Arrow files with the documents")
    prepare.add_argument("--processes", type=int, default=0,
                         help="tokenizing processes (0: one per core this machine gives)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from jdp.data.text import corpus, lm, tokenizers

    try:
        if args.command == "tokenizer":
            files = corpus.expand_files(args.files, "files")
            spec = tokenizers.train_tokenizer(files, vocab_size=args.vocab_size, out=args.out,
                                              kind=args.kind, text_field=args.text_field)
            print(f"trained on {len(files)} files; train with --config.data.tokenizer={spec}")
            return 0
        out = paths.absolute(args.out)
        # The same keys a run's config has, so that the directory describes itself in them.
        data = defaults().data
        data.text_files = paths.absolute_list(args.files)
        data.eval_text_files = paths.absolute_list(args.eval_files)
        data.tokenizer = paths.absolute_spec(args.tokenizer)
        data.eval_fraction = args.eval_fraction
        data.text_field = args.text_field
        data.tokenize_processes = args.processes
        data.rebuild_tokens = args.rebuild
        # As a run's own store: reused while its files are unchanged, replaced on --rebuild.
        train, held_out = lm.prepare(
            data, out, prepared=False,
            progress=lambda state: print(state.line(out), file=sys.stderr, flush=True))
    except ConfigError as e:
        print(f"jdp.text: error: {e}", file=sys.stderr)
        return BAD_CONFIG
    print(f"{out}: {train.num_documents} train documents ({train.num_tokens:,} tokens), "
          f"{held_out.num_documents} held out ({held_out.num_tokens:,} tokens); train on it "
          f"with --config.data.token_dir={out} (it supplies the files, tokenizer and split)")
    return 0


sys.exit(main())
