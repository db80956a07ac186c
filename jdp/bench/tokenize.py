"""MB/s of preparing a token store, at 1 and 2 processes, against tokenizers' encode_batch.

    python -m jdp.bench tokenize [--mb=200] [--processes=1,2] [--bpe_vocab=32768]

The corpus is real text repeated: the Python standard library's sources (the corpus
every machine has), written once into --data_dir as .jsonl files of --mb MB in all.
For the byte tokenizer and a byte-level BPE of --bpe_vocab ids (trained once on the
standard library), `store.prepare` builds the store from nothing with each process
count (MB of text per second of wall time, reading, hashing, writing and merging
included). The limit: Hugging Face tokenizers' own `encode_batch` on the same
documents, already in memory, with as many rayon threads (RAYON_NUM_THREADS) as
prepare has processes, in a fresh process. Printed: each figure, the 2-process speed-up,
prepare / encode_batch, and what a 20 GB corpus would take on a 16-core host,
extrapolated from the per-process rate and the measured speed-up (not measured).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_CORPUS_FILES = 16
_ENCODE_BATCH_DOCUMENTS = 1024


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--data_dir", default=os.path.join(tempfile.gettempdir(),
                                                           "jdp-bench-tokenize"),
                        help="where the corpus and the BPE are written once and reused")
    parser.add_argument("--mb", type=int, default=200, help="MB of text in the corpus")
    parser.add_argument("--processes", default="1,2", help="process counts to measure")
    parser.add_argument("--bpe_vocab", type=int, default=32768)
    parser.add_argument("--tokenizers", default="bytes,bpe")


def _corpus(directory: str, megabytes: int) -> list[str]:
    """.jsonl files of the standard library's sources repeated to `megabytes` MB of text."""
    from jdp.data.text import corpus

    files = [os.path.join(directory, f"part-{i:02d}.jsonl") for i in range(_CORPUS_FILES)]
    done = os.path.join(directory, f"corpus-{megabytes}MB.done")
    if os.path.exists(done):
        return files
    texts = [t for path in corpus.stdlib_files() for t in corpus.iter_documents(path)]
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    per_file = megabytes * 10**6 // _CORPUS_FILES
    index = 0
    for path in files:
        written = 0
        with open(path, "w", encoding="utf-8") as f:
            while written < per_file:
                f.write(lines[index % len(lines)])
                written += len(texts[index % len(texts)].encode())
                index += 1
    open(done, "w").close()
    return files


def _bpe(directory: str, vocab_size: int) -> str:
    from jdp.data.text import corpus, tokenizers

    out = os.path.join(directory, f"bpe-{vocab_size}.json")
    if not os.path.exists(out):
        start = time.perf_counter()
        tokenizers.train_tokenizer(corpus.stdlib_files(), vocab_size=vocab_size, out=out,
                                   kind="bpe")
        print(f"trained a {vocab_size}-id BPE on the standard library in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    return f"hf:{out}"


def _prepare_mb_per_s(files: list[str], spec: str, processes: int, scratch: str) -> float:
    from jdp.data.text import store, tokenizers

    tokenizer = tokenizers.from_spec(spec, "tokenizer")
    directory = os.path.join(scratch, f"store-{processes}")
    shutil.rmtree(directory, ignore_errors=True)
    start = time.perf_counter()
    made = store.prepare(files, tokenizer, directory, processes=processes,
                         progress=lambda state: None)
    seconds = time.perf_counter() - start
    shutil.rmtree(directory, ignore_errors=True)
    return made.num_bytes / 1e6 / seconds


_ENCODE_BATCH = """
import json, sys, time
import tokenizers
tokenizer = tokenizers.Tokenizer.from_file(sys.argv[1])
tokenizer.encode_special_tokens = True
texts = [json.loads(line)["text"] for path in sys.argv[3:] for line in open(path)]
size = sum(len(t.encode()) for t in texts)
start = time.perf_counter()
batch = int(sys.argv[2])
for i in range(0, len(texts), batch):
    tokenizer.encode_batch_fast(texts[i:i + batch], add_special_tokens=False)
print(size / 1e6 / (time.perf_counter() - start))
"""


def _encode_batch_mb_per_s(files: list[str], spec: str, threads: int) -> float:
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true"}
    proc = subprocess.run([sys.executable, "-c", _ENCODE_BATCH, spec.split(":", 1)[1],
                           str(_ENCODE_BATCH_DOCUMENTS), *files],
                          env=env, capture_output=True, text=True, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores"


def run(args) -> None:
    os.makedirs(args.data_dir, exist_ok=True)
    counts = [int(n) for n in args.processes.split(",")]
    low, high = counts[0], counts[-1]
    files = _corpus(args.data_dir, args.mb)
    print(f"corpus: {len(files)} .jsonl files, {args.mb} MB of the standard library's "
          f"sources repeated; {_load()}", flush=True)
    speedups, limits = [], []
    for name in args.tokenizers.split(","):
        spec = "bytes" if name == "bytes" else _bpe(args.data_dir, args.bpe_vocab)
        rates = {}
        for processes in counts:
            with tempfile.TemporaryDirectory(prefix="jdp-bench-tokenize-", dir=args.data_dir) \
                    as scratch:
                rates[processes] = _prepare_mb_per_s(files, spec, processes, scratch)
            line = f"{name}: prepare with {processes} process(es): {rates[processes]:.3g} MB/s"
            if spec != "bytes":
                limit = _encode_batch_mb_per_s(files, spec, processes)
                line += (f"; encode_batch with {processes} thread(s): {limit:.3g} MB/s; "
                         f"prepare / encode_batch = {rates[processes] / limit:.2f}")
                limits.append(f"{name} at {processes}: {rates[processes] / limit:.2f}")
            print(f"{line} ({_load()})", flush=True)
        speedup = rates[high] / rates[low]
        speedups.append(f"{name} {speedup:.2f}x")
        # 16 processes at the measured rate of one and the measured parallel efficiency.
        host_mb_per_s = rates[low] / low * 16 * speedup / (high / low)
        print(f"{name}: a 20 GB corpus on a 16-core host: ~{20e3 / host_mb_per_s / 60:.0f} min "
              f"at ~{host_mb_per_s:.3g} MB/s (extrapolated from {low} and {high} processes, not "
              "measured)", flush=True)
    print(f"tokenize: prepare with {high} processes / {low}: {', '.join(speedups)}"
          + (f"; prepare / encode_batch with as many threads: {', '.join(limits)}"
             if limits else ""))
