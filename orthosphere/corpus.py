"""Corpora as data for ``orthosphere.extract``: the Python form of the task specs ``text:``,
``jsonl:``, ``parquet:`` and ``hf:`` (``orthosphere.extract.data`` documents the options).

Each takes ``context=N`` (documents packed into windows of N tokens, with ``bos`` and ``separator``:
True for the tokenizer's, False for none, or a token id) or ``max_length=N`` (one padded sample a
document, the default with N = 128), and ``tokenized=True`` where the documents are token ids.
"""
from __future__ import annotations

import os

from orthosphere.extract.data import CorpusData, corpus


def text(path: str | os.PathLike, *, document: str = "line", context: int | None = None,
         max_length: int | None = None, bos: bool | int | None = None, separator: bool | int | None = None) -> CorpusData:
    """A text file: one document a line (``document="line"``) or the whole file (``"file"``)."""
    return corpus("text", path, document=document, context=context, max_length=max_length, bos=bos,
                  separator=separator)


def jsonl(path: str | os.PathLike, *, field: str = "text", tokenized: bool = False, context: int | None = None,
          max_length: int | None = None, bos: bool | int | None = None, separator: bool | int | None = None) -> CorpusData:
    """A JSON-lines file whose records hold each document in `field`."""
    return corpus("jsonl", path, field=field, tokenized=tokenized, context=context, max_length=max_length, bos=bos,
                  separator=separator)


def parquet(path: str | os.PathLike, *, column: str = "text", tokenized: bool = False, context: int | None = None,
            max_length: int | None = None, bos: bool | int | None = None,
            separator: bool | int | None = None) -> CorpusData:
    """A Parquet file, or a folder of them, with each document in `column`."""
    return corpus("parquet", path, column=column, tokenized=tokenized, context=context, max_length=max_length,
                  bos=bos, separator=separator)


def hf(path: str | os.PathLike, *, split: str | None = None, column: str = "text", tokenized: bool = False,
       context: int | None = None, max_length: int | None = None, bos: bool | int | None = None,
       separator: bool | int | None = None) -> CorpusData:
    """A dataset saved with the datasets library's ``save_to_disk`` (one `split` of a DatasetDict)."""
    return corpus("hf", path, split=split, column=column, tokenized=tokenized, context=context,
                  max_length=max_length, bos=bos, separator=separator)
