"""python -m jdp.text {tokenizer,prepare}: see jdp.text."""

import argparse
import sys

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
    prepare = commands.add_parser("prepare", help="tokenize files into a token store")
    prepare.add_argument("--files", required=True, help="a glob, comma-separated globs, or stdlib")
    prepare.add_argument("--tokenizer", default="bytes",
                         help="bytes, sentencepiece:PATH or hf:PATH")
    prepare.add_argument("--out", required=True, help="the store's directory (data.token_dir)")
    prepare.add_argument("--eval_fraction", type=float, default=0.01,
                         help="documents held out for evaluation (as data.eval_fraction)")
    prepare.add_argument("--rebuild", action="store_true", help="replace a store of other inputs")
    prepare.add_argument("--text_field", default="text",
                         help="the field of .jsonl, Parquet and Arrow files with the documents")
    prepare.add_argument("--processes", type=int, default=0,
                         help="tokenizing processes (0: one per core this machine gives)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from jdp.data.text import corpus, lm, store, tokenizers

    try:
        files = corpus.expand_files(args.files, "files")
        if args.command == "tokenizer":
            spec = tokenizers.train_tokenizer(files, vocab_size=args.vocab_size, out=args.out,
                                              kind=args.kind, text_field=args.text_field)
            print(f"trained on {len(files)} files; train with --config.data.tokenizer={spec}")
            return 0
        tokenizer = tokenizers.from_spec(args.tokenizer, "tokenizer")
        train, held_out = store.prepare_split(
            files, tokenizer, lm.split_dir(args.out), eval_fraction=args.eval_fraction,
            rebuild=args.rebuild, text_field=args.text_field, processes=args.processes or None,
            progress=lambda state: print(state.line(args.out), file=sys.stderr, flush=True))
    except ConfigError as e:
        print(f"jdp.text: error: {e}", file=sys.stderr)
        return BAD_CONFIG
    print(f"{args.out}: {train.num_documents} train documents ({train.num_tokens:,} tokens), "
          f"{held_out.num_documents} held out ({held_out.num_tokens:,} tokens); train with "
          f"--config.data.token_dir={args.out}")
    return 0


sys.exit(main())
