"""Real corpora as text sources, tokenized on many cores: Parquet, saved Hugging Face
datasets (their Arrow files), gzip and Zstandard streams; the same text in any of them
makes the same token store and trains the same; a store built by 2 processes (or 2
hosts) equals 1 process's bitwise; a Parquet corpus larger than the memory the
preparing process may use is prepared within it; training reads windows from the
memory-mapped store; bad input fails in one line before anything is written.

The text is real: modules of the Python standard library, written out locally.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from jdp.data import in_memory, splits, streamed  # noqa: E402
from jdp.data.text import corpus, shards, store  # noqa: E402
from jdp.data.text.tokenizers import ByteTokenizer, from_spec, train_tokenizer  # noqa: E402
from jdp.errors import ConfigError  # noqa: E402
from runs import REPO, losses, train  # noqa: E402

GPT = "experiments/gpt.py"
TRICKY = "  lead\ttab\r\nwin\rcr\x00nul 😀👍🏽 e\u0301 中文 </s> <|endoftext|>\n"


def _stdlib_documents() -> list[str]:
    """The json and email packages' sources (~350 KB in ~30 documents) and tricky text."""
    paths = [p for p in corpus.stdlib_files()
             if os.sep + "json" + os.sep in p or os.sep + "email" + os.sep in p]
    documents = []
    for path in paths:
        with open(path, encoding="utf-8", newline="") as f:
            documents.append(f.read())
    return [text for text in documents if text] + [TRICKY]


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return _stdlib_documents()


def _zstd(data: bytes, path: Path) -> None:
    with pa.CompressedOutputStream(str(path), "zstd") as out:
        out.write(data)


@pytest.fixture(scope="module")
def formats(documents, tmp_path_factory) -> dict[str, str]:
    """The same documents, in order, as config values of each kind of source."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("formats")
    (root / "txt").mkdir()
    for i, text in enumerate(documents):
        (root / "txt" / f"doc{i:03d}.txt").write_bytes(text.encode())
    # Parquet: two files, row groups of 4 rows, another column, and rows that are no
    # document (null, empty).
    (root / "parquet").mkdir()
    half = len(documents) // 2
    for name, part in (("part-0", documents[:half]), ("part-1", documents[half:])):
        rows = part + [None, ""]
        pq.write_table(pa.table({"id": list(range(len(rows))), "text": rows}),
                       root / "parquet" / f"{name}.parquet", row_group_size=4)
    # A saved dataset in several Arrow files; a DatasetDict whose train split is it.
    dataset = datasets.Dataset.from_dict({"text": documents, "id": list(range(len(documents)))})
    dataset.save_to_disk(str(root / "hf"), max_shard_size="100KB")
    datasets.DatasetDict({"train": dataset, "test": dataset.select([0])}).save_to_disk(
        str(root / "hf_dict"), max_shard_size="100KB")
    # Compressed JSON lines (with the text in another field) and compressed text.
    (root / "compressed").mkdir()
    lines = "".join(json.dumps({"content": t, "n": i}) + "\n" for i, t in enumerate(documents))
    half_lines = lines.splitlines(keepends=True)
    (root / "compressed" / "a.jsonl.gz").write_bytes(gzip.compress(
        "".join(half_lines[:half]).encode()))
    _zstd("".join(half_lines[half:-1]).encode(), root / "compressed" / "b.jsonl.zst")
    _zstd(documents[-1].encode(), root / "compressed" / "c.txt.zst")
    return {"txt": str(root / "txt" / "*.txt"), "parquet": str(root / "parquet" / "*.parquet"),
            "hf_disk": f"hf_disk:{root / 'hf'}", "hf_dict": f"hf_disk:{root / 'hf_dict'}:train",
            "arrow": str(root / "hf" / "*.arrow"),
            "compressed": f"{root / 'compressed'}/*.zst,{root / 'compressed'}/*.gz",
            "root": str(root)}


def _store_bytes(directory: Path) -> tuple[bytes, bytes]:
    return ((directory / "tokens.bin").read_bytes(), (directory / "documents.npy").read_bytes())


def _prepare(value: str, directory: Path, text_field: str = "text", **options):
    files = corpus.expand_files(value, "data.text_files")
    return store.prepare(files, ByteTokenizer(), str(directory), text_field=text_field,
                         **options)


# --- One corpus whatever the format -------------------------------------------------------


def test_the_same_text_in_every_format_makes_the_identical_store(documents, formats,
                                                                 tmp_path):
    reference = _prepare(formats["txt"], tmp_path / "txt")
    assert reference.num_documents == len(documents)
    assert [ByteTokenizer().decode(reference.document(i)) for i in (0, len(documents) - 1)] == [
        documents[0], documents[-1]]
    assert len(list(Path(formats["hf_disk"][len("hf_disk:"):]).glob("*.arrow"))) > 1
    for kind in ("parquet", "hf_disk", "hf_dict", "arrow", "compressed"):
        field = "content" if kind == "compressed" else "text"
        made = _prepare(formats[kind], tmp_path / kind, text_field=field)
        assert _store_bytes(tmp_path / kind) == _store_bytes(tmp_path / "txt"), kind
        assert (made.num_documents, made.num_tokens, made.num_bytes) == (
            reference.num_documents, reference.num_tokens, reference.num_bytes)


def test_mixed_globs_are_one_corpus_in_path_order_recorded_in_the_manifest(documents, formats,
                                                                           tmp_path):
    root = Path(formats["root"]) / "mixed"
    root.mkdir()
    third = len(documents) // 3
    pq.write_table(pa.table({"text": documents[:third]}), root / "a.parquet")
    (root / "b.jsonl.gz").write_bytes(gzip.compress("".join(
        json.dumps({"text": t}) + "\n" for t in documents[third:-1]).encode()))
    (root / "c.txt").write_bytes(documents[-1].encode())
    globs = [f"{root}/*.txt", f"{root}/*.gz", f"{root}/*.parquet"]
    files = corpus.expand_files(",".join(globs), "data.text_files")
    assert files == corpus.expand_files(",".join(reversed(globs)), "data.text_files")
    assert [os.path.basename(f) for f in files] == ["a.parquet", "b.jsonl.gz", "c.txt"]
    reference = _prepare(formats["txt"], tmp_path / "txt")
    made = store.prepare(files, ByteTokenizer(), str(tmp_path / "mixed"))
    assert _store_bytes(tmp_path / "mixed") == _store_bytes(tmp_path / "txt")
    assert made.num_documents == reference.num_documents
    manifest = json.loads((tmp_path / "mixed" / "manifest.json").read_text())
    assert [f["path"] for f in manifest["files"]] == files
    assert manifest["document_order"] == corpus.DOCUMENT_ORDER
    assert manifest["text_field"] == "text"


def test_a_store_of_another_text_field_is_refused(formats, tmp_path):
    _prepare(formats["compressed"], tmp_path / "store", text_field="content")
    with pytest.raises(ConfigError, match="text_field differs"):
        _prepare(formats["compressed"], tmp_path / "store", text_field="n")


def test_a_saved_dataset_dict_needs_a_split_and_names_them(formats):
    with pytest.raises(ConfigError) as info:
        corpus.expand_files(formats["hf_dict"].rsplit(":", 1)[0], "data.text_files")
    message = str(info.value)
    assert "\n" not in message and "'train', 'test'" in message and ":train" in message
    with pytest.raises(ConfigError, match="no split 'valid'"):
        corpus.expand_files(formats["hf_dict"].rsplit(":", 1)[0] + ":valid", "data.text_files")


@pytest.mark.slow
def test_the_same_text_in_every_format_trains_the_same_first_20_losses(formats, tmp_path):
    import jax

    settings = ["--config.data.tokenizer=bytes", "--config.data.eval_fraction=0.2",
                "--config.data.seq_len=32", "--config.model.size=nano", "--config.batch_size=8",
                "--config.eval_batch_size=8", "--config.total_steps=20",
                "--config.warmup_steps=2", "--config.log_every_steps=1",
                "--config.eval_every_steps=0", "--config.eval.sample_prompt=",
                "--config.compute_dtype=float32"]
    runs = {}
    for kind in ("txt", "parquet", "hf_disk"):
        _, records = train(GPT, tmp_path / kind, f"--config.data.text_files={formats[kind]}",
                           *settings, devices=jax.devices()[:1])
        runs[kind] = losses(records)
    assert sorted(runs["txt"]) == list(range(1, 21))
    assert runs["parquet"] == runs["txt"] == runs["hf_disk"]  # float32, bitwise


# --- Many processes, one store ------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe(formats, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return train_tokenizer(corpus.expand_files(formats["txt"], "files")[:10], vocab_size=400,
                           out=str(out), kind="bpe")


def test_two_processes_write_the_store_one_process_writes_bitwise(formats, bpe, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setattr(shards, "SHARD_BYTES", 48 << 10)  # several shards of ~350 KB
    files = corpus.expand_files(formats["parquet"], "data.text_files")
    tokenizer = from_spec(bpe)
    made, reports = {}, []
    for processes in (1, 2):
        made[processes] = store.prepare_split(files, tokenizer, str(tmp_path / f"p{processes}"),
                                              eval_fraction=0.2, processes=processes,
                                              progress=reports.append)
    final = reports[-1]
    assert final.shards_tokenized == final.shards_total >= 4
    # Each shard counted once: the workers claim what they take from each other's lists.
    assert final.documents == made[2][0].num_documents + made[2][1].num_documents
    assert final.text_bytes == made[2][0].num_bytes + made[2][1].num_bytes
    assert final.input_done == final.input_total
    for split in ("train", "eval"):
        assert _store_bytes(tmp_path / "p1" / split) == _store_bytes(tmp_path / "p2" / split)
        one, two = (json.loads((tmp_path / p / split / "manifest.json").read_text())
                    for p in ("p1", "p2"))
        assert {k: v for k, v in one.items() if k != "created_unix_s"} == {
            k: v for k, v in two.items() if k != "created_unix_s"}
    assert made[2][0].num_documents + made[2][1].num_documents == len(
        list(Path(formats["txt"]).parent.glob("*.txt")))


def test_a_shard_another_host_committed_first_leaves_this_ones_count(formats, tmp_path,
                                                                     monkeypatch):
    files = store._stat_inputs(corpus.expand_files(formats["txt"], "files"), "files")
    job = shards.Job(files=files, shards=shards.plan(files, "text"), tokenizer=ByteTokenizer(),
                     eval_fraction=0.0, text_field="text", field="files",
                     directory=str(tmp_path), outputs=("all",), dtype="uint16")
    first = shards._Counters()
    assert shards.tokenize_shard(job, 0, first)
    assert first.read()[0] > 0
    # Another host's copy of shard 0, started before the first was committed: it finds the
    # shard there only when it renames its own into place.
    real, asked = shards.finished, []
    monkeypatch.setattr(shards, "finished",
                        lambda directory, index: bool(asked.append(index) or len(asked) > 1)
                        and real(directory, index))
    second = shards._Counters()
    assert not shards.tokenize_shard(job, 0, second)
    assert len(asked) == 2 and second.read() == (0, 0, 0)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(shards.shard_dir(str(tmp_path), 0))]


_SHARE = """
import json, sys
from jdp.data.text import corpus, shards, store, tokenizers
shards.SHARD_BYTES = 48 << 10
index, directory, value = int(sys.argv[1]), sys.argv[2], sys.argv[3]
reports = []
made = store.prepare(corpus.expand_files(value, "files"), tokenizers.ByteTokenizer(), directory,
                     processes=1, share=(index, 2), progress=reports.append, wait_s=120)
# A process that looks after process 0 has published the store tokenizes nothing.
print(json.dumps({"tokenized": reports[-1].shards_tokenized if reports else 0,
                  "total": reports[-1].shards_total if reports else None,
                  "documents": made.num_documents}))
"""


def test_hosts_sharing_the_work_write_one_store(formats, tmp_path):
    directory = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", _SHARE, str(i), str(directory),
                               formats["hf_disk"]], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert results[0]["total"] >= 4
    # Between them every shard was tokenized (a shard done twice is the same bytes).
    assert sum(r["tokenized"] for r in results) >= results[0]["total"]
    assert results[0]["documents"] == results[1]["documents"]
    _prepare(formats["hf_disk"], tmp_path / "alone", processes=1)
    assert _store_bytes(directory) == _store_bytes(tmp_path / "alone")
    assert sorted(os.listdir(tmp_path)) == ["alone", "shared"]  # the shards are gone


# --- Memory -------------------------------------------------------------------------------

_UNDER_LIMIT = """
import json, os, resource, sys
from jdp.data.text import store, tokenizers
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
made = store.prepare([sys.argv[1]], tokenizers.ByteTokenizer(), sys.argv[2], processes=1)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"bytes": made.num_bytes, "peak_rss_kb": int(status["VmHWM"].split()[0])}))
"""


@pytest.mark.slow
def test_a_parquet_corpus_larger_than_the_memory_limit_is_prepared_within_it(tmp_path):
    limit = 256 << 20
    texts = _stdlib_documents()
    path = tmp_path / "big.parquet"
    written = 0
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        while written <= limit + (32 << 20):  # real text, repeated past the limit
            writer.write_table(pa.table({"text": texts}), row_group_size=8)
            written += sum(len(t.encode()) for t in texts)
    # RLIMIT_DATA bounds the heap and private mappings; Arrow's default allocator
    # (mimalloc) reserves address space in 1 GiB arenas whatever it uses, so the
    # preparing process allocates through malloc, whose reservations follow use.
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2"}
    proc = subprocess.run([sys.executable, "-c", _UNDER_LIMIT, str(path), str(tmp_path / "store"),
                           str(limit)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["bytes"] == written > limit
        assert result["peak_rss_kb"] << 10 < limit
    finally:
        for name in ("tokens.bin", "documents.npy"):  # ~600 MB: not kept for pytest's history
            (tmp_path / "store" / name).unlink(missing_ok=True)


def test_training_over_a_store_reads_windows_from_its_memory_map(formats, tmp_path):
    from jdp.config import defaults
    from jdp.data.text import lm

    config = defaults().data
    config.update(text_files=formats["txt"], tokenizer="bytes", eval_fraction=0.2, seq_len=16)
    data = lm.build(config, workdir=str(tmp_path), eval_batch_size=8)
    windows_bytes = len(data.train) * 16 * 4 * 5  # what reading every window in would take
    tracemalloc.start()
    try:
        split = splits.open_train(data, seed=3, setting="auto")
        batches = list(split.batches(global_batch_size=8, rows=slice(0, 8), start_step=5,
                                     num_steps=3))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(split, in_memory.InMemoryTrain)
    assert isinstance(split.rows, in_memory.MappedRows)
    # What grows with the store is the epoch's permutation, 8 bytes a window (and its
    # check against grain), not the 320 bytes of each window's features.
    assert peak < windows_bytes / 3, (peak, windows_bytes)
    streamed_split = streamed.StreamedTrain(data.train, data.preprocess_for(train=True), 3)
    expected = list(streamed_split.batches(global_batch_size=8, rows=slice(0, 8), start_step=5,
                                           num_steps=3))
    for got, want in zip(batches, expected, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    evaluation = splits.open_eval(data, setting="auto")
    assert isinstance(evaluation.rows, in_memory.MappedRows)


# --- Bad input: one line, exit 2, nothing written -----------------------------------------


def _prepare_cli(tmp_path: Path, files: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jdp.text", "prepare", f"--files={files}",
                           "--tokenizer=bytes", f"--out={tmp_path / 'out' / 'tokens'}", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def _fails_in_one_line(proc: subprocess.CompletedProcess, tmp_path: Path, *found: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jdp.text: error:"), proc.stderr[-2000:]
    for text in found:
        assert text in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def _bad_inputs(root: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"body": ["x"], "id": [1]}), root / "no_field.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), root / "ints.parquet")
    (root / "not_a_dataset").mkdir()
    (root / "not_a_dataset" / "data.arrow").write_bytes(b"x")
    (root / "garbage.jsonl.gz").write_bytes(b"not gzip at all")
    (root / "garbage.txt.zst").write_bytes(b"not zstd at all")
    whole = gzip.compress("".join(json.dumps({"text": f"line {i} " * 40}) + "\n"
                                  for i in range(3000)).encode())
    (root / "truncated.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    return {
        "parquet_without_the_field": (str(root / "no_field.parquet"),
                                      ("no_field.parquet", "'text'", "'body', 'id'", "Fix:")),
        "parquet_field_not_text": (str(root / "ints.parquet"), ("ints.parquet", "int64")),
        "hf_disk_not_a_saved_dataset": (f"hf_disk:{root / 'not_a_dataset'}",
                                        ("not_a_dataset", "save_to_disk", "Fix:")),
        "unreadable_gzip": (str(root / "garbage.jsonl.gz"), ("garbage.jsonl.gz", "Fix:")),
        "unreadable_zstd": (str(root / "garbage.txt.zst"), ("garbage.txt.zst", "Fix:")),
        "truncated_gzip": (str(root / "truncated.jsonl.gz"), ("truncated.jsonl.gz", "Fix:")),
    }


@pytest.mark.parametrize("case", ["parquet_without_the_field", "parquet_field_not_text",
                                  "hf_disk_not_a_saved_dataset", "unreadable_gzip",
                                  "unreadable_zstd", "truncated_gzip"])
def test_bad_input_fails_in_one_line_and_writes_nothing(case, tmp_path):
    files, found = _bad_inputs(tmp_path / "in")[case]
    _fails_in_one_line(_prepare_cli(tmp_path, files), tmp_path, *found)


def test_a_run_over_a_parquet_file_without_the_field_fails_at_start(tmp_path):
    from runs import run_main

    files, found = _bad_inputs(tmp_path / "in")["parquet_without_the_field"]
    workdir = tmp_path / "run"
    proc = run_main(f"--config={GPT}", f"--workdir={workdir}", f"--config.data.text_files={files}",
                    "--config.data.tokenizer=bytes")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jdp: error:") and "Traceback" not in proc.stderr
    for text in found:
        assert text in last, last
    assert not (workdir / "tokens").exists() and not (workdir / "config.json").exists()


def test_progress_shows_documents_rate_and_an_eta_from_the_new_work_alone():
    state = shards.Progress(documents=1200, text_bytes=50_000_000, input_done=60_000_000,
                            input_reused=10_000_000, input_total=110_000_000, elapsed_s=10.0,
                            shards_total=11, shards_reused=1, shards_tokenized=5)
    line = state.line("DIR")
    # 50 MB of input done in 10 s by this build (10 MB were reused): 50 MB left, 10 s.
    assert line.startswith("tokenizing into DIR: 1,200 documents, 50.0 MB of text at "
                           "5.0 MB/s, 55% of 110.0 MB of input (6 of 11 shards, 1 reused)")
    assert line.endswith("ETA 0m10s")


def test_prepare_prints_its_progress_on_the_command_line(formats, tmp_path):
    proc = _prepare_cli(tmp_path, formats["parquet"], "--processes=2", "--eval_fraction=0.2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "documents" in last and "MB/s" in last and "done" in last, proc.stderr
    assert f"--config.data.token_dir={tmp_path / 'out' / 'tokens'}" in proc.stdout
