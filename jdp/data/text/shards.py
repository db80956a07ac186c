"""Tokenizing a corpus in shards, on as many cores as given, resumable after a kill.

The documents of the input files, in order, are cut into *shards*: runs of consecutive
file pieces (`formats.pieces`) of about 1/64 of the input (1 to 16 MB), a plan that
depends on the files alone (their names, sizes, row groups), never on how many
processes tokenize. Each shard is tokenized on its own, by any process, into a directory of the
work directory, `shard-NNNNNN/`: per output store (train and eval, or all) its
documents' tokens, each followed by eos (`NAME.bin`), their token counts
(`NAME.lengths.npy`), and `shard.json`, written last. A shard is written under a
temporary name and renamed whole, so a shard directory that exists is finished, and a
rerun (same plan: same files, tokenizer, split and text field) tokenizes only the
shards that are not. Concatenated in order, the shards are the store: the one store
whatever the number of processes, bitwise.

Processes: `processes` worker processes on this machine (new interpreters running
this module, `python -m jdp.data.text.shards`: safe after JAX has started threads,
and needing nothing of the caller's main script), each tokenizing with one thread;
with `share=(i, n)` process i of n (hosts sharing the work directory) first tokenizes
shards i, i+n, ... and then helps with any the others have not finished, so none
waits on a dead or slow peer. The workers of one machine claim each shard before they
start it (a file created exclusively in a directory of that call), so that a worker
that has finished its own shards takes only those no worker has started; shards are
done twice only across machines, where it is the same bytes, and the progress counts
a shard another process committed first once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import cloudpickle
import numpy as np

from jdp.data.text import formats
from jdp.errors import ConfigError
from jdp.runtime import leftovers, storage

PLAN = "plan.json"
SHARD_JSON = "shard.json"
# Input bytes per shard (a larger piece is a shard of its own): 1/64 of the corpus, so
# that small corpora are parallel too, within these bounds.
SHARD_BYTES = 16 << 20
MIN_SHARD_BYTES = 1 << 20
# Documents are tokenized in batches of about this much text (the most text a
# process holds, besides the largest single document).
_BATCH_CHARS = 2 << 20
_BATCH_DOCUMENTS = 1024
_PROGRESS_EVERY_S = 5.0


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# --- The plan -----------------------------------------------------------------------------


def plan(files: Sequence[dict], text_field: str, shard_bytes: int | None = None) -> list[list]:
    """The shards of `files` ({"path", "bytes", ...} in document order): each a list of
    [file index, start, stop, input bytes] pieces, consecutive, of about `shard_bytes`
    (default: 1/64 of the input, between MIN_SHARD_BYTES and SHARD_BYTES)."""
    total = sum(entry["bytes"] for entry in files)
    shard_bytes = shard_bytes or min(SHARD_BYTES, max(MIN_SHARD_BYTES, total // 64))
    shards: list[list] = []
    current: list = []
    size = 0
    for index, entry in enumerate(files):
        for piece in formats.pieces(entry["path"], entry["bytes"], text_field, shard_bytes):
            if current and size + piece.size_bytes > shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append([index, piece.start, piece.stop, piece.size_bytes])
            size += piece.size_bytes
    if current:
        shards.append(current)
    return shards


# --- Progress -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far a build is: documents and UTF-8 bytes of text this process tokenized so
    far, input bytes done (of shards finished before it started, `input_reused`, and of
    pieces read since) out of all, and the shards."""

    documents: int
    text_bytes: int
    input_done: int
    input_reused: int
    input_total: int
    elapsed_s: float
    shards_total: int
    shards_reused: int
    shards_tokenized: int
    finished: bool = False

    def line(self, where: str) -> str:
        rate = self.text_bytes / 1e6 / max(self.elapsed_s, 1e-9)
        fraction = self.input_done / max(self.input_total, 1)
        new_per_s = (self.input_done - self.input_reused) / max(self.elapsed_s, 1e-9)
        if self.finished:
            eta = "done"
        elif new_per_s > 0:
            eta = f"ETA {_duration((self.input_total - self.input_done) / new_per_s)}"
        else:
            eta = "ETA unknown"
        reused = f", {self.shards_reused} reused" if self.shards_reused else ""
        return (f"tokenizing into {where}: {self.documents:,} documents, "
                f"{self.text_bytes / 1e6:,.1f} MB of text at {rate:,.1f} MB/s, "
                f"{100 * fraction:.0f}% of {self.input_total / 1e6:,.1f} MB of input "
                f"({self.shards_reused + self.shards_tokenized} of {self.shards_total} "
                f"shards{reused}), {eta}")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class _Counters:
    """Documents, text bytes and input bytes tokenized, added to from several threads;
    `on_add` (optional) is told each addition."""

    def __init__(self, on_add: Callable[[int, int, int], None] | None = None) -> None:
        self.values = [0, 0, 0]
        self.on_add = on_add
        self.lock = threading.Lock()

    def add(self, documents: int, text_bytes: int, input_bytes: int) -> None:
        with self.lock:
            self.values[0] += documents
            self.values[1] += text_bytes
            self.values[2] += input_bytes
        if self.on_add is not None:
            self.on_add(documents, text_bytes, input_bytes)

    def read(self) -> tuple[int, int, int]:
        with self.lock:
            return self.values[0], self.values[1], self.values[2]


# --- One shard ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    """What every shard of one build needs (sent to each worker process once)."""

    files: list[dict]
    shards: list[list]
    tokenizer: object
    eval_fraction: float
    text_field: str
    field: str
    directory: str  # the work directory
    outputs: tuple[str, ...]  # ("train", "eval") or ("all",)
    dtype: str


def held_out(data: bytes, eval_fraction: float) -> bool:
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") < eval_fraction * 2**64


def shard_dir(directory: str, index: int) -> str:
    return os.path.join(directory, f"shard-{index:06d}")


def finished(directory: str, index: int) -> bool:
    return os.path.isfile(os.path.join(shard_dir(directory, index), SHARD_JSON))


class _ShardWriter:
    """One output's tokens and document lengths in a shard being written."""

    def __init__(self, path: str, dtype: np.dtype, eos_id: int) -> None:
        self.path = path
        self.dtype = dtype
        self.eos = np.array([eos_id], dtype)
        self.file = open(f"{path}.bin", "wb")  # noqa: SIM115 - closed by finish
        self.lengths: list[int] = []
        self.num_bytes = 0

    def add(self, ids: np.ndarray, num_bytes: int) -> None:
        self.file.write(np.concatenate([ids.astype(self.dtype), self.eos]).tobytes())
        self.lengths.append(len(ids) + 1)
        self.num_bytes += num_bytes

    def finish(self) -> dict:
        _close_synced(self.file)
        with open(f"{self.path}.lengths.npy", "wb") as f:
            np.save(f, np.asarray(self.lengths, np.int64), allow_pickle=False)
            _sync(f)
        return {"documents": len(self.lengths), "tokens": int(sum(self.lengths)),
                "bytes": self.num_bytes}


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _close_synced(f) -> None:
    _sync(f)
    f.close()


def fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _documents(job: Job, shard: list) -> Iterator[tuple[str | None, int]]:
    """The documents of one shard as (text, 0), and after each piece (None, its input bytes)."""
    for index, start, stop, size in shard:
        entry = job.files[index]
        path = entry["path"]
        for text in formats.documents(path, formats.Piece(start, stop, size),
                                      text_field=job.text_field, field=job.field):
            yield text, 0
        # The piece is read: check the file did not change under it.
        if storage.stat(path) != (entry["bytes"], entry["mtime_ns"]):
            raise ConfigError(f"config.{job.field}: {path} changed while it was being "
                              "tokenized. Fix: prepare the token store when no one is "
                              "writing the files.")
        yield None, size


def tokenize_shard(job: Job, index: int, counters: _Counters) -> bool:
    """Writes shard `index` unless it is finished; True if this call tokenized it. What
    it counted is taken back if another process commits the shard first."""
    if finished(job.directory, index):
        return False
    counted = _Counters(counters.add)
    tokenizer = job.tokenizer
    final = shard_dir(job.directory, index)
    temporary = f"{final}.tmp-{leftovers.tag()}-{secrets.token_hex(4)}"
    os.mkdir(temporary)
    dtype = np.dtype(job.dtype)
    writers = [_ShardWriter(os.path.join(temporary, name), dtype, tokenizer.eos_id)
               for name in job.outputs]
    batch: list[tuple[str, int, int]] = []  # (text, UTF-8 bytes, output)

    def flush() -> None:
        encoded = tokenizer.encode_batch([text for text, _, _ in batch]) if batch else []
        documents = text_bytes = 0
        for ids, (_, size, which) in zip(encoded, batch, strict=True):
            ids = np.asarray(ids)
            if ids.size == 0:
                continue  # text the tokenizer drops entirely: its bytes are not counted either
            if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:
                raise ValueError(f"{tokenizer!r} returned ids outside [0, {tokenizer.vocab_size})")
            writers[which].add(ids, size)
            documents += 1
            text_bytes += size
        counted.add(documents, text_bytes, 0)
        batch.clear()

    try:
        chars = 0
        for text, piece_bytes in _documents(job, job.shards[index]):
            if text is None:
                counted.add(0, 0, piece_bytes)
                continue
            data = text.encode("utf-8")
            which = int(held_out(data, job.eval_fraction)) if job.eval_fraction > 0 else 0
            batch.append((text, len(data), which))
            chars += len(text)
            if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCUMENTS:
                flush()
                chars = 0
        flush()
        summary = {name: writer.finish() for name, writer in zip(job.outputs, writers,
                                                                 strict=True)}
        with open(os.path.join(temporary, SHARD_JSON), "w", encoding="utf-8") as f:
            json.dump({"shard": index, "pieces": job.shards[index], "outputs": summary}, f)
            _sync(f)
        fsync_directory(temporary)
        try:
            os.rename(temporary, final)
        except OSError:  # another process finished the same shard first: same content
            if not finished(job.directory, index):
                raise
            counters.add(*(-value for value in counted.read()))  # counted by that process
            return False
        fsync_directory(job.directory)
        return True
    finally:
        for writer in writers:
            writer.file.close()
        shutil.rmtree(temporary, ignore_errors=True)


def _whole(job: Job, index: int) -> bool:
    """Whether a finished shard's files agree with its shard.json (a shard renamed in
    before a machine crash could have lost data that was not yet on disk)."""
    try:
        for name in job.outputs:
            counts, path, lengths = read_shard(job.directory, index, name)
            if (os.path.getsize(path) != counts["tokens"] * np.dtype(job.dtype).itemsize
                    or len(lengths) != counts["documents"]
                    or int(lengths.sum()) != counts["tokens"]):
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def read_shard(directory: str, index: int, name: str) -> tuple[dict, str, np.ndarray]:
    """(counts, path of the tokens, document lengths) of one output of a finished shard."""
    with open(os.path.join(shard_dir(directory, index), SHARD_JSON), encoding="utf-8") as f:
        counts = json.load(f)["outputs"][name]
    path = os.path.join(shard_dir(directory, index), name)
    lengths = np.load(f"{path}.lengths.npy", allow_pickle=False)
    return counts, f"{path}.bin", lengths


# --- Many shards, many processes ----------------------------------------------------------


def order(num_shards: int, share: tuple[int, int]) -> list[int]:
    """The shards process i of n tokenizes, in order: its own, i, i+n, ..., then the
    others' from the last back, so that a process done early meets a slower one in
    the middle of its list rather than following it shard by shard."""
    index, count = share
    return ([k for k in range(num_shards) if k % count == index]
            + [k for k in reversed(range(num_shards)) if k % count != index])


def _worker_command() -> list[str]:
    return [sys.executable, "-m", "jdp.data.text.shards"]


class _Worker:
    """A tokenizing process of this machine: given the job and its shards (cloudpickle,
    so tokenizers defined in a script travel too), it reports on stdout."""

    def __init__(self, job: Job, indices: list[int], claims: str, counters: _Counters) -> None:
        # This process's import path, so that the worker imports what it imported (jdp
        # from a checkout, a tokenizer's module), as multiprocessing's spawn does.
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(path or os.getcwd() for path in sys.path)}
        self.process = subprocess.Popen(_worker_command(), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.tokenized = 0
        self.stderr = b""
        self._threads = [threading.Thread(target=self._read_stdout, args=(counters,),
                                          daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for thread in self._threads:
            thread.start()
        with contextlib.suppress(BrokenPipeError):  # it died at start: wait() says why
            self.process.stdin.write(cloudpickle.dumps((job, indices, claims)))
            self.process.stdin.close()

    def _read_stdout(self, counters: _Counters) -> None:
        for line in self.process.stdout:
            kind, *values = line.split()
            if kind == b"progress":
                counters.add(*map(int, values))
            elif kind == b"tokenized":
                self.tokenized += 1

    def _read_stderr(self) -> None:
        self.stderr = self.process.stderr.read()

    def wait(self) -> None:
        """Returns once it has exited and its output is read; raises what it failed with."""
        code = self.process.wait()
        for thread in self._threads:
            thread.join()
        message = self.stderr.decode("utf-8", "replace").strip()
        if code == BAD_INPUT:  # a ConfigError, already one line
            raise ConfigError(message.splitlines()[-1])
        if code != 0:
            raise RuntimeError(f"a tokenizing process ({' '.join(_worker_command())}) exited "
                               f"{code}: {message[-3000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


BAD_INPUT = 2  # a worker's exit status for a ConfigError


def claim(claims: str, index: int) -> bool:
    """Whether this worker may tokenize shard `index`: no worker of this machine's call
    has claimed it (the claim is a file in `claims`, created exclusively)."""
    try:
        os.close(os.open(os.path.join(claims, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _worker_main() -> None:
    from jdp.data.text import tokenizers

    job, indices, claims = cloudpickle.load(sys.stdin.buffer)
    tokenizers.use_one_thread()

    def report(documents: int, text_bytes: int, input_bytes: int) -> None:
        print(f"progress {documents} {text_bytes} {input_bytes}", flush=True)

    try:
        for index in indices:
            if claim(claims, index) and tokenize_shard(job, index, _Counters(report)):
                print(f"tokenized {index}", flush=True)
    except ConfigError as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)


def tokenize(job: Job, *, processes: int, share: tuple[int, int],
             progress: Callable[[Progress], None]) -> Progress:
    """Tokenizes every shard of `job` that is not finished, with `processes` processes
    of this machine (1: in this one), this machine's part in the order `order(...)`
    gives; returns the final progress."""
    start = time.monotonic()
    sizes = [sum(piece[3] for piece in shard) for shard in job.shards]
    reused = {k for k in range(len(job.shards)) if finished(job.directory, k)}
    for k in [k for k in reused if not _whole(job, k)]:  # tokenized again
        shutil.rmtree(shard_dir(job.directory, k), ignore_errors=True)
        reused.remove(k)
    todo = [k for k in order(len(job.shards), share) if k not in reused]
    reused_input = sum(sizes[k] for k in reused)
    totals = _Counters()
    tokenized = 0
    last_report = [start]

    def report(final: bool = False) -> Progress:
        documents, text_bytes, input_bytes = totals.read()
        state = Progress(documents, text_bytes, reused_input + input_bytes, reused_input,
                         sum(sizes), time.monotonic() - start, len(job.shards), len(reused),
                         tokenized, finished=final)
        progress(state)
        last_report[0] = time.monotonic()
        return state

    def report_now_and_then(*counts: int) -> None:
        totals.add(*counts)
        if time.monotonic() - last_report[0] >= _PROGRESS_EVERY_S:
            report()

    if processes <= 1 or len(todo) <= 1:
        from jdp.data.text import tokenizers

        with tokenizers.one_thread():
            for k in todo:
                tokenized += tokenize_shard(job, k, _Counters(report_now_and_then))
        return report(final=True)

    count = min(processes, len(todo))
    claims = tempfile.mkdtemp(prefix="jdp-shard-claims-")
    # Worker j: its own part of this machine's list, then the others' from the end.
    workers = [_Worker(job, [todo[i] for i in order(len(todo), (j, count))], claims, totals)
               for j in range(count)]
    try:
        while any(worker.process.poll() is None for worker in workers):
            for worker in workers:
                if worker.process.poll():  # failed: say why now, the others are killed
                    worker.wait()
            time.sleep(0.2)
            if time.monotonic() - last_report[0] >= _PROGRESS_EVERY_S:
                tokenized = sum(worker.tokenized for worker in workers)
                report()
        for worker in workers:
            worker.wait()
    finally:
        for worker in workers:
            worker.kill()
        shutil.rmtree(claims, ignore_errors=True)
    tokenized = sum(worker.tokenized for worker in workers)
    return report(final=True)


if __name__ == "__main__":
    _worker_main()
