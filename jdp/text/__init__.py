"""Preparing text for language models ahead of a run: `python -m jdp.text`.

    python -m jdp.text tokenizer --files=GLOB --vocab_size=N --out=PATH [--kind=bpe]
    python -m jdp.text prepare --files=GLOB --tokenizer=SPEC --out=DIR [--eval_fraction=F]
        [--processes=N] [--text_field=NAME]

`tokenizer` trains a sentencepiece (`--kind=sentencepiece`, a .model file) or
byte-level BPE (`--kind=bpe`, a tokenizer.json for the `tokenizers` library) tokenizer
on your own files, offline, and prints the `data.tokenizer` spec to train with.
`prepare` tokenizes the files (any `data.text_files` value: globs of text, JSON
lines, compressed, Parquet or Arrow files, `hf_disk:DIR[:split]`) into a token store
with N processes (default: one per core), printing documents, MB/s and an ETA to
stderr as it goes; a killed prepare resumes from its finished shards. A run then
reuses the store: pass `--config.data.token_dir=DIR` with the same files and tokenizer.
The store and the tokenizers themselves live in `jdp.data.text`.
"""
