"""A corpus tokenised once and laid out as samples: packed windows, or one padded sample per document.

``TokenizedCorpus`` reads the documents in order (corpus.py), tokenises them in batches with the
model's tokenizer and appends the ids to a token stream (int32) and a table of documents (source
index, first token, length), both files in a temporary folder (4 bytes a token; beside a local
output store, else under ``$TMPDIR``) that is removed on close: memory stays bounded whatever the
corpus size, every document is tokenised once, and the number of samples is known when the
stream ends.

A whole text file (``document=file``) is one text read in pieces, and its tokens are those of
tokenising it at once (``whole_text_ids``): overlapping windows of text are tokenised with the
tokenizer's character offsets and only tokens far from a window's end are taken, so that no cut
between pieces changes a token (where two windows disagree, the earlier one is tokenised again
with more text; a tokenizer whose tokens depend on text a kilobyte away is an error).

Packed (task option ``context=N``), as activation caches such as SAELens lay out a corpus::

    stream   = doc_0, SEP, doc_1, SEP, doc_2, ...        (documents without their special tokens)
    window w = [BOS] + stream[w*b : (w+1)*b]            b = N - 1 (b = N with bos=none)

SEP is the tokenizer's end-of-sequence token (``separator=none``: nothing between documents).
No window holds padding; a document longer than a window continues in the next ones; the tail of
the stream that does not fill a window is not stored (task attribute ``dropped_tokens``). A
causal model's target at a window's last position is the stream's next token, so every position
is scored.

Padded (``max_length=N``, the default): one sample per document, tokenised with the special tokens
its tokenizer adds (BOS, [CLS] ... [SEP]), truncated to N tokens (task attribute
``truncated_documents``; a whole file is read only until its N tokens are known) and padded to
the longest; ``valid`` marks the real tokens, and a causal model's last real token has no target.

Labels (per token): ``token_str``; ``document``, the source record the token comes from (line of a
text or JSONL file, row of a Parquet file or dataset; a SEP belongs to the document it ends);
``offset``, the token's index in that document's tokens (a SEP's is the document's length). A BOS
added to a window and padding have neither (the not-applicable value).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from .corpus import CorpusError, corpus_files, no_documents_error, parquet_rows, read_documents
from .hashing import files_sha256

log = logging.getLogger("orthosphere.extract")

CORPUS_LABELS = {"token_str": "str", "document": "int64", "offset": "int64"}
NOT_APPLICABLE = int(np.iinfo(np.int64).min)
ENCODE_BATCH_CHARS = 2**20
"""Text handed to the tokenizer at once (it tokenises a batch in parallel)."""
ENCODE_BATCH_PIECES = 1024
WINDOW_MARGIN_CHARS = 1024
"""A whole text's tokens that end within this many characters of a window's end are left to the next window."""
WINDOW_BACK_TOKENS = 32
"""The next window starts this many tokens before the first token left to it, so that what a
tokenizer does at the start of a text (a prefix space) falls on tokens already taken."""
WINDOW_CHECK_TOKENS = 4
"""The tokens just before the first one left to a window that it must give as the last window did."""


class TokenizedCorpus:
    """The token stream and the document table of a corpus, in files of a temporary folder."""

    def __init__(self, data, tokenizer, *, special_tokens: bool, separator: int | None, vocab_size: int | None,
                 max_document_tokens: int | None = None, stop_tokens: int | None = None,
                 stop_documents: int | None = None, scratch: str | None = None):
        """Tokenise the documents of `data`, each cut to max_document_tokens (None: kept whole) and
        followed by `separator` (None: nothing) unless it is the last; stop reading once the stream
        holds stop_tokens tokens or stop_documents documents (None: read everything), or once a
        whole file's one document is cut. The token files go to a new folder in `scratch` (None:
        the system's temporary folder)."""
        self.data, self.tokenizer = data, tokenizer
        self.special_tokens, self.separator, self.vocab_size = special_tokens, separator, vocab_size
        self.max_document_tokens = max_document_tokens
        self.folder = tempfile.mkdtemp(prefix=".orthosphere-tokens-", dir=scratch)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)
        began = time.perf_counter()
        try:
            self._tokenise(stop_tokens, stop_documents)
        except BaseException:
            self.close()
            raise
        log.info("tokenised %d documents of %s: %d tokens in %.1f s", self.n_documents, data.path, self.n_tokens,
                 time.perf_counter() - began)

    def close(self) -> None:
        """Remove the temporary files."""
        self._cleanup()

    def _tokenise(self, stop_tokens: int | None, stop_documents: int | None) -> None:
        stream_path = os.path.join(self.folder, "tokens.int32")
        table = _DocumentTable(self.folder)
        self.n_tokens = self.n_documents = self.truncated_documents = 0
        current = None  # [source index, first token, length] of the document being read
        one_document = self.data.source == "text" and self.data.document == "file"
        with open(stream_path, "wb") as stream, table:
            for document, ids in self._encoded():
                if stop_tokens is not None and self.n_tokens >= stop_tokens:
                    break
                if current is None or document != current[0]:
                    if not len(ids):
                        continue
                    if current is not None:
                        table.append(current)
                        current = None
                        if stop_documents is not None and self.n_documents >= stop_documents:
                            break
                        if self.separator is not None:
                            stream.write(np.int32(self.separator).tobytes())
                            self.n_tokens += 1
                    current = [document, self.n_tokens, 0]
                    self.n_documents += 1
                kept = self._cut(ids, current[2])
                stream.write(kept.tobytes())
                current[2] += len(kept)
                self.n_tokens += len(kept)
                if one_document and len(kept) < len(ids):
                    break  # the whole file's one document is full: the rest of it is not read
            if current is not None:
                table.append(current)
        if self.n_tokens == 0:
            raise no_documents_error(self.data.path)
        self.stream = np.memmap(stream_path, dtype=np.int32, mode="r", shape=(self.n_tokens,))
        self.sources, self.starts, self.lengths = table.columns(self.n_documents)

    def _encoded(self) -> Iterator[tuple[int, np.ndarray]]:
        """(source index, token ids) of the corpus's documents in order, a document in one or more parts."""
        if self.data.source == "text" and self.data.document == "file":
            yield from ((0, ids) for ids in self._whole_file_ids())
            return
        for batch in _batches(read_documents(self.data)):
            yield from zip((piece.document for piece in batch), self._encode(batch))

    def _whole_file_ids(self) -> Iterator[np.ndarray]:
        """The whole file's tokens, with the special tokens the tokenizer adds around a text if asked."""
        before, after = self.tokenizer.special_affixes() if self.special_tokens else ([], [])
        yield np.asarray(before, dtype=np.int32)
        pieces = (piece.content for piece in read_documents(self.data))
        for ids in whole_text_ids(pieces, self.tokenizer.encode_offsets, self.data.path):
            yield ids.astype(np.int32)
        yield np.asarray(after, dtype=np.int32)

    def _cut(self, ids: np.ndarray, held: int) -> np.ndarray:
        """The ids that fit in a document holding `held` tokens already (all when uncut), counting
        the document as truncated when some do not (a document is cut once: a whole file, the one
        document read in parts, is read no further)."""
        if self.max_document_tokens is None or held + len(ids) <= self.max_document_tokens:
            return ids
        self.truncated_documents += 1
        return ids[: self.max_document_tokens - held]

    def _encode(self, batch) -> list[np.ndarray]:
        if self.data.tokenized:
            encoded = [np.asarray(piece.content, dtype=np.int64) for piece in batch]
            self._check_ids(encoded, batch)
        else:
            encoded = self.tokenizer.encode_batch([piece.content for piece in batch], special_tokens=self.special_tokens)
            encoded = [np.asarray(ids, dtype=np.int64) for ids in encoded]
        return [ids.astype(np.int32) for ids in encoded]

    def _check_ids(self, encoded, batch) -> None:
        high = self.vocab_size if self.vocab_size is not None else np.iinfo(np.int32).max + 1
        for piece, ids in zip(batch, encoded):
            if ids.size and (ids.min() < 0 or ids.max() >= high):
                raise CorpusError(
                    f"{self.data.path}: document {piece.document} holds token id {int(ids.min() if ids.min() < 0 else ids.max())}, "
                    f"outside the model's vocabulary 0..{high - 1}: pre-tokenise with the model's tokenizer"
                )

    def describe(self) -> dict:
        """What the store's `task` attribute records of the corpus (its source, files and tokens)."""
        data = self.data
        source = {"text": {"document": data.document}, "hf": {"split": data.split}}.get(data.source, {})
        if data.source != "text":
            source.update(column=data.column, tokenized=data.tokenized)
        rows = parquet_rows(data)
        return {
            "name": data.source,
            "path": os.path.abspath(data.path),
            **source,
            **({"rows": rows} if rows is not None else {}),
            "sha256": files_sha256(corpus_files(data)),
            "tokenizer": self.tokenizer.name,
            "tokenizer_sha256": self.tokenizer.sha256(),
        }


Encode = Callable[[str], tuple[np.ndarray, np.ndarray, np.ndarray]]
"""A text's token ids and each token's start and end character offsets."""


@dataclass(frozen=True)
class _Window:
    """A stretch of a whole text that starts at character `start` of it, where a token starts; its
    tokens from character `resume` of the stretch on are to be taken, after the tokens `expected`
    (None: the stretch is the text's beginning)."""

    text: str
    start: int = 0
    resume: int = 0
    expected: tuple[int, ...] | None = None


def whole_text_ids(pieces: Iterable[str], encode: Encode, path) -> Iterator[np.ndarray]:
    """The token ids of the concatenated pieces, exactly those of encoding their whole text at once,
    holding about a piece at a time.

    Each window (the text left by the last window, then the next piece) is encoded; its tokens that
    end WINDOW_MARGIN_CHARS before its end are taken, the rest are left to the next window, which
    starts WINDOW_BACK_TOKENS tokens earlier and takes its tokens from the start offset of the first
    one left to it, once its WINDOW_CHECK_TOKENS tokens before that point equal the last window's.
    A window's tokens are held until the next window agrees with them; where it does not (a token
    that depends on text further on), the held window is encoded again with the next window's text.
    """
    window, held, previous = _Window(""), None, None
    for piece, last in _with_last(pieces):
        window = replace(window, text=window.text + piece)
        split = _split_window(window, encode, last)
        if split is _MISALIGNED and previous is not None:
            text = previous.text[: window.start - previous.start] + window.text  # the held window, run on
            window, held, previous = replace(previous, text=text), None, None
            split = _split_window(window, encode, last)
        if split is _MISALIGNED:
            raise CorpusError(
                f"{path}: the tokenizer's tokens near character {window.start + window.resume} depend on text more "
                f"than {WINDOW_MARGIN_CHARS} characters away, so the file cannot be tokenised in pieces: split it "
                "into documents (document=line) or give it tokenised (jsonl or parquet with tokenized=true)"
            )
        if split is None:  # too few tokens yet: read on
            continue
        ids, following = split
        if held is not None:
            yield held
        held = ids
        if following is not None:
            previous, window = window, following
    if held is not None:
        yield held


_MISALIGNED = object()


def _split_window(window: _Window, encode: Encode, last: bool):
    """(the window's tokens to take, the next window); for the last window, (its tokens, None);
    None when too few tokens are settled; _MISALIGNED when the window does not give the tokens
    expected before its resume point."""
    ids, starts, ends = encode(window.text)
    boundary = np.zeros(len(ids), dtype=bool)  # a token a window may start at: it shares no character with the last
    boundary[1:] = (starts[1:] >= ends[:-1]) & (starts[1:] > starts[:-1]) & (ends[1:] > starts[1:])
    if window.expected is None:
        first = 0
    else:
        resumes = np.flatnonzero(boundary & (starts == window.resume))
        n_expected = len(window.expected)
        if not len(resumes) or resumes[0] < n_expected or tuple(ids[resumes[0] - n_expected: resumes[0]]) != window.expected:
            return _MISALIGNED
        first = int(resumes[0])
    if last:
        return ids[first:], None
    settled = np.zeros(len(ids), dtype=bool)  # every token before it ends WINDOW_MARGIN_CHARS before the window's end
    settled[1:] = np.maximum.accumulate(ends[:-1]) <= len(window.text) - WINDOW_MARGIN_CHARS
    cuts = np.flatnonzero(boundary & settled)
    cuts = cuts[cuts >= first + WINDOW_BACK_TOKENS]
    if not len(cuts):
        return None
    cut = int(cuts[-1])
    begin = int(starts[cut - WINDOW_BACK_TOKENS])
    following = _Window(window.text[begin:], window.start + begin, int(starts[cut]) - begin,
                        tuple(int(i) for i in ids[cut - WINDOW_CHECK_TOKENS: cut]))
    return ids[first:cut], following


def _with_last(items: Iterable) -> Iterator[tuple[object, bool]]:
    """(item, whether it is the last) of each item."""
    items = iter(items)
    try:
        item = next(items)
    except StopIteration:
        return
    for following in items:
        yield item, False
        item = following
    yield item, True


class _DocumentTable:
    """Each document's source index, first token and length, appended to one file a column."""

    NAMES = ("sources", "starts", "lengths")
    HELD = 4096

    def __init__(self, folder: str):
        self.paths = [os.path.join(folder, f"{name}.int64") for name in self.NAMES]
        self.files = [open(path, "wb") for path in self.paths]
        self.held: list[list[int]] = []

    def append(self, record: list[int]) -> None:
        self.held.append(list(record))
        if len(self.held) >= self.HELD:
            self._flush()

    def _flush(self) -> None:
        if self.held:
            for handle, column in zip(self.files, np.asarray(self.held, dtype=np.int64).T):
                handle.write(np.ascontiguousarray(column).tobytes())
            self.held = []

    def __enter__(self) -> _DocumentTable:
        return self

    def __exit__(self, *exc_info) -> None:
        self._flush()
        for handle in self.files:
            handle.close()

    def columns(self, n_documents: int) -> list[np.memmap]:
        return [np.memmap(path, dtype=np.int64, mode="r", shape=(n_documents,)) for path in self.paths]


def _batches(pieces):
    """Lists of pieces of about ENCODE_BATCH_CHARS characters (or ENCODE_BATCH_PIECES pieces)."""
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.content)
        if size >= ENCODE_BATCH_CHARS or len(batch) >= ENCODE_BATCH_PIECES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class CorpusSamples:
    """What packed windows and padded documents share: labels, targets, the task description."""

    labels = CORPUS_LABELS

    def __init__(self, corpus: TokenizedCorpus, *, causal: bool, pad_id: int):
        self.corpus, self.causal, self.pad_id = corpus, causal, pad_id

    def close(self) -> None:
        self.corpus.close()

    def _finish(self, tokens, valid, document, offset, next_token=None) -> dict[str, np.ndarray]:
        """Targets, scored mask and token strings for token arrays (sample, pos); next_token (sample,)
        is the stream's token after each sample's last position (-1: none)."""
        if self.causal:
            target = np.full_like(tokens, self.pad_id)
            target[:, :-1] = tokens[:, 1:]
            scored = np.zeros_like(valid)
            scored[:, :-1] = valid[:, :-1] & valid[:, 1:]
            if next_token is not None:
                has_next = next_token >= 0
                target[has_next, -1] = next_token[has_next]
                scored[:, -1] = has_next & valid[:, -1]
        else:
            target, scored = tokens.copy(), valid.copy()
        token_str = np.asarray(self.corpus.tokenizer.token_strings(tokens.ravel()), dtype=object).reshape(tokens.shape)
        token_str[~valid] = ""
        return {
            "tokens": tokens, "valid": valid, "target": target, "scored": scored,
            "token_str": token_str.astype(str), "document": document, "offset": offset,
        }

    def describe(self) -> dict:
        return {
            **self.corpus.describe(),
            **self._layout(),
            "n_tokens": self.n_tokens,
            "target": "next token" if self.causal else "same token",
        }


class PackedWindows(CorpusSamples):
    """Windows of `context` tokens cut from the corpus's token stream, each starting with BOS if given."""

    def __init__(self, corpus: TokenizedCorpus, *, context: int, bos: int | None, n_samples: int | None,
                 causal: bool, pad_id: int):
        super().__init__(corpus, causal=causal, pad_id=pad_id)
        self.context, self.bos = context, bos
        self.body = context - (bos is not None)
        available = corpus.n_tokens // self.body
        if available == 0:
            raise CorpusError(
                f"corpus {corpus.data.path} has {corpus.n_tokens} tokens, fewer than one window of {self.body}: "
                "give a longer corpus, a smaller context=N, or one padded sample per document (max_length=N)"
            )
        if n_samples is not None and n_samples > available:
            raise CorpusError(
                f"corpus {corpus.data.path} packs into {available} windows of {context} tokens, fewer than "
                f"n_samples={n_samples}: ask for fewer samples or give a longer corpus"
            )
        self.whole_corpus = n_samples is None
        self.n_samples = n_samples or available
        self.n_pos = context
        self.n_tokens = self.n_samples * context

    def _layout(self) -> dict:
        stored = self.n_samples * self.body
        layout = {
            "layout": "packed", "context": self.context, "bos": self.bos, "separator": self.corpus.separator,
            "n_documents": int(np.searchsorted(self.corpus.starts, stored, side="left")),
        }
        if self.whole_corpus:
            layout["dropped_tokens"] = self.corpus.n_tokens - stored
        return layout

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        corpus, body = self.corpus, self.body
        positions = np.arange(start * body, stop * body, dtype=np.int64).reshape(stop - start, body)
        tokens = np.asarray(corpus.stream[start * body: stop * body]).reshape(stop - start, body)
        documents = np.searchsorted(corpus.starts, positions, side="right") - 1
        document, offset = corpus.sources[documents], positions - corpus.starts[documents]
        if self.bos is not None:
            column = np.full((stop - start, 1), NOT_APPLICABLE, dtype=np.int64)
            tokens = np.concatenate([np.full((stop - start, 1), self.bos, dtype=np.int32), tokens], axis=1)
            document, offset = np.concatenate([column, document], axis=1), np.concatenate([column, offset], axis=1)
        following = np.arange(start + 1, stop + 1, dtype=np.int64) * body
        next_token = np.where(following < corpus.n_tokens, corpus.stream[np.minimum(following, corpus.n_tokens - 1)], -1)
        valid = np.ones(tokens.shape, dtype=bool)
        return self._finish(tokens, valid, document, offset, next_token)


class PaddedDocuments(CorpusSamples):
    """One sample per document (cut to max_length), padded to the longest."""

    def __init__(self, corpus: TokenizedCorpus, *, max_length: int, n_samples: int | None, causal: bool, pad_id: int):
        super().__init__(corpus, causal=causal, pad_id=pad_id)
        self.max_length = max_length
        if n_samples is not None and n_samples > corpus.n_documents:
            raise CorpusError(
                f"corpus {corpus.data.path} has {corpus.n_documents} documents, fewer than n_samples={n_samples}: "
                "ask for fewer samples or give a longer corpus"
            )
        self.n_samples = n_samples or corpus.n_documents
        self.n_pos = int(corpus.lengths[: self.n_samples].max())
        self.n_tokens = int(corpus.lengths[: self.n_samples].sum())
        if corpus.truncated_documents:
            log.warning("%d documents of %s were longer than max_length=%d tokens and were cut to it",
                        corpus.truncated_documents, corpus.data.path, max_length)

    @property
    def document_lengths(self) -> np.ndarray:
        """The tokens of each sample's document (its valid positions)."""
        return self.corpus.lengths[: self.n_samples]

    def _layout(self) -> dict:
        return {"layout": "padded", "max_length": self.max_length, "n_documents": self.n_samples,
                "truncated_documents": self.corpus.truncated_documents}

    def batch(self, start: int, stop: int) -> dict[str, np.ndarray]:
        corpus, n = self.corpus, stop - start
        tokens = np.full((n, self.n_pos), self.pad_id, dtype=np.int32)
        valid = np.zeros((n, self.n_pos), dtype=bool)
        document = np.full((n, self.n_pos), NOT_APPLICABLE, dtype=np.int64)
        offset = np.full((n, self.n_pos), NOT_APPLICABLE, dtype=np.int64)
        for row, index in enumerate(range(start, stop)):
            first, length = int(corpus.starts[index]), int(corpus.lengths[index])
            tokens[row, :length] = corpus.stream[first: first + length]
            valid[row, :length] = True
            document[row, :length] = corpus.sources[index]
            offset[row, :length] = np.arange(length)
        return self._finish(tokens, valid, document, offset)
