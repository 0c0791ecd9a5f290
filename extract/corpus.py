"""Corpus sources: the documents of a text, JSONL or Parquet file or a saved `datasets` dataset, streamed.

``read_documents(data)`` yields ``Piece(document, content)`` in corpus order, reading a
bounded amount at a time (never the whole corpus): ``document`` is where the piece comes from
(the 0-based line of a text or JSONL file, the 0-based row of a Parquet file or dataset, rows
counted across its files), ``content`` its text or, with ``tokenized=true``, its token ids.
Consecutive pieces of one document (a whole text file read in pieces) share its index.

- ``text``: one document per non-blank line (``document=line``, the line without its line end),
  or the whole file as one document (``document=file``): its exact text, line ends (CRLF
  included) and final newline as they are, read in pieces of about 1 MB that may end anywhere
  (packing.py tokenises them as the one text they are).
- ``jsonl``: one JSON object per non-blank line, the document in field ``field``.
- ``parquet``: a Parquet file, or a folder of them (``*.parquet``, in name order), the document
  in column ``column``, read in row batches; its row count comes from the file metadata.
- ``hf``: a ``datasets`` dataset saved with ``save_to_disk`` (read with pyarrow from its Arrow
  files, without the ``datasets`` library); a saved ``DatasetDict`` needs ``split=NAME``.

Null and empty documents are skipped (a whole file that is blank holds no document). Text
must be UTF-8: invalid bytes are an error naming the file and line (or row).
"""
from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from orthosphere.errors import ConfigError, CorpusError  # noqa: F401

PIECE_BYTES = 2**20
"""A whole text file is read in pieces of this many bytes."""
ROW_BATCH = 1024
"""Rows read at a time from Parquet and Arrow files."""


@dataclass(frozen=True)
class Piece:
    document: int
    content: str | list[int]


def read_documents(data) -> Iterator[Piece]:
    """The pieces of the corpus described by `data` (a CorpusData), in order."""
    _check_exists(data.path)
    if data.source == "text":
        return _text_lines(data.path) if data.document == "line" else _text_pieces(data.path)
    if data.source == "jsonl":
        return _jsonl(data.path, data.column, data.tokenized)
    if data.source == "parquet":
        return _parquet(parquet_files(data.path), data.column, data.tokenized)
    return _arrow_stream(saved_dataset_files(data.path, data.split), data.column, data.tokenized)


def corpus_files(data) -> list[Path]:
    """The files the corpus is read from, in reading order."""
    _check_exists(data.path)
    if data.source == "parquet":
        return parquet_files(data.path)
    if data.source == "hf":
        return saved_dataset_files(data.path, data.split)
    return [Path(data.path)]


def parquet_rows(data) -> int | None:
    """The number of rows of a Parquet corpus, from the files' metadata (None for other sources)."""
    if data.source != "parquet":
        return None
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(path).metadata.num_rows for path in parquet_files(data.path))


def _check_exists(path: str) -> None:
    if not os.path.exists(path):
        raise CorpusError(f"corpus {path} not found: check the path given as path=")


def no_documents_error(path) -> CorpusError:
    return CorpusError(f"corpus {path} holds no documents (no non-blank text): give a corpus with text")


def _utf8_error(path, line: int, reason: str, byte: int) -> CorpusError:
    return CorpusError(
        f"{path}, line {line}: invalid UTF-8 ({reason} at byte {byte} of the line): "
        "expected UTF-8 text; convert the file to UTF-8 (e.g. iconv -t UTF-8)"
    )


def _check_file(path) -> None:
    if os.path.isdir(path):
        raise CorpusError(f"corpus {path} is a folder: expected a file (text and jsonl read one file)")


def _lines(path) -> Iterator[tuple[int, str]]:
    """(0-based line index, text without its line end) of every line."""
    _check_file(path)
    with open(path, "rb") as handle:
        for index, raw in enumerate(handle):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise _utf8_error(path, index + 1, error.reason, error.start) from None
            yield index, line.rstrip("\r\n")


def _text_lines(path) -> Iterator[Piece]:
    for index, line in _lines(path):
        if line.strip():
            yield Piece(index, line)


def _text_pieces(path) -> Iterator[Piece]:
    """The whole file's exact text as document 0, decoded in pieces of PIECE_BYTES bytes."""
    _check_file(path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    blank = True
    with open(path, "rb") as handle:
        while True:
            raw = handle.read(PIECE_BYTES)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError:
                for _ in _lines(path):  # an error path only: reading line by line finds the line and byte, and raises
                    pass
                raise
            if text:
                blank = blank and not text.strip()
                yield Piece(0, text)
            if not raw:
                break
    if blank:
        raise no_documents_error(path)


def _jsonl(path, field: str, tokenized: bool) -> Iterator[Piece]:
    for index, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise CorpusError(f"{path}, line {index + 1}: not valid JSON ({error.msg}): expected one JSON object a line") from None
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise CorpusError(
                f"{path}, line {index + 1}: no field {field!r} (found {keys}): name the document's field with field=NAME"
            )
        value = record[field]
        if value is None:
            continue
        content = _token_ids(value, path, f"line {index + 1}") if tokenized else _text(value, path, f"line {index + 1}", field)
        if content:
            yield Piece(index, content)


def _text(value, path, where: str, name: str) -> str:
    if not isinstance(value, str):
        raise CorpusError(
            f"{path}, {where}: {name!r} holds {type(value).__name__}, not text: name a text field or column, "
            "or pass tokenized=true for token ids"
        )
    return value


def _token_ids(value, path, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise CorpusError(
            f"{path}, {where}: expected a list of integer token ids (tokenized=true), got {type(value).__name__}"
        )
    return value


# --- columnar sources -----------------------------------------------------------------------------


def parquet_files(path) -> list[Path]:
    path = Path(path)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise CorpusError(f"folder {path} holds no *.parquet files: expected a Parquet file or a folder of them")
    return files


def saved_dataset_files(path, split: str | None) -> list[Path]:
    """The Arrow files of a dataset saved with `datasets`' save_to_disk (of one split of a DatasetDict)."""
    path = Path(path)
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = json.loads(splits_file.read_text()).get("splits", [])
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            raise CorpusError(
                f"{path} is a saved DatasetDict with splits {splits}: choose one with split=NAME"
                + (f" ({split!r} is not one of them)" if split is not None else "")
            )
        path = path / split
    elif split is not None:
        raise CorpusError(f"{path} is not a saved DatasetDict (no dataset_dict.json): it has no splits; leave out split=")
    state = path / "state.json"
    if not state.is_file():
        raise CorpusError(
            f"{path} is not a dataset saved with datasets' save_to_disk (no state.json): give the folder "
            "that save_to_disk wrote"
        )
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CorpusError(f"{state} does not list the dataset's Arrow files ({error}): save the dataset again") from None
    return [path / name for name in names]


def _check_column(schema, path, column: str, tokenized: bool) -> None:
    import pyarrow as pa

    if column not in schema.names:
        raise CorpusError(f"{path} has no column {column!r} (columns: {schema.names}): name the text column with column=NAME")
    kind = schema.field(column).type
    if tokenized:
        is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        if not (is_list and pa.types.is_integer(kind.value_type)):
            raise CorpusError(f"{path}: column {column!r} holds {kind}, not lists of integer token ids (tokenized=true)")
    elif not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise CorpusError(
            f"{path}: column {column!r} holds {kind}, not text: name a text column with column=NAME, "
            "or pass tokenized=true for a column of token ids"
        )


def _batch_pieces(batches, path, column: str, first_row: int):
    """Pieces of one column of record batches, rows numbered from first_row; returns the next row."""
    row = first_row
    for batch in batches:
        values = batch.column(column)
        try:
            contents = values.to_pylist()
        except UnicodeDecodeError as error:
            raise CorpusError(f"{path}: invalid UTF-8 in rows {row}-{row + len(values) - 1} ({error.reason}): "
                              "expected UTF-8 text; re-encode the column") from None
        for offset, content in enumerate(contents):
            if content:
                yield Piece(row + offset, content)
        row += len(values)
    return row


def _parquet(files, column: str, tokenized: bool) -> Iterator[Piece]:
    import pyarrow.parquet as pq

    row = 0
    for path in files:
        try:
            handle = pq.ParquetFile(path)
        except Exception as error:  # pyarrow raises its own error types for a damaged or foreign file
            raise CorpusError(f"{path} is not a readable Parquet file ({error})") from None
        _check_column(handle.schema_arrow, path, column, tokenized)
        row = yield from _batch_pieces(handle.iter_batches(batch_size=ROW_BATCH, columns=[column]), path, column, row)


def _arrow_stream(files, column: str, tokenized: bool) -> Iterator[Piece]:
    import pyarrow as pa

    row = 0
    for path in files:
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        except (OSError, pa.ArrowInvalid) as error:
            raise CorpusError(f"{path} is not a readable Arrow file ({error}): save the dataset again") from None
        _check_column(reader.schema, path, column, tokenized)
        slices = (batch.slice(start, ROW_BATCH) for batch in reader for start in range(0, batch.num_rows, ROW_BATCH))
        row = yield from _batch_pieces(slices, path, column, row)
