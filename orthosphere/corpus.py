"""Corpora as data for ``orthosphere.extract``: the Python form of the task specs ``text:``,
``jsonl:``, ``parquet:`` and ``hf:`` (``orthosphere.extract.data`` documents the options).

Each takes ``context=N`` (documents packed into windows of N tokens, with ``bos`` and ``separator``:
True for the tokenizer's, False for none, or a token id) or ``max_length=N`` (one padded sample a
document, the default with N = 128), and ``tokenized=True`` where the documents are token ids. The
parameters of each source are declared once, in its configuration (``TextCorpus``, ``JsonlCorpus``,
``ParquetCorpus``, ``SavedDatasetCorpus`` of ``orthosphere.extract.data``: ``TextCorpus.parameters()``
lists them with their help); a task spec's options are the same parameters.
"""
from __future__ import annotations

import os

from orthosphere.extract.data import CorpusData, corpus


def text(path: str | os.PathLike, **options) -> CorpusData:
    """A text file: one document a line (``document="line"``) or the whole file (``"file"``); the
    parameters of ``TextCorpus``."""
    return corpus("text", path, **options)


def jsonl(path: str | os.PathLike, **options) -> CorpusData:
    """A JSON-lines file whose records hold each document in `field` ("text"); the parameters of ``JsonlCorpus``."""
    return corpus("jsonl", path, **options)


def parquet(path: str | os.PathLike, **options) -> CorpusData:
    """A Parquet file, or a folder of them, with each document in `column` ("text"); the parameters of
    ``ParquetCorpus``."""
    return corpus("parquet", path, **options)


def hf(path: str | os.PathLike, **options) -> CorpusData:
    """A dataset saved with the datasets library's ``save_to_disk`` (one `split` of a DatasetDict), each
    document in `column` ("text"); the parameters of ``SavedDatasetCorpus``."""
    return corpus("hf", path, **options)
