"""Preparing text for language models ahead of a run: `python -m jdp.text`.

    python -m jdp.text tokenizer --files=GLOB --vocab_size=N --out=PATH [--kind=bpe]
    python -m jdp.text prepare --files=GLOB --tokenizer=SPEC --out=DIR [--eval_fraction=F]

`tokenizer` trains a sentencepiece (`--kind=sentencepiece`, a .model file) or
byte-level BPE (`--kind=bpe`, a tokenizer.json for the `tokenizers` library) tokenizer
on your own files, offline, and prints the `data.tokenizer` spec to train with.
`prepare` tokenizes the files into a token store (streamed, with progress), which a
run then reuses: pass `--config.data.token_dir=DIR` with the same files and tokenizer.
The store and the tokenizers themselves live in `jdp.data.text`.
"""
