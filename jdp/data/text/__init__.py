"""Language-model data from the user's own text: files -> tokenizer -> store -> windows.

`corpus` finds the files a config names (globs, "stdlib": the Python standard
library's sources, a corpus every machine has, or "hf_disk:DIR" a saved Hugging Face
dataset) in the corpus's document order; `formats` reads each kind of file (text,
JSON lines, gzip/zstd streams, Parquet, Arrow) piece by piece; `tokenizers` turns
text into ids (bytes, SentencePiece, Hugging Face) and trains a tokenizer offline
on the files; `shards` tokenizes a corpus in resumable shards on many processes (and
hosts); `store` concatenates them into a memory-mapped token store on disk
(documents separated by eos, reused while the files and tokenizer are unchanged,
written atomically), optionally holding out documents for evaluation; `windows`
cuts a store into packed fixed-length
next-token examples with per-document segment ids and positions, and accounts
evaluation in bits per byte. Nothing here needs JAX.
"""
