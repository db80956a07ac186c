"""Tokenizers for language modelling on text: bytes, SentencePiece and Hugging Face.

A `Tokenizer` turns a document into int32 ids and back and has an end-of-document
id (`eos_id`) that the token store puts after every document. `from_spec` builds one
from the config string ("bytes", "sentencepiece:PATH", "hf:PATH", or "hf_dir:DIR", the
tokenizer.json of a transformers model directory) and
`train_tokenizer` trains a SentencePiece or byte-level BPE model on the user's own
files, offline. `identity` is what a token store records to tell whether it was made
by the same tokenizer: the kind and a hash of the model file's content.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import io
import os
import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from jdp.errors import ConfigError

SCHEMES = ("bytes", "sentencepiece:PATH", "hf:PATH", "hf_dir:DIR")
KINDS = ("sentencepiece", "bpe")
# The end-of-document token of the byte-level BPE that `train_tokenizer` writes.
HF_EOS = "<|endoftext|>"
# Names a tokenizer.json may give its end-of-document token, most common first
# (GPT-2 style, T5/Llama-2 style, Llama-3 style, Gemma style).
_HF_EOS_CANDIDATES = (HF_EOS, "</s>", "<|end_of_text|>", "<eos>")
# SentencePiece training reads sentences of at most this many bytes; documents are
# cut at line ends into pieces of about this size (a piece is never split further).
_SP_SENTENCE_BYTES = 1 << 14
# At most this many pieces are sampled for SentencePiece training (it holds them in memory).
_SP_MAX_SENTENCES = 2_000_000
_SEED = 0
# Whether this process tokenizes with one thread (`use_one_thread`): a process of a
# parallel token-store build, where the processes are the parallelism.
_one_thread = False


def use_one_thread() -> None:
    """From now on this process's tokenizers encode batches with one thread: Hugging Face
    tokenizers read TOKENIZERS_PARALLELISM at each call, SentencePiece gets num_threads=1."""
    global _one_thread
    _one_thread = True
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


@contextlib.contextmanager
def one_thread():
    """`use_one_thread` for the duration of the block (then as before)."""
    global _one_thread
    saved = _one_thread, os.environ.get("TOKENIZERS_PARALLELISM")
    use_one_thread()
    try:
        yield
    finally:
        _one_thread = saved[0]
        if saved[1] is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved[1]


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer(abc.ABC):
    """Text <-> int32 ids, with an end-of-document id that no text encodes to.

    `encode` treats its text as plain text: a special token's spelling inside it
    (e.g. "</s>") is encoded as ordinary characters, so the only `eos_id` in a token
    store are the separators the store adds. `decode` skips special tokens.
    """

    vocab_size: int
    eos_id: int
    spec: str

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """The int32 ids of `text` (no eos added)."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens skipped."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text; tokenizers with a faster (parallel) batch path override it."""
        return [self.encode(text) for text in texts]

    @property
    @abc.abstractmethod
    def identity(self) -> dict:
        """JSON-able: kind, path, sha256 of the model file, vocab_size and eos_id."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes of the text; 256 is eos; vocab_size is 257.

    decode(encode(t)) == t for every str: lone surrogates, which have no UTF-8 form,
    are written as their "surrogatepass" bytes (text read by `corpus` never has any).
    Other invalid byte sequences decode to U+FFFD.
    """

    vocab_size = 257
    eos_id = 256
    spec = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {ids.min()}..{ids.max()}")
        data = ids[ids < 256].astype(np.uint8).tobytes()
        try:
            return data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return data.decode("utf-8", "replace")

    @property
    def identity(self) -> dict:
        return {"kind": "bytes", "path": None, "sha256": None,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class _FileTokenizer(Tokenizer):
    """A tokenizer loaded from one model file; pickles as its path (and reloads)."""

    kind: str

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.sha256 = _file_sha256(self.path)
        self.spec = f"{self.kind}:{path}"

    def __reduce__(self):
        return type(self), (self.path,)

    @property
    def identity(self) -> dict:
        return {"kind": self.kind, "path": self.path, "sha256": self.sha256,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class SentencePieceTokenizer(_FileTokenizer):
    """A SentencePiece `.model`; its eos is the model's own (`</s>` by default).

    A model trained by `train_tokenizer` round-trips any text except the character
    U+2581 ("▁"), which SentencePiece uses for the space and so decodes as " ".
    """

    kind = "sentencepiece"

    def __init__(self, path: str) -> None:
        import sentencepiece

        super().__init__(path)
        self._processor = sentencepiece.SentencePieceProcessor(model_file=self.path)
        self.vocab_size = int(self._processor.get_piece_size())
        self.eos_id = int(self._processor.eos_id())
        if self.eos_id < 0:
            raise ValueError(f"the SentencePiece model {self.path} has no eos piece (it was "
                             "trained with eos_id=-1); train one with an eos, e.g. with "
                             "jdp.data.text.tokenizers.train_tokenizer")

    @property
    def eos_token(self) -> str:
        """The spelling of the end-of-document piece."""
        return self._processor.id_to_piece(self.eos_id)

    @property
    def unk_token(self) -> str:
        return self._processor.id_to_piece(self._processor.unk_id())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._processor.encode(text), np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # num_threads=-1: as many threads as cores, in SentencePiece's C++ code.
        encoded = self._processor.encode(list(texts), num_threads=1 if _one_thread else -1)
        return [np.asarray(ids, np.int32) for ids in encoded]

    def decode(self, ids: Iterable[int]) -> str:
        # Control pieces (eos) decode to nothing.
        return self._processor.decode([int(i) for i in ids])


class HfTokenizer(_FileTokenizer):
    """A Hugging Face `tokenizer.json`; its eos is the first of <|endoftext|>, </s>,
    <|end_of_text|>, <eos> that it has. Special tokens' spellings in the text are
    encoded as text (`encode_special_tokens`), not as the special tokens."""

    kind = "hf"

    def __init__(self, path: str) -> None:
        import tokenizers

        super().__init__(path)
        self._tokenizer = tokenizers.Tokenizer.from_file(self.path)
        self._tokenizer.encode_special_tokens = True
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        for name in _HF_EOS_CANDIDATES:
            eos_id = self._tokenizer.token_to_id(name)
            if eos_id is not None:
                self.eos_id = int(eos_id)
                break
        else:
            raise ValueError(f"the tokenizer {self.path} has none of the end-of-document "
                             f"tokens {list(_HF_EOS_CANDIDATES)}; add one as a special token")

    @property
    def eos_token(self) -> str:
        """The spelling of the end-of-document token."""
        return self._tokenizer.id_to_token(self.eos_id)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch_fast computes no character offsets: about 30% faster.
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [np.asarray(e.ids, np.int32) for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


_FILE_KINDS = {"sentencepiece": SentencePieceTokenizer, "hf": HfTokenizer}
_FILE_FIXES = {"sentencepiece": "point it at a SentencePiece .model file",
               "hf": "point it at a Hugging Face tokenizer.json"}


def trained_vocab_size(spec: str) -> int | None:
    """N for a spec "bpe:N" (a byte-level BPE of N ids trained on the run's own training
    text when its token store is prepared, `trained_path`); None for other specs."""
    scheme, sep, size = str(spec).partition(":")
    if scheme != "bpe" or not sep:
        return None
    if not size.isdigit() or int(size) < _MIN_VOCAB["bpe"]:
        raise ConfigError(f"config.data.tokenizer={spec!r}: 'bpe:' takes a vocabulary size of at "
                          f"least {_MIN_VOCAB['bpe']}. Fix: e.g. --config.data.tokenizer=bpe:4096.")
    return int(size)


def trained_path(spec: str, directory: str) -> str:
    """Where the tokenizer of a "bpe:N" spec is kept: beside the token stores."""
    return os.path.join(directory, f"bpe-{trained_vocab_size(spec)}.json")


def from_spec(spec: str, field: str = "data.tokenizer", directory: str | None = None) -> Tokenizer:
    """The tokenizer of "bytes", "sentencepiece:PATH", "hf:PATH", "hf_dir:DIR" or "bpe:N"
    (trained into `directory` when the store was prepared); ConfigError otherwise."""
    where = f"config.{field}={spec!r}"
    if spec == "bytes":
        return ByteTokenizer()
    if trained_vocab_size(spec) is not None:
        path = trained_path(spec, directory or "")
        if directory is None or not os.path.isfile(path):
            raise ConfigError(f"{where}: the tokenizer trained for this run is not in "
                              f"{directory or 'the token directory'}. Fix: prepare the run's "
                              "token store first (train, or python -m jdp.text prepare).")
        return HfTokenizer(path)
    scheme, sep, path = str(spec).partition(":")
    if scheme == "hf_dir" and path:  # a transformers model directory: its tokenizer.json,
        # else its SentencePiece tokenizer.model
        sentencepiece_model = os.path.join(os.path.expanduser(path), "tokenizer.model")
        scheme, path = (("sentencepiece", sentencepiece_model) if os.path.isfile(
            sentencepiece_model) and not os.path.isfile(os.path.join(
                os.path.expanduser(path), "tokenizer.json"))
            else ("hf", os.path.join(path, "tokenizer.json")))
    if not sep or scheme not in _FILE_KINDS:
        raise ConfigError(f"{where}: unknown tokenizer. Fix: use one of {', '.join(SCHEMES)}, "
                          "or bpe:N.")
    if not path:
        raise ConfigError(f"{where}: no path after '{scheme}:'. Fix: {_FILE_FIXES[scheme]}, "
                          f"e.g. {scheme}:/data/tokenizer.{'model' if scheme != 'hf' else 'json'}.")
    expanded = os.path.expanduser(path)
    if not os.path.isfile(expanded):
        raise ConfigError(f"{where}: no file {expanded}. Fix: {_FILE_FIXES[scheme]} (train one "
                          "with jdp.data.text.tokenizers.train_tokenizer), or use 'bytes'.")
    try:
        return _FILE_KINDS[scheme](expanded)
    except Exception as e:  # noqa: BLE001 - both libraries raise many types for a bad file
        message = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"{where}: cannot load {expanded} ({message}). Fix: "
                          f"{_FILE_FIXES[scheme]}.") from e


def _training_pieces(files: Sequence[str], text_field: str) -> Iterator[str]:
    """The documents of `files`, cut at line ends into pieces of about _SP_SENTENCE_BYTES."""
    from jdp.data.text.corpus import iter_documents

    for path in files:
        for document in iter_documents(path, text_field=text_field):
            piece: list[str] = []
            size = 0
            for line in document.splitlines(keepends=True):
                piece.append(line)
                size += len(line)
                if size >= _SP_SENTENCE_BYTES:
                    yield "".join(piece)
                    piece, size = [], 0
            if piece:
                yield "".join(piece)


def _train_sentencepiece(files: Sequence[str], vocab_size: int, out: str,
                         text_field: str) -> None:
    import sentencepiece

    # Why each option: identity normalisation and no whitespace folding keep the text
    # as written; byte_fallback makes any character encodable, so the rarest characters
    # (beyond the coverage) need no piece of their own; "\n" and "\t" as user-defined
    # pieces keep them whole; no dummy prefix, so a document's first space is its own.
    sentencepiece.set_random_generator_seed(_SEED)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_training_pieces(files, text_field), model_writer=model,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
        character_coverage=0.9995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False,
        allow_whitespace_only_pieces=True, split_digits=True,
        user_defined_symbols=["\n", "\t"], unk_id=0, bos_id=-1, eos_id=1, pad_id=-1,
        max_sentence_length=4 * _SP_SENTENCE_BYTES, input_sentence_size=_SP_MAX_SENTENCES,
        shuffle_input_sentence=True, hard_vocab_limit=False, num_threads=os.cpu_count() or 1,
        minloglevel=2)
    with open(out, "wb") as f:
        f.write(model.getvalue())


def _train_bpe(files: Sequence[str], vocab_size: int, out: str, text_field: str) -> None:
    from tokenizers import Tokenizer as HfModel
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from jdp.data.text.corpus import iter_documents

    # Byte-level: every text is bytes mapped to 256 visible characters, so any text
    # encodes and decodes back exactly; no prefix space, so nothing is added.
    model = HfModel(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[HF_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    model.train_from_iterator((d for path in files
                               for d in iter_documents(path, text_field=text_field)),
                              trainer=trainer)
    model.save(out)


# The smallest vocabularies that hold the base alphabet and the special pieces.
_MIN_VOCAB = {"sentencepiece": 256 + 4 + 1, "bpe": 256 + 1 + 1}


def train_tokenizer(files: Sequence[str], *, vocab_size: int, out: str,
                    kind: str = "sentencepiece", field: str = "data.vocab_size",
                    text_field: str = "text") -> str:
    """Trains a tokenizer on `files` (see `corpus.iter_documents`), writes it to `out` and
    returns its spec for `from_spec`.

    kind="sentencepiece": a SentencePiece BPE `.model` with byte fallback, spec
    "sentencepiece:OUT"; kind="bpe": a byte-level BPE `tokenizer.json` (the GPT-2
    scheme) with the special token <|endoftext|>, spec "hf:OUT". Both round-trip the
    text exactly (SentencePiece: except U+2581, see `SentencePieceTokenizer`); the
    vocabulary may come out smaller than `vocab_size` on a small corpus. `text_field`
    is the field of .jsonl, Parquet and Arrow files that holds the documents.
    """
    from jdp.data.text.corpus import check_files

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: use one of {KINDS}")
    if vocab_size < _MIN_VOCAB[kind]:
        raise ConfigError(f"config.{field}={vocab_size}: too small for a {kind} tokenizer "
                          f"(the bytes and special pieces alone take {_MIN_VOCAB[kind] - 1}). "
                          f"Fix: pass at least {_MIN_VOCAB[kind]}.")
    check_files(list(files), text_field)  # bad input is named before anything is written
    out = os.path.abspath(os.path.expanduser(out))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # Written beside `out`, then renamed: a killed training leaves no half-written model.
    partial = f"{out}.partial-{os.getpid()}"
    try:
        if kind == "sentencepiece":
            try:
                _train_sentencepiece(files, vocab_size, partial, text_field)
            except RuntimeError as e:
                # e.g. "Vocabulary size is smaller than required_chars. 261 vs 324."
                needed = re.search(r"required_chars\. \d+ vs (\d+)", str(e))
                if needed is None:
                    raise
                raise ConfigError(
                    f"config.{field}={vocab_size}: SentencePiece needs at least "
                    f"{needed.group(1)} pieces for these files (the 256 bytes, special pieces "
                    f"and their common characters). Fix: pass at least {needed.group(1)}, or "
                    "train kind='bpe'.") from e
        else:
            _train_bpe(files, vocab_size, partial, text_field)
        os.replace(partial, out)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return f"{'sentencepiece' if kind == 'sentencepiece' else 'hf'}:{out}"
