"""Language-model data from text: tokenizers, the corpus, the token store and packed windows.

Everything runs on tiny corpora in tmp_path; no JAX.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from jdp.data.text import corpus, shards, store, windows
from jdp.data.text.store import open_store, prepare, prepare_split, wait_for_store
from jdp.data.text.tokenizers import ByteTokenizer, from_spec, train_tokenizer
from jdp.data.text.windows import PackedWindows, bits_per_byte, target_tokens_and_bytes
from jdp.errors import ConfigError

EOS = ByteTokenizer.eos_id
# Text that trips tokenizers: leading/trailing and runs of spaces, tabs, CRLF, a lone CR,
# NUL, emoji, combining marks, CJK, and the spelling of special tokens.
TRICKY = ("  lead\ttab\t\tend  \r\nwin\rcr\x00nul 😀👍🏽 e\u0301 中文 ﬁ "
          "</s> <|endoftext|> <unk> <0x41>\n\n\n    deep\n")


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))
    return str(path)


def _one_line_error(info: pytest.ExceptionInfo, *found: str) -> str:
    message = str(info.value)
    assert "\n" not in message
    for text in found:
        assert text in message, message
    return message


def _expected_tokens(documents: list[str]) -> list[int]:
    tokens = [EOS]
    for document in documents:
        tokens += list(document.encode("utf-8")) + [EOS]
    return tokens


@pytest.fixture(scope="module")
def python_corpus(tmp_path_factory) -> list[str]:
    """About 12 KB of Python source in three files, one of them with the tricky text."""
    import json.decoder
    import json.encoder

    directory = tmp_path_factory.mktemp("python_corpus")
    sources = [inspect.getsource(json.encoder)[:6000], inspect.getsource(json.decoder)[:6000]]
    files = [_write(directory / f"m{i}.py", text) for i, text in enumerate(sources)]
    return files + [_write(directory / "tricky.txt", TRICKY)]


@pytest.fixture(scope="module")
def trained_specs(python_corpus, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("tokenizers")
    return {kind: train_tokenizer(python_corpus, vocab_size=400, out=str(out / name), kind=kind)
            for kind, name in (("sentencepiece", "sp.model"), ("bpe", "tokenizer.json"))}


# --- Tokenizers -----------------------------------------------------------------------------


def test_byte_tokenizer_encodes_utf8_bytes_and_round_trips_any_string():
    tokenizer = ByteTokenizer()
    rng = np.random.default_rng(0)
    # Code points from every plane, surrogates included (Python strs may hold them).
    texts = ["", TRICKY, "\x00", "\ud800 lone", "".join(map(chr, rng.integers(0, 0x110000, 500)))]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids.dtype == np.int32
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("é😀").tolist() == list("é😀".encode())
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (257, 256)


def test_byte_decode_skips_eos_and_replaces_invalid_bytes():
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([104, EOS, 105, EOS]) == "hi"
    assert tokenizer.decode([0xFF, 104]) == "\ufffdh"
    with pytest.raises(ValueError):
        tokenizer.decode([257])


@pytest.mark.parametrize("kind", ["sentencepiece", "bpe"])
def test_trained_tokenizer_round_trips_its_corpus_exactly(kind, python_corpus, trained_specs):
    spec = trained_specs[kind]
    assert spec.startswith("sentencepiece:" if kind == "sentencepiece" else "hf:")
    tokenizer = from_spec(spec)
    assert 256 < tokenizer.vocab_size <= 400
    for path in python_corpus:
        for document in corpus.iter_documents(path):
            ids = tokenizer.encode(document)
            assert tokenizer.decode(ids) == document
            # Special tokens' spellings in the text are text, not the end of a document.
            assert tokenizer.eos_id not in ids.tolist()
    text = Path(python_corpus[0]).read_text()
    assert len(tokenizer.encode(text)) < 0.7 * len(text.encode())  # it learned merges
    assert [a.tolist() for a in tokenizer.encode_batch([text, TRICKY])] == [
        tokenizer.encode(text).tolist(), tokenizer.encode(TRICKY).tolist()]


def test_file_tokenizer_identity_hashes_content_not_path(trained_specs, tmp_path):
    path = trained_specs["bpe"].split(":", 1)[1]
    copy = tmp_path / "copy.json"
    copy.write_bytes(Path(path).read_bytes())
    original, copied = from_spec(f"hf:{path}"), from_spec(f"hf:{copy}")
    assert original.identity["sha256"] == copied.identity["sha256"]
    assert original.identity["path"] != copied.identity["path"]
    assert json.loads(json.dumps(original.identity)) == original.identity
    sentencepiece = from_spec(trained_specs["sentencepiece"])
    assert sentencepiece.identity["sha256"] != original.identity["sha256"]
    assert pickle.loads(pickle.dumps(sentencepiece)).encode(TRICKY).tolist() == \
        sentencepiece.encode(TRICKY).tolist()


def test_from_spec_rejects_an_unknown_scheme_in_one_line():
    with pytest.raises(ConfigError) as info:
        from_spec("gpt2")
    _one_line_error(info, "config.data.tokenizer='gpt2'", "bytes", "sentencepiece:PATH", "Fix:")


def test_from_spec_rejects_a_missing_or_unreadable_file_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as info:
        from_spec(f"hf:{tmp_path}/none.json", field="data.eval_tokenizer")
    _one_line_error(info, "config.data.eval_tokenizer=", "none.json", "Fix:")
    garbage = _write(tmp_path / "bad.model", "not a model")
    with pytest.raises(ConfigError) as info:
        from_spec(f"sentencepiece:{garbage}")
    _one_line_error(info, "config.data.tokenizer=", "cannot load", "Fix:")


def test_too_small_a_vocabulary_names_the_field_and_the_size_needed(python_corpus, tmp_path):
    with pytest.raises(ConfigError) as info:
        train_tokenizer(python_corpus, vocab_size=270, out=str(tmp_path / "sp.model"))
    _one_line_error(info, "config.data.vocab_size=270", "at least", "Fix:")
    assert not list(tmp_path.iterdir())  # no half-written model


# --- Corpus ---------------------------------------------------------------------------------


def test_expand_files_without_a_match_names_field_and_pattern(tmp_path):
    pattern = str(tmp_path / "*.txt")
    with pytest.raises(ConfigError) as info:
        corpus.expand_files(pattern, "data.text_files")
    _one_line_error(info, f"config.data.text_files={pattern!r}", "no file matches", "Fix:")


def test_expand_files_takes_a_comma_list_of_recursive_globs_sorted_once(tmp_path):
    b = _write(tmp_path / "b.txt", "b")
    a = _write(tmp_path / "deep" / "er" / "a.md", "a")
    c = _write(tmp_path / "c.jsonl", '{"text": "c"}\n')
    pattern = f"{tmp_path}/**/*.md, {tmp_path}/*.txt,{tmp_path}/*.jsonl,{tmp_path}/b.*"
    assert corpus.expand_files(pattern, "data.text_files") == sorted([a, b, c])


def test_expand_files_rejects_other_kinds_of_file(tmp_path):
    _write(tmp_path / "a.txt", "a")
    _write(tmp_path / "data.csv", "x,y")
    with pytest.raises(ConfigError) as info:
        corpus.expand_files(f"{tmp_path}/*", "data.text_files")
    _one_line_error(info, "data.csv", ".txt, .md, .py, .jsonl", "Fix:")


def test_text_file_is_one_document_as_written(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"line\r\nnext\rx \xff end")
    assert list(corpus.iter_documents(str(path))) == ["line\r\nnext\rx \ufffd end"]
    assert list(corpus.iter_documents(_write(tmp_path / "empty.md", ""))) == []


def test_jsonl_documents_are_the_text_fields_of_its_lines(tmp_path):
    lines = [json.dumps({"text": "one\nline", "id": 1}), "", json.dumps({"text": ""}),
             json.dumps({"text": "lone \ud800"}), json.dumps({"text": "😀"})]
    path = _write(tmp_path / "a.jsonl", "\n".join(lines) + "\n")
    assert list(corpus.iter_documents(path)) == ["one\nline", "lone \ufffd", "😀"]


def test_jsonl_line_without_a_text_string_names_file_and_line(tmp_path):
    path = _write(tmp_path / "a.jsonl", '{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(ConfigError) as info:
        list(corpus.iter_documents(path))
    _one_line_error(info, f"{path}:3", "text field 'text'", "its fields: 'body'", "Fix:")
    path = _write(tmp_path / "b.jsonl", '{"text": 3}\n')
    with pytest.raises(ConfigError, match="b.jsonl:1"):
        list(corpus.iter_documents(path))


def test_stdlib_corpus_is_several_megabytes_of_python_without_tests():
    files = corpus.stdlib_files()
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    assert sum(os.path.getsize(f) for f in files) > 4_000_000
    parts = {part for f in files for part in Path(f).parts}
    assert not parts & {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    assert any(f.endswith(os.path.join("json", "decoder.py")) for f in files)
    assert corpus.expand_files("stdlib", "data.text_files") == files


# --- Token store ----------------------------------------------------------------------------


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the texts it encodes."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode_batch(self, texts):
        self.encoded += len(texts)
        return super().encode_batch(texts)


def _small_corpus(tmp_path: Path) -> tuple[list[str], list[str]]:
    """Files and, in order, their documents (multi-byte text, an empty one skipped)."""
    documents = ["héllo\n", "wörld 😀", "x", "last one\n"]
    files = [_write(tmp_path / "in" / "a.txt", documents[0]),
             _write(tmp_path / "in" / "b.jsonl", "\n".join(json.dumps({"text": t}) for t in
                                                           [documents[1], "", documents[2]])),
             _write(tmp_path / "in" / "c.md", documents[3]),
             _write(tmp_path / "in" / "d.txt", "")]
    return files, documents


def test_store_holds_documents_each_followed_by_eos_with_exact_counts(tmp_path):
    files, documents = _small_corpus(tmp_path)
    reports = []
    prepared = prepare(files, ByteTokenizer(), str(tmp_path / "store"), progress=reports.append)

    last = reports[-1]
    assert last.finished and (last.documents, last.text_bytes) == (
        4, sum(len(d.encode()) for d in documents))
    assert last.input_done == last.input_total == sum(map(os.path.getsize, files))
    assert "4 documents" in last.line("store") and "done" in last.line("store")
    assert prepared.tokens.tolist() == _expected_tokens(documents)
    assert prepared.tokens.dtype == np.uint16
    lengths = [len(d.encode()) + 1 for d in documents]
    assert prepared.document_starts.tolist() == np.cumsum([1] + lengths).tolist()
    assert [ByteTokenizer().decode(prepared.document(i)) for i in range(4)] == documents
    assert prepared.num_bytes == sum(len(d.encode()) for d in documents)
    assert (prepared.num_documents, prepared.num_tokens) == (4, len(_expected_tokens(documents)))
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert [f["path"] for f in manifest["files"]] == files
    assert manifest["files"][0]["bytes"] == len(documents[0].encode())
    assert manifest["tokenizer"]["kind"] == "bytes"
    assert open_store(str(tmp_path / "store")).tokens.tolist() == prepared.tokens.tolist()


def test_store_uses_uint32_for_vocabularies_over_uint16(tmp_path):
    class Wide(ByteTokenizer):
        vocab_size = 70_000
        eos_id = 69_999

    prepared = prepare([_write(tmp_path / "a.txt", "ab")], Wide(), str(tmp_path / "store"))
    assert prepared.tokens.dtype == np.uint32
    assert prepared.tokens.tolist() == [69_999, 97, 98, 69_999]


def test_second_prepare_reuses_the_store_without_tokenizing(tmp_path):
    files, _ = _small_corpus(tmp_path)
    tokenizer = CountingTokenizer()
    prepare(files, tokenizer, str(tmp_path / "store"))
    assert tokenizer.encoded == 4
    tokens_file = tmp_path / "store" / "tokens.bin"
    before = tokens_file.stat().st_mtime_ns
    again = prepare(files, tokenizer, str(tmp_path / "store"))
    assert tokenizer.encoded == 4
    assert tokens_file.stat().st_mtime_ns == before
    assert again.num_documents == 4


def test_changed_input_is_refused_in_one_line_and_rebuilt_on_request(tmp_path):
    files, documents = _small_corpus(tmp_path)
    directory = str(tmp_path / "store")
    prepare(files, ByteTokenizer(), directory)
    _write(Path(files[0]), "changed\n")
    with pytest.raises(ConfigError) as info:
        prepare(files, ByteTokenizer(), directory)
    _one_line_error(info, directory, "1 file changed", "a.txt", "rebuild_tokens=true",
                    "token_dir")
    rebuilt = prepare(files, ByteTokenizer(), directory, rebuild=True)
    assert rebuilt.tokens.tolist() == _expected_tokens(["changed\n"] + documents[1:])
    assert open_store(directory).num_bytes == rebuilt.num_bytes
    assert sorted(os.listdir(tmp_path)) == ["in", "store"]  # nothing set aside is left
    with pytest.raises(ConfigError) as info:
        prepare(files[:2], ByteTokenizer(), directory)
    _one_line_error(info, "2 files removed")


def test_store_of_another_tokenizer_is_refused(tmp_path, trained_specs):
    files, _ = _small_corpus(tmp_path)
    prepare(files, ByteTokenizer(), str(tmp_path / "store"))
    with pytest.raises(ConfigError) as info:
        prepare(files, from_spec(trained_specs["bpe"]), str(tmp_path / "store"))
    _one_line_error(info, "tokenizer differs", "bytes", "hf sha256")


@pytest.mark.parametrize("damage", ["truncate_tokens", "drop_manifest", "garble_manifest",
                                    "drop_documents", "garble_documents"])
def test_torn_store_is_refused_as_corrupt(tmp_path, damage):
    files, documents = _small_corpus(tmp_path)
    directory = tmp_path / "store"
    prepare(files, ByteTokenizer(), str(directory))
    if damage == "truncate_tokens":
        with open(directory / "tokens.bin", "r+b") as f:
            f.truncate(10)
    elif damage == "drop_manifest":
        (directory / "manifest.json").unlink()
    elif damage == "garble_manifest":
        (directory / "manifest.json").write_text('{"format": "jdp.text.token_')
    elif damage == "drop_documents":
        (directory / "documents.npy").unlink()
    else:  # right length and ends, but an empty document in the middle
        starts = np.load(directory / "documents.npy")
        starts[2] = starts[1]
        np.save(directory / "documents.npy", starts)
    for attempt in (lambda: open_store(str(directory)),
                    lambda: prepare(files, ByteTokenizer(), str(directory))):
        with pytest.raises(ConfigError) as info:
            attempt()
        _one_line_error(info, f"token store {directory} is corrupt", "rebuild_tokens=true")
    repaired = prepare(files, ByteTokenizer(), str(directory), rebuild=True)
    assert repaired.tokens.tolist() == _expected_tokens(documents)


_KILLED_PREPARE = """
import os, signal, sys
from jdp.data.text import shards, store, tokenizers
shards.SHARD_BYTES = int(sys.argv[2])
class Dies(tokenizers.ByteTokenizer):
    calls = 0
    def encode_batch(self, texts):  # once per shard here: SIGKILL in the middle of one
        Dies.calls += 1
        if Dies.calls == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().encode_batch(texts)
store.prepare(sys.argv[4:], Dies(), sys.argv[1], processes=1)
"""


def test_prepare_killed_midway_resumes_from_its_finished_shards_only(tmp_path, monkeypatch):
    files, documents = _jsonl_corpus(tmp_path, 200)
    directory = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", _KILLED_PREPARE, str(directory), "1024", "4",
                           *files], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert not directory.exists()
    with pytest.raises(TimeoutError) as info:
        wait_for_store(str(directory), timeout_s=0.2, poll_s=0.05)
    _one_line_error(info, str(directory), "did not appear")
    work = tmp_path / "store.shards"
    names = sorted(os.listdir(work))
    assert [n for n in names if n.startswith("shard-") and "." not in n] == [
        "shard-000000", "shard-000001", "shard-000002"]
    assert any(n.startswith("shard-000003.tmp-") for n in names)  # half-written: not trusted
    # A finished shard whose tokens did not all reach the disk (a machine crash) is
    # tokenized again, as the unfinished ones are.
    with open(work / "shard-000001" / "all.bin", "r+b") as f:
        f.truncate(4)
    kept_documents = sum(
        json.loads((work / name / "shard.json").read_text())["outputs"]["all"]["documents"]
        for name in ("shard-000000", "shard-000002"))

    monkeypatch.setattr(shards, "SHARD_BYTES", 1024)  # the same plan as the killed build
    tokenizer, reports = CountingTokenizer(), []
    prepared = prepare(files, tokenizer, str(directory), processes=1, progress=reports.append)
    total = reports[-1].shards_total
    assert total >= 6
    assert (reports[-1].shards_reused, reports[-1].shards_tokenized) == (2, total - 2)
    assert tokenizer.encoded == len(documents) - kept_documents  # only the shards redone
    assert prepared.tokens.tolist() == _expected_tokens(documents)
    assert sorted(os.listdir(tmp_path)) == ["in", "store"]  # shards and temp dirs are gone


class BarrierTokenizer(ByteTokenizer):
    """Holds each thread's first batch until both threads are building."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier
        self.local = threading.local()

    def encode_batch(self, texts):
        if not getattr(self.local, "waited", False):
            self.local.waited = True
            self.barrier.wait(timeout=10)
        return super().encode_batch(texts)


def test_two_concurrent_prepares_both_end_with_the_same_valid_store(tmp_path):
    files, documents = _small_corpus(tmp_path)
    tokenizer = BarrierTokenizer(threading.Barrier(2))
    results: list = [None, None]

    def run(i: int) -> None:
        try:
            results[i] = prepare(files, tokenizer, str(tmp_path / "store"))
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for result in results:
        assert isinstance(result, store.TokenStore), result
        assert result.tokens.tolist() == _expected_tokens(documents)
    assert sorted(os.listdir(tmp_path)) == ["in", "store"]  # the loser's temp dir is gone


def test_empty_corpus_is_a_config_error(tmp_path):
    files = [_write(tmp_path / "a.txt", ""), _write(tmp_path / "b.jsonl", '{"text": ""}\n')]
    with pytest.raises(ConfigError) as info:
        prepare(files, ByteTokenizer(), str(tmp_path / "store"), field="data.train_files")
    _one_line_error(info, "config.data.train_files", "no text", "Fix:")
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.jsonl"]


def test_wait_for_store_returns_a_prepared_store(tmp_path):
    files, _ = _small_corpus(tmp_path)
    prepare(files, ByteTokenizer(), str(tmp_path / "store"))
    assert wait_for_store(str(tmp_path / "store"), timeout_s=1).num_documents == 4


def _jsonl_corpus(tmp_path: Path, count: int) -> tuple[list[str], list[str]]:
    documents = [f"document {i}: " + "ü" * (i % 7) for i in range(count)]
    half = count // 2
    files = [_write(tmp_path / "in" / name, "\n".join(json.dumps({"text": t}) for t in part))
             for name, part in (("a.jsonl", documents[:half]), ("b.jsonl", documents[half:]))]
    return files, documents


def _texts(prepared: store.TokenStore) -> list[str]:
    return [ByteTokenizer().decode(prepared.document(i)) for i in range(prepared.num_documents)]


def test_eval_split_holds_out_documents_by_content_deterministically(tmp_path):
    files, documents = _jsonl_corpus(tmp_path, 200)
    train, eval_ = prepare_split(files, ByteTokenizer(), str(tmp_path / "s1"), eval_fraction=0.25)
    held_out = {d for d in documents
                if int.from_bytes(hashlib.blake2b(d.encode(), digest_size=8).digest(),
                                  "little") < 0.25 * 2**64}
    assert set(_texts(eval_)) == held_out and 20 < len(held_out) < 80
    assert _texts(train) == [d for d in documents if d not in held_out]  # in input order
    assert train.num_documents + eval_.num_documents == 200
    assert train.num_bytes + eval_.num_bytes == sum(len(d.encode()) for d in documents)
    assert eval_.num_bytes == sum(len(d.encode()) for d in held_out)
    # The same choice with the files in another order (and another directory).
    _, again = prepare_split(files[::-1], ByteTokenizer(), str(tmp_path / "s2"),
                             eval_fraction=0.25)
    assert set(_texts(again)) == held_out
    assert store.open_split(str(tmp_path / "s1"))[1].num_documents == eval_.num_documents
    with pytest.raises(ConfigError, match="eval_fraction differs"):
        prepare(files, ByteTokenizer(), str(tmp_path / "s1"))


def test_eval_split_needs_documents_on_both_sides(tmp_path):
    files = [_write(tmp_path / "one.txt", "a single document")]
    with pytest.raises(ConfigError) as info:
        prepare_split(files, ByteTokenizer(), str(tmp_path / "store"), eval_fraction=0.5)
    _one_line_error(info, "config.data.eval_fraction=0.5", "split got none", "Fix:")


def test_store_pickles_without_its_tokens(tmp_path):
    files = [_write(tmp_path / "big.txt", "x" * 100_000)]
    prepared = prepare(files, ByteTokenizer(), str(tmp_path / "store"))
    _ = prepared.tokens[5]
    data = pickle.dumps(prepared)
    assert len(data) < 5_000
    assert np.array_equal(pickle.loads(data).tokens, prepared.tokens)


# --- Windows --------------------------------------------------------------------------------


def _byte_store(tmp_path: Path, documents: list[str]) -> store.TokenStore:
    text = "\n".join(json.dumps({"text": d}) for d in documents)
    return prepare([_write(tmp_path / "docs.jsonl", text)], ByteTokenizer(),
                   str(tmp_path / "store"))


def _random_store(tmp_path: Path, seed: int = 0) -> store.TokenStore:
    rng = np.random.default_rng(seed)
    documents = ["".join(rng.choice(list("abcdé😀 \n"), int(n)))
                 for n in rng.integers(1, 30, size=40)]
    return _byte_store(tmp_path, documents)


def test_windows_have_fixed_shapes_and_dtypes_and_shifted_targets(tmp_path):
    prepared = _random_store(tmp_path)
    source = PackedWindows(prepared, 16)
    assert len(source) == (prepared.num_tokens - 1) // 16
    dtypes = {"inputs": np.int32, "targets": np.int32, "weights": np.float32,
              "segment_ids": np.int32, "positions": np.int32}
    for i in (0, 3, len(source) - 1):
        example = source[i]
        assert {k: (v.shape, v.dtype) for k, v in example.items()} == {
            k: ((16,), np.dtype(d)) for k, d in dtypes.items()}
        window = np.asarray(prepared.tokens[i * 16:i * 16 + 17], np.int32)
        assert np.array_equal(example["inputs"], window[:-1])
        assert np.array_equal(example["targets"], window[1:])
        assert np.all(example["weights"] == 1)
    assert set(PackedWindows(prepared, 16, document_mask=False)[0]) == {"inputs", "targets",
                                                                        "weights"}


def test_window_contents_at_a_document_boundary(tmp_path):
    # tokens: E a b E c d e E f E (E = eos)
    source = PackedWindows(_byte_store(tmp_path, ["ab", "cde", "f"]), 4, pad_last=True)
    a, b, c, d, e, f = (ord(x) for x in "abcdef")
    expected = [
        {"inputs": [EOS, a, b, EOS], "targets": [a, b, EOS, c], "weights": [1, 1, 1, 1],
         "segment_ids": [1, 1, 1, 2], "positions": [0, 1, 2, 0]},
        {"inputs": [c, d, e, EOS], "targets": [d, e, EOS, f], "weights": [1, 1, 1, 1],
         "segment_ids": [1, 1, 1, 2], "positions": [0, 1, 2, 0]},
        {"inputs": [f, 0, 0, 0], "targets": [EOS, 0, 0, 0], "weights": [1, 0, 0, 0],
         "segment_ids": [1, 0, 0, 0], "positions": [0, 0, 0, 0]},
    ]
    assert len(source) == 3
    assert len(PackedWindows(source.store, 4)) == 2  # without pad_last: full windows only
    for i, want in enumerate(expected):
        assert {k: v.tolist() for k, v in source[i].items()} == want


def test_segments_and_positions_follow_documents_and_restart_at_eos(tmp_path):
    prepared = _random_store(tmp_path)
    tokens = np.asarray(prepared.tokens)
    # Input token p belongs to the document its latest eos (at or before p) begins.
    document_of = np.cumsum(tokens == EOS) - 1
    seq_len = 7
    source = PackedWindows(prepared, seq_len)
    for i in range(len(source)):
        example = source[i]
        offsets = i * seq_len + np.arange(seq_len)
        documents = document_of[offsets]
        same_segment = example["segment_ids"][:, None] == example["segment_ids"][None, :]
        assert np.array_equal(same_segment, documents[:, None] == documents[None, :])
        assert example["segment_ids"][0] == 1
        # Positions count from the document's eos, or from the window's first token.
        eos_at = np.array([max(i * seq_len, np.flatnonzero(tokens[:p + 1] == EOS)[-1])
                           for p in offsets])
        assert np.array_equal(example["positions"], offsets - eos_at)


@pytest.mark.parametrize("pad_last", [False, True])
@pytest.mark.parametrize("document_mask", [False, True])
def test_get_batch_equals_stacked_examples(tmp_path, pad_last, document_mask):
    source = PackedWindows(_random_store(tmp_path), 9, document_mask=document_mask,
                           pad_last=pad_last)
    indices = np.array([len(source) - 1, 0, 5, 5, 2])
    batch = source.get_batch(indices)
    stacked = [source[int(i)] for i in indices]
    assert batch.keys() == stacked[0].keys()
    for key, value in batch.items():
        expected = np.stack([example[key] for example in stacked])
        assert value.dtype == expected.dtype and np.array_equal(value, expected), key
    with pytest.raises(IndexError):
        source.get_batch(np.array([len(source)]))


def test_pad_last_evaluates_every_target_exactly_once(tmp_path):
    prepared = _random_store(tmp_path)
    assert (prepared.num_tokens - 1) % 16 != 0  # so the last window is padded
    source = PackedWindows(prepared, 16, pad_last=True)
    assert len(source) == math.ceil((prepared.num_tokens - 1) / 16)
    batch = source.get_batch(np.arange(len(source)))
    weighted = batch["weights"].reshape(-1) == 1
    assert np.array_equal(batch["targets"].reshape(-1)[weighted], np.asarray(prepared.tokens[1:]))
    assert np.all(batch["weights"].reshape(-1)[~weighted] == 0)
    assert np.all(batch["segment_ids"].reshape(-1)[~weighted] == 0)
    assert weighted[:-16].all()  # padding only in the last window


def test_windows_pickle_without_data_and_reopen(tmp_path):
    source = PackedWindows(_byte_store(tmp_path, ["x" * 50_000]), 32, pad_last=True)
    first = source[3]
    data = pickle.dumps(source)
    assert len(data) < 5_000
    restored = pickle.loads(data)
    assert all(np.array_equal(restored[3][key], first[key]) for key in first)
    assert len(restored) == len(source)


def test_target_tokens_and_bytes_are_exact(tmp_path):
    documents = ["héllo", "😀 wörld\n", "z"]
    source = PackedWindows(_byte_store(tmp_path, documents), 5, pad_last=True)
    tokens, num_bytes = target_tokens_and_bytes(source)
    assert num_bytes == sum(len(d.encode()) for d in documents)
    assert tokens == int(source.get_batch(np.arange(len(source)))["weights"].sum())
    assert tokens == num_bytes + len(documents)  # bytes, and each document's closing eos
    assert windows.tokens_per_byte(source) == tokens / num_bytes
    assert bits_per_byte(math.log(2) * num_bytes / tokens, tokens, num_bytes) == pytest.approx(1)
    with pytest.raises(ValueError, match="pad_last"):
        target_tokens_and_bytes(PackedWindows(source.store, 5))


def test_windows_over_a_too_short_store_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        PackedWindows(_byte_store(tmp_path, ["ab"]), 8)
    _one_line_error(info, "seq_len=8", "Fix:")

