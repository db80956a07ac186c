"""The kinds of text file jdp reads, each cut into pieces and read piece by piece.

By file name:

- `.txt`, `.md`, `.py`: the file is one document, exactly as written;
- `.jsonl`: one document per line, its `text_field` (default "text");
- those four compressed, `NAME.txt.gz` ... `NAME.jsonl.zst` (gzip or Zstandard):
  the same documents, streamed through the decompressor;
- `.parquet`: one document per row, its `text_field` column, read a row group at a
  time (never the whole file);
- `.arrow`: the files inside a Hugging Face dataset saved with `save_to_disk` (Arrow
  IPC streams; the Arrow file format is read too): one document per row of the
  `text_field` column, a record batch at a time.

An empty or null text is no document. Bytes that are not UTF-8 become U+FFFD, so
every document has an exact UTF-8 form. A file is cut into *pieces*, the units the
token store tokenizes in parallel, each a range [start, stop) in the format's own
unit: bytes of a `.jsonl` (a line belongs to the piece its first byte is in), row
groups of a Parquet file, record batches of an Arrow file; a file of the other kinds
is one piece. Reading a file's pieces in order gives exactly its documents in order.
`check` opens a file cheaply (footer, schema, first block) so that bad input is
named before anything is written. Parquet, Arrow and `.zst` need pyarrow
(`pip install 'jdp[corpora]'`); gs:// paths need gcsfs (`jdp[gcs]`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
import re
from collections.abc import Iterator
from typing import IO

from jdp.errors import ConfigError
from jdp.runtime import storage

PLAIN = (".txt", ".md", ".py")
LINES = (".jsonl",)
COMPRESSIONS = (".gz", ".zst")
COLUMNAR = (".parquet", ".arrow")
SUFFIXES = (*PLAIN, *LINES, *(s + c for s in (*PLAIN, *LINES) for c in COMPRESSIONS), *COLUMNAR)
_INSTALL = "pip install 'jdp[corpora]'"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_FIRST_BLOCK = 1 << 16  # decompressed by `check`: a file that is not gzip/zstd fails here
_ROWS_PER_READ = 256  # rows of a Parquet row group decoded at a time


@dataclasses.dataclass(frozen=True)
class Piece:
    """Units [start, stop) of one file (see the module docstring) and about how many
    bytes of input they hold (for grouping pieces into shards and for progress)."""

    start: int
    stop: int
    size_bytes: int


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def kind(path: str) -> str:
    """'plain', 'lines', 'parquet' or 'arrow' (compressed files are of their inner kind)."""
    name = path.lower()
    for suffix in COMPRESSIONS:
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    if name.endswith(PLAIN):
        return "plain"
    if name.endswith(LINES):
        return "lines"
    return name.rsplit(".", 1)[-1]


def compression(path: str) -> str | None:
    name = path.lower()
    return next((suffix[1:] for suffix in COMPRESSIONS if name.endswith(suffix)), None)


def reads_field(path: str) -> bool:
    """Whether documents of this file come from a field (`text_field` matters)."""
    return kind(path) != "plain"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401 - a submodule, not imported by `import pyarrow`
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"reading Parquet, Arrow and .zst files needs pyarrow ({e}). Fix: "
                          f"{_INSTALL}.") from None
    return pyarrow


def _open(path: str) -> IO[bytes]:
    return storage.open_file(path, "rb")


@contextlib.contextmanager
def _binary_stream(path: str) -> Iterator[IO[bytes]]:
    """The file's bytes, decompressed on the fly where its name says it is compressed."""
    kind_ = compression(path)
    with _open(path) as raw:
        if kind_ == "gz":
            with gzip.GzipFile(fileobj=raw) as stream:
                yield stream
        elif kind_ == "zst":
            pa = _pyarrow()
            with io.BufferedReader(pa.CompressedInputStream(pa.PythonFile(raw, mode="r"),
                                                            "zstd")) as stream:
                yield stream
        else:
            yield raw


def _unreadable(path: str, error: BaseException, field: str) -> ConfigError:
    return ConfigError(_one_line(
        f"config.{field}: cannot read {path} ({type(error).__name__}: {error}). Fix: check the "
        f"file is a whole {compression(path) or kind(path)} file (re-copy or re-compress it), "
        "or leave it out of the glob."))


def _read_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, gzip.BadGzipFile,
                                               UnicodeDecodeError)
    try:
        import pyarrow

        errors += (pyarrow.ArrowException,)
    except ImportError:
        pass
    return errors


def _missing_field(path: str, text_field: str, found: list[str], field: str,
                   where: str = "") -> ConfigError:
    shown = ", ".join(map(repr, found[:12])) + (", ..." if len(found) > 12 else "")
    return ConfigError(_one_line(
        f"config.data.text_field={text_field!r}: {path}{where} has no text field {text_field!r} "
        f"(its fields: {shown or 'none'}). Fix: pass --config.data.text_field=NAME naming the "
        f"field that holds the documents (config.{field} names the files)."))


# --- Plain text and JSON lines ------------------------------------------------------------


def _plain_documents(path: str) -> Iterator[str]:
    with _binary_stream(path) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="").read()
    if text:
        yield text


def _json_text(line: bytes, path: str, number: int | None, text_field: str,
               field: str) -> str | None:
    where = f":{number}" if number is not None else ""
    try:
        record = json.loads(line.decode("utf-8", "replace"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"config.{field}: {path}{where} is not JSON ({e.msg}). Fix: write one "
                          f"JSON object per line, e.g. {{\"{text_field}\": \"...\"}}.") from e
    if not isinstance(record, dict):
        raise ConfigError(_one_line(
            f"config.{field}: {path}{where} is a {type(record).__name__}, not a JSON object. Fix: "
            f"write one JSON object per line with the document in \"{text_field}\"."))
    if text_field not in record:
        raise _missing_field(path, text_field, sorted(record), field, where)
    text = record[text_field]
    if text is None:
        return None
    if not isinstance(text, str):
        raise ConfigError(_one_line(
            f"config.data.text_field={text_field!r}: {path}{where} holds a "
            f"{type(text).__name__} in {text_field!r}, not text. Fix: name a field that holds "
            "the documents as strings."))
    # JSON can escape lone surrogates, which have no UTF-8 form: U+FFFD, as for bytes.
    # (Checked by encoding: ~10x faster than searching with the pattern.)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return _LONE_SURROGATE.sub("\ufffd", text)
    return text


def _line_pieces(path: str, size_bytes: int, piece_bytes: int) -> list[Piece]:
    if compression(path):  # a compressed stream cannot be entered in the middle
        return [Piece(0, 1, size_bytes)]
    return [Piece(start, min(start + piece_bytes, size_bytes), min(piece_bytes, size_bytes - start))
            for start in range(0, max(size_bytes, 1), piece_bytes)]


def _line_documents(path: str, piece: Piece, text_field: str, field: str) -> Iterator[str]:
    with _binary_stream(path) as f:
        if compression(path):
            lines = ((None, line) for line in f)
        else:
            lines = _lines_starting_in(f, piece.start, piece.stop)
        for number, line in lines:
            if not line.strip():
                continue
            text = _json_text(line, path, number, text_field, field)
            if text:
                yield text


def _lines_starting_in(f: IO[bytes], start: int, stop: int) -> Iterator[tuple[int | None, bytes]]:
    """The lines of an uncompressed file whose first byte is in [start, stop), with their
    line numbers when the piece begins the file (else None: counting would mean reading
    everything before it)."""
    if start > 0:
        f.seek(start - 1)
        if f.read(1) != b"\n":
            start += len(f.readline())  # the rest of a line that began before the piece
    position = start
    number = 1 if start == 0 else None
    while position < stop:
        line = f.readline()
        if not line:
            return
        yield number, line
        position += len(line)
        number = number + 1 if number is not None else None


# --- Columnar: Parquet and Arrow ----------------------------------------------------------


def _is_text_type(pa, arrow_type) -> bool:
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
            or getattr(pa.types, "is_string_view", lambda _: False)(arrow_type))


def _check_schema(schema, path: str, text_field: str, field: str) -> None:
    pa = _pyarrow()
    if text_field not in schema.names:
        raise _missing_field(path, text_field, list(schema.names), field)
    arrow_type = schema.field(text_field).type
    if not _is_text_type(pa, arrow_type):
        texts = [f.name for f in schema if _is_text_type(pa, f.type)]
        raise ConfigError(_one_line(
            f"config.data.text_field={text_field!r}: column {text_field!r} of {path} is "
            f"{arrow_type}, not text (its text columns: {', '.join(map(repr, texts)) or 'none'}). "
            "Fix: pass --config.data.text_field=NAME naming the column of documents."))


def _column_texts(column) -> Iterator[str]:
    for text in column.to_pylist():
        if text:
            yield text


def _parquet_file(path: str):
    return _pyarrow().parquet.ParquetFile(_open(path))


def _parquet_pieces(path: str, text_field: str, piece_bytes: int) -> list[Piece]:
    """Runs of whole row groups of about `piece_bytes` of text (uncompressed)."""
    with _parquet_file(path) as parquet:
        metadata = parquet.metadata
        column = parquet.schema_arrow.get_field_index(text_field)
        sizes = [metadata.row_group(i).column(column).total_uncompressed_size
                 for i in range(metadata.num_row_groups)]
    return _runs(sizes, piece_bytes)


def _parquet_documents(path: str, piece: Piece | None, text_field: str,
                       field: str) -> Iterator[str]:
    with _parquet_file(path) as parquet:
        _check_schema(parquet.schema_arrow, path, text_field, field)
        if piece is None:
            piece = Piece(0, parquet.metadata.num_row_groups, 0)
        for batch in parquet.iter_batches(batch_size=_ROWS_PER_READ, columns=[text_field],
                                          row_groups=range(piece.start, piece.stop),
                                          use_threads=False):
            yield from _column_texts(batch.column(0))


def _arrow_batches(f):
    """(record batches, schema) of an Arrow IPC stream (what `save_to_disk` writes) or an
    Arrow file."""
    pa = _pyarrow()
    try:
        reader = pa.ipc.open_stream(f)
        return reader, reader.schema
    except pa.ArrowInvalid:
        f.seek(0)
        reader = pa.ipc.open_file(f)
        return (reader.get_batch(i) for i in range(reader.num_record_batches)), reader.schema


def _arrow_pieces(path: str, text_field: str, piece_bytes: int) -> list[Piece]:
    with _open(path) as f:
        batches, _ = _arrow_batches(f)
        sizes = [batch.column(text_field).nbytes for batch in batches]
    return _runs(sizes, piece_bytes)


def _arrow_documents(path: str, piece: Piece, text_field: str, field: str) -> Iterator[str]:
    with _open(path) as f:
        batches, schema = _arrow_batches(f)
        _check_schema(schema, path, text_field, field)
        column = schema.get_field_index(text_field)
        for index, batch in enumerate(batches):
            if index >= piece.stop:
                return
            if index >= piece.start:
                yield from _column_texts(batch.column(column))


def _runs(sizes: list[int], piece_bytes: int) -> list[Piece]:
    """Consecutive units grouped into runs of about `piece_bytes` (a larger unit alone)."""
    pieces: list[Piece] = []
    start, size = 0, 0
    for index, unit in enumerate(sizes):
        if index > start and size + unit > piece_bytes:
            pieces.append(Piece(start, index, size))
            start, size = index, 0
        size += unit
    if sizes:
        pieces.append(Piece(start, len(sizes), size))
    return pieces


# --- The interface ------------------------------------------------------------------------


def check(path: str, text_field: str, field: str) -> None:
    """Opens `path` as cheaply as its kind allows and raises a one-line ConfigError for a
    file that cannot be read as its name says, or that has no text field `text_field`."""
    kind_ = kind(path)
    try:
        if kind_ == "parquet":
            with _parquet_file(path) as parquet:
                _check_schema(parquet.schema_arrow, path, text_field, field)
        elif kind_ == "arrow":
            with _open(path) as f:
                _check_schema(_arrow_batches(f)[1], path, text_field, field)
        elif compression(path) or kind_ == "lines":
            with _binary_stream(path) as f:
                first = f.read(_FIRST_BLOCK)
            if len(first) == _FIRST_BLOCK:  # only the lines that end inside the block
                first = first[:first.rfind(b"\n") + 1]
            lines = [line for line in first.split(b"\n") if line.strip()]
            if kind_ == "lines" and lines:
                _json_text(lines[0], path, None, text_field, field)
    except (ConfigError, MemoryError):  # MemoryError: Arrow's too, not the file's fault
        raise
    except _read_errors() as e:
        raise _unreadable(path, e, field) from e


def pieces(path: str, size_bytes: int, text_field: str, piece_bytes: int) -> list[Piece]:
    """The file's pieces, in order (at least one)."""
    kind_ = kind(path)
    if kind_ == "parquet":
        found = _parquet_pieces(path, text_field, piece_bytes)
    elif kind_ == "arrow":
        found = _arrow_pieces(path, text_field, piece_bytes)
    elif kind_ == "lines":
        found = _line_pieces(path, size_bytes, piece_bytes)
    else:
        found = [Piece(0, 1, size_bytes)]
    return found or [Piece(0, 0, 0)]


def documents(path: str, piece: Piece | None = None, *, text_field: str = "text",
              field: str = "data.text_files") -> Iterator[str]:
    """The non-empty documents of one piece of `path` (None: the whole file), in order.

    A read error (a truncated or corrupt compressed file, a damaged Parquet page) is a
    one-line ConfigError naming the file; `field` is the config field named in errors.
    """
    kind_ = kind(path)
    try:
        if kind_ == "plain":
            yield from _plain_documents(path)
            return
        if kind_ == "lines":
            whole = Piece(0, 1 << 62, 0)
            yield from _line_documents(path, piece or whole, text_field, field)
            return
        if kind_ == "parquet":
            yield from _parquet_documents(path, piece, text_field, field)
        else:
            yield from _arrow_documents(path, piece or Piece(0, 1 << 62, 0), text_field, field)
    except (ConfigError, MemoryError):  # MemoryError: Arrow's too, not the file's fault
        raise
    except _read_errors() as e:
        raise _unreadable(path, e, field) from e
