"""Corpora: sources (text, JSONL, Parquet, saved datasets), packing, labels, bfloat16 and float16 range, resume.

A tiny Llama with a word-level tokenizer built here (BOS <s>, EOS </s>; nothing downloaded) runs
over generated sentences, so every token is a word and the tokenised corpus is known exactly.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import xarray as xr
import zarr

from orthosphere.errors import Float16OverflowError, JobMismatchError
from orthosphere.extract import corpus as corpus_module
from orthosphere.extract import hashing, packing
from orthosphere.extract.corpus import CorpusError, read_documents
from orthosphere.extract.data import parse_task
from orthosphere.extract.job import ExtractJob, run_job
from orthosphere.extract.model import ConfigError
from orthosphere.extract.packing import TokenizedCorpus
from orthosphere.store import create_store, format_info, info, open_store, read_attrs
from orthosphere.store.bfloat16 import bfloat16_dtype

WORDS = "the a cat dog sat ran on under mat rug big small red blue and then bird tree sang".split()
SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>"]
VOCAB = SPECIALS + WORDS
PAD, UNK, BOS, EOS = 0, 1, 2, 3
NOT_APPLICABLE = int(np.iinfo(np.int64).min)
CLI = os.path.join(os.path.dirname(sys.executable), "orthosphere")


def write_model(directory, max_positions: int = 64, embedding_scale: float = 1.0, d_model: int = 32, n_layers: int = 2,
                tokenizer: bool = True, tokenizer_specials=("bos", "eos"), config_specials=(BOS, EOS), **config_options):
    """A tiny random Llama (grouped-query attention: 4 heads, 2 key/value heads) whose config.json
    names config_specials as its BOS and EOS, and its word tokenizer (none with tokenizer=False)
    holding the special tokens named in tokenizer_specials; config_options go to its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(VOCAB),
                         max_position_embeddings=max_positions, bos_token_id=config_specials[0],
                         eos_token_id=config_specials[1], pad_token_id=PAD, tie_word_embeddings=False, **config_options)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embedding_scale)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer:
        write_word_tokenizer(directory, tokenizer_specials)
    return directory


def write_word_tokenizer(directory, specials=("bos", "eos"), split_punctuation: bool = False):
    """The word tokenizer with the special tokens named (bos: <s>, added before a text; eos: </s>);
    split_punctuation changes its rules but not the tokens of the generated sentences."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(VOCAB)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace() if split_punctuation else pre_tokenizers.WhitespaceSplit()
    if "bos" in specials:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tokens = {f"{name}_token": token for name, token in (("bos", "<s>"), ("eos", "</s>")) if name in specials}
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", **tokens).save_pretrained(directory)


def sentences(n: int = 30, seed: int = 0) -> list[str]:
    """Lines of 1 to 40 words: several longer than a window."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 41)))) for _ in range(n)]


def word_ids(text: str) -> list[int]:
    return [VOCAB.index(word) for word in text.split()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def lines():
    return sentences()


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def run(model_dir, out, task, **options):
    options = {"batch_size": 3, "device": "cpu", "samples_per_chunk": 2, "n_shards": 3, **options}
    run_job(ExtractJob(model=str(model_dir), task=task, out=str(out), **options), progress=False)
    return open_store(str(out))


def arrays_of(store) -> dict[str, np.ndarray]:
    return {name: store[name].values for name in store.variables}


def assert_same_arrays(left: dict, right: dict):
    assert left.keys() == right.keys()
    for name in left:
        np.testing.assert_array_equal(left[name], right[name], err_msg=name)


# --- packing ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_packed_windows_concatenate_back_to_the_tokenised_corpus(tmp_path, model_dir, lines):
    text = write_lines(tmp_path / "corpus.txt", lines[:10] + [""] + lines[10:])  # a blank line is no document
    store = run(model_dir, tmp_path / "s.zarr", f"text:path={text},context=16")
    stream = np.concatenate([word_ids(line) + [EOS] for line in lines])[:-1]  # EOS between documents
    n_windows = len(stream) // 15
    tokens = store["tokens"].values
    assert tokens.shape == (n_windows, 16) and store["valid"].values.all()  # no padding
    assert (tokens[:, 0] == BOS).all()
    np.testing.assert_array_equal(tokens[:, 1:].ravel(), stream[: n_windows * 15])
    task = store.attrs["task"]
    assert task["layout"] == "packed" and task["dropped_tokens"] == len(stream) - n_windows * 15
    assert task["n_tokens"] == n_windows * 16 and task["bos"] == BOS and task["separator"] == EOS
    # the target of a window's last token is the corpus's next token: every position is scored
    target = store["target"].values
    np.testing.assert_array_equal(target[:, :-1], tokens[:, 1:])
    np.testing.assert_array_equal(target[:, -1], stream[15: n_windows * 15 + 1: 15])
    assert store["scored"].values.all()


@pytest.mark.slow
def test_labels_point_back_to_the_text(tmp_path, model_dir, lines):
    text = write_lines(tmp_path / "corpus.txt", lines[:3] + ["", ""] + lines[3:])
    store = run(model_dir, tmp_path / "s.zarr", f"text:path={text},context=16")
    file_lines = text.read_text().splitlines()
    document, offset = store["document"].values, store["offset"].values
    token_str = store["token_str"].values
    assert (document[:, 0] == NOT_APPLICABLE).all() and (offset[:, 0] == NOT_APPLICABLE).all()  # the BOS
    spans = 0
    for window in range(len(document)):
        for pos in range(1, 16):
            words = file_lines[document[window, pos]].split() + ["</s>"]  # the EOS ends its document
            assert token_str[window, pos] == words[offset[window, pos]]
        spans += document[window, 1] == document[window - 1, -1] and window > 0
    assert spans > 0, "some documents must continue from one window into the next"
    assert 3 not in document and 4 not in document  # the blank lines


@pytest.mark.slow
def test_without_bos_and_separator_the_windows_are_the_stream(tmp_path, model_dir, lines):
    text = write_lines(tmp_path / "corpus.txt", lines)
    store = run(model_dir, tmp_path / "s.zarr", f"text:path={text},context=8,bos=false,separator=none", n_samples=20)
    stream = np.concatenate([word_ids(line) for line in lines])
    np.testing.assert_array_equal(store["tokens"].values.ravel(), stream[:160])
    assert store.attrs["task"]["bos"] is None and "dropped_tokens" not in store.attrs["task"]  # --samples: a prefix


@pytest.mark.slow
def test_bos_and_separator_are_special_tokens_of_the_tokenizer_or_given(tmp_path, lines):
    # a tokenizer without BOS and EOS, whose config.json names [UNK] for both (as a Llama config's defaults may)
    plain = write_model(tmp_path / "plain", tokenizer_specials=(), config_specials=(UNK, UNK))
    text = write_lines(tmp_path / "corpus.txt", lines)
    with pytest.raises(ConfigError, match=r"packing needs a BOS token, and none is known: the tokenizer \(\w+\) has none "
                                          r"as a special token, nor does the model's config.json name one of its special "
                                          r"tokens; pass bos=ID \(a token id of the model\) or bos=none in the task spec"):
        run(plain, tmp_path / "a.zarr", f"text:path={text},context=16")
    with pytest.raises(ConfigError, match=r"packing needs an end-of-sequence token to separate documents, and none is "
                                          r"known: .*; pass separator=ID \(a token id of the model\) or separator=none"):
        run(plain, tmp_path / "b.zarr", f"text:path={text},context=16,bos=none")
    with pytest.raises(ConfigError, match=r"bos=99 is outside the model's vocabulary 0..22"):
        run(plain, tmp_path / "c.zarr", f"text:path={text},context=16,bos=99,separator=none")
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".zarr")]
    # without a separator, one document's last token is followed by the next one's first
    joined = run(plain, tmp_path / "d.zarr", f"text:path={text},context=16,bos={BOS},separator=none", n_samples=8)
    stream = np.concatenate([word_ids(line) for line in lines])
    np.testing.assert_array_equal(joined["tokens"].values, np.insert(stream[:120].reshape(8, 15), 0, BOS, axis=1))
    assert joined.attrs["task"]["bos"] == BOS and joined.attrs["task"]["separator"] is None
    given = run(plain, tmp_path / "e.zarr", f"text:path={text},context=8,bos=none,separator={EOS}", n_samples=8)
    np.testing.assert_array_equal(given["tokens"].values.ravel(), np.concatenate([word_ids(line) + [EOS] for line in lines])[:64])


@pytest.mark.parametrize("spec, detail", [
    ("text:path=a.txt,context=8,bos=²", r"bos='²': expected true or none, or a token id"),  # a digit, not a decimal one
    ("text:path=a.txt,context=8,separator=٣", r"separator='٣': expected eos or none, or a token id"),
    ("text:path=a.txt,context=8,bos=-1", r"bos='-1': expected true or none, or a token id"),
])
def test_a_special_token_that_is_not_an_id_does_not_parse(spec, detail):
    with pytest.raises(ConfigError, match=rf"task spec .* does not parse \({detail}\)"):
        parse_task(spec)


@pytest.mark.slow
def test_a_config_token_is_taken_where_the_tokenizer_holds_it_as_a_special_token(tmp_path, lines):
    # the demo checkpoint's layout: the tokenizer's BOS <s> and no EOS; config.json names <s> for both
    model = write_model(tmp_path / "bos-only", tokenizer_specials=("bos",), config_specials=(BOS, BOS))
    text = write_lines(tmp_path / "corpus.txt", lines)
    store = run(model, tmp_path / "s.zarr", f"text:path={text},context=16", n_samples=8)
    stream = np.concatenate([word_ids(line) + [BOS] for line in lines])  # <s> separates the documents
    np.testing.assert_array_equal(store["tokens"].values, np.insert(stream[:120].reshape(8, 15), 0, BOS, axis=1))
    assert (store.attrs["task"]["bos"], store.attrs["task"]["separator"]) == (BOS, BOS)


def test_padded_documents_one_a_sample(tmp_path, model_dir, lines):
    text = write_lines(tmp_path / "corpus.txt", lines)
    store = run(model_dir, tmp_path / "s.zarr", f"text:path={text},max_length=12", n_samples=6)
    lengths = [min(len(line.split()) + 1, 12) for line in lines[:6]]  # the tokenizer's BOS, then the words
    assert store.sizes["sample"] == 6 and store.sizes["pos"] == max(lengths)
    np.testing.assert_array_equal(store["valid"].values.sum(axis=1), lengths)
    np.testing.assert_array_equal(store["document"].values[:, 0], range(6))
    for row, line in enumerate(lines[:6]):
        np.testing.assert_array_equal(store["tokens"].values[row, : lengths[row]], ([BOS] + word_ids(line))[:12])
        np.testing.assert_array_equal(store["offset"].values[row, : lengths[row]], range(lengths[row]))
        assert (store["tokens"].values[row, lengths[row]:] == PAD).all()
    task = store.attrs["task"]
    assert task["layout"] == "padded" and task["truncated_documents"] == sum(len(line.split()) + 1 > 12 for line in lines[:6])


@pytest.mark.slow
def test_a_whole_file_is_one_document_in_the_store(tmp_path, model_dir, lines, monkeypatch):
    """A whole file is one document in the store (document 0 on every token, offsets running on
    across windows) and the store is the same however the file is cut into pieces. The whitespace
    tokenizer's tokens never depend on a cut, so this checks the labels, not the windowing: the
    trained-tokenizer tests below check that a file's tokens are those of its whole text."""
    text = write_lines(tmp_path / "book.txt", lines)
    whole = arrays_of(run(model_dir, tmp_path / "whole.zarr", f"text:path={text},document=file,context=16"))
    stream = np.concatenate([word_ids(line) for line in lines])  # the word tokenizer's tokens of the whole text
    n_windows = len(stream) // 15
    assert whole["tokens"].shape == (n_windows, 16)
    np.testing.assert_array_equal(whole["tokens"][:, 1:].ravel(), stream[: n_windows * 15])
    assert (whole["document"][:, 1:] == 0).all()
    np.testing.assert_array_equal(whole["offset"][:, 1:].ravel(), np.arange(n_windows * 15))
    monkeypatch.setattr(corpus_module, "PIECE_BYTES", 50)  # many pieces, cut anywhere
    assert_same_arrays(arrays_of(run(model_dir, tmp_path / "pieces.zarr", f"text:path={text},document=file,context=16")), whole)


# --- a whole file as one text: real tokenizer types ---------------------------------------------------

PROSE_WORDS = "the a cat dog naïve café ☃ 日本語 under mat Zürich don't it's 42 3.14 hello wörld".split()
GAPS = [" ", " ", " ", "  ", "   ", "\t", ", ", ". ", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n"]
TOKENIZER_KINDS = ("byte-level", "metaspace", "sentencepiece-bpe")


def prose(n_words: int, seed: int) -> str:
    """Words (some of multi-byte characters) between spaces, runs of spaces, tabs, line ends (CRLF
    too) and blank lines."""
    rng = np.random.default_rng(seed)
    return "".join(str(rng.choice(PROSE_WORDS)) + str(rng.choice(GAPS)) for _ in range(n_words))


def trained_tokenizer(kind: str):
    """A fast tokenizer of a real type, trained here on prose (nothing downloaded): byte-level BPE with
    GPT-2's pre-tokenizer and offset trimming (GPT-2, SmolLM2); a SentencePiece-style Unigram with the
    Metaspace pre-tokenizer (a prefix space on every text); Llama-2-style BPE (a normalizer that
    prepends a prefix space and replaces spaces, no pre-tokenizer, byte fallback) that adds
    <s> ... </s> around a text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    training = [prose(4000, seed=7)]
    if kind == "byte-level":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=True)
        backend.train_from_iterator(training, trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]))
        return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    if kind == "metaspace":
        backend = Tokenizer(models.Unigram())
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        backend.train_from_iterator(training, trainers.UnigramTrainer(
            vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>"))
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.train_from_iterator(training, trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"]))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=TOKENIZER_KINDS)
def trained(request):
    from orthosphere.extract.sources import HuggingFaceTokenizer

    return HuggingFaceTokenizer(trained_tokenizer(request.param))


def whole_file_corpus(path, tokenizer, layout: str = "context=16", special_tokens: bool = False):
    return TokenizedCorpus(parse_task(f"text:path={path},document=file,{layout}"), tokenizer,
                           special_tokens=special_tokens, separator=None, vocab_size=None)


@pytest.mark.parametrize("margin", [2, packing.WINDOW_MARGIN_CHARS])
def test_a_whole_file_gives_exactly_the_tokens_of_its_whole_text(tmp_path, monkeypatch, trained, margin):
    text = prose(600, seed=1)
    path = tmp_path / "book.txt"
    path.write_bytes(text.encode())  # CRLF kept as written
    whole = trained.encode_batch([text], special_tokens=False)[0]
    # pieces of 7 bytes cut words, CRLF pairs, runs of blank lines and multi-byte characters; a margin
    # of 2 characters leaves tokens near a window's end that its text's cut changes, for the next window to mend
    monkeypatch.setattr(corpus_module, "PIECE_BYTES", 7)
    monkeypatch.setattr(packing, "WINDOW_MARGIN_CHARS", margin)
    assert "".join(piece.content for piece in read_documents(parse_task(f"text:path={path},document=file"))) == text
    corpus = whole_file_corpus(path, trained)
    assert len(whole) > 500 and corpus.n_documents == 1
    np.testing.assert_array_equal(corpus.stream, whole)
    corpus.close()


def test_a_whole_file_as_a_padded_sample_has_the_special_tokens_of_its_whole_text(tmp_path, monkeypatch):
    from orthosphere.extract.sources import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(trained_tokenizer("sentencepiece-bpe"))
    text = prose(300, seed=2)
    path = tmp_path / "book.txt"
    path.write_bytes(text.encode())
    monkeypatch.setattr(corpus_module, "PIECE_BYTES", 64)
    corpus = whole_file_corpus(path, tokenizer, "max_length=100000", special_tokens=True)
    whole = tokenizer.encode_batch([text])[0]
    assert whole[0] == tokenizer.bos_id and whole[-1] == tokenizer.eos_id
    np.testing.assert_array_equal(corpus.stream, whole)
    corpus.close()


def slow_tokenizer(folder, merges: str):
    """A slow (Python) BPE tokenizer saved in `folder`: CTRL's, a vocabulary and merge rules."""
    from transformers import AutoTokenizer

    folder.mkdir()
    words = ["<unk>", "t", "h", "e", "c", "a", "th", "the", "ca", "cat", "t@@", "h@@", "e@@", "c@@", "a@@"]
    (folder / "vocab.json").write_text(json.dumps({word: i for i, word in enumerate(words)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + merges)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "CTRLTokenizer", "unk_token": "<unk>"}))
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_a_slow_tokenizer_is_told_apart_by_its_rules_and_cannot_read_a_whole_file(tmp_path, monkeypatch):
    from orthosphere.extract.sources import HuggingFaceTokenizer

    monkeypatch.setenv("ORTHOSPHERE_CACHE", str(tmp_path / "cache"))
    rules = HuggingFaceTokenizer(slow_tokenizer(tmp_path / "rules", "t h\nth e\nc a\nca t\n"))
    fewer = HuggingFaceTokenizer(slow_tokenizer(tmp_path / "fewer", "t h\nc a\n"))  # the same vocabulary
    again = HuggingFaceTokenizer(slow_tokenizer(tmp_path / "again", "t h\nth e\nc a\nca t\n"))
    assert not rules.tokenizer.is_fast and rules.tokenizer.get_vocab() == fewer.tokenizer.get_vocab()
    assert rules.sha256() != fewer.sha256() and rules.sha256() == again.sha256()
    path = tmp_path / "book.txt"
    path.write_text("the cat\n")
    with pytest.raises(ConfigError, match=r"a whole text file \(document=file\) is tokenised with character offsets, "
                                          r"which CTRLTokenizer does not give: use a fast tokenizer \(tokenizer.json\) "
                                          r"or document=line"):
        whole_file_corpus(path, rules)


@pytest.mark.parametrize("max_length", [1, 50])
def test_a_whole_file_as_a_padded_sample_is_read_only_as_far_as_it_keeps(tmp_path, monkeypatch, max_length):
    from orthosphere.extract.sources import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(trained_tokenizer("sentencepiece-bpe"))
    text = prose(3000, seed=3)
    path = tmp_path / "book.txt"
    path.write_bytes(text.encode())
    monkeypatch.setattr(corpus_module, "PIECE_BYTES", 64)
    monkeypatch.setattr(packing, "WINDOW_MARGIN_CHARS", 64)
    read = []
    monkeypatch.setattr(packing, "read_documents", lambda data: (read.append(p) or p for p in read_documents(data)))
    corpus = TokenizedCorpus(parse_task(f"text:path={path},document=file,max_length={max_length}"), tokenizer,
                             special_tokens=True, separator=None, vocab_size=None, max_document_tokens=max_length)
    whole = tokenizer.encode_batch([text])[0]
    np.testing.assert_array_equal(corpus.stream, whole[:max_length])  # max_length=1: the BOS alone, yet cut
    assert corpus.n_documents == 1 and corpus.truncated_documents == 1
    assert len(read) < 20 < len(text.encode()) // 64  # a few pieces of the file, not all of them
    corpus.close()


@pytest.mark.parametrize("piece_bytes", [3, 5, 2**20])
@pytest.mark.parametrize("content, message", [
    ("the cat\r\na dog\nthe caf\xe9 sat\n".encode("latin-1"), r"line 3: invalid UTF-8 \(invalid continuation byte at byte 7 "),
    (b"the cat\r\nthe caf\xc3", r"line 2: invalid UTF-8 \(unexpected end of data at byte 7 "),  # cut at the end
])
def test_invalid_utf8_in_a_whole_file_names_its_line_and_byte(tmp_path, monkeypatch, piece_bytes, content, message):
    path = tmp_path / "latin1.txt"
    path.write_bytes(content)
    monkeypatch.setattr(corpus_module, "PIECE_BYTES", piece_bytes)
    with pytest.raises(CorpusError, match=r"latin1.txt, " + message + r"of the line\)"):
        list(read_documents(parse_task(f"text:path={path},document=file")))


def test_a_tokenizer_whose_tokens_depend_on_text_far_ahead_is_an_error():
    """A text whose tokens all change with a '!' thousands of characters on cannot be tokenised in
    pieces: the windows disagree, and again when the held window is tokenised with more text."""

    def encode(text):  # a token a character, marked when a '!' follows anywhere after it
        marked = np.zeros(len(text), dtype=bool)
        bang = text.rfind("!")
        marked[: bang + 1] = bang >= 0
        ids = np.array([ord(c) + 1000 * m for c, m in zip(text, marked)], dtype=np.int64)
        positions = np.arange(len(text))
        return ids, positions, positions + 1

    pieces = ["a" * 2000] * 4 + ["a" * 1000 + "!" + "a" * 999]
    with pytest.raises(CorpusError, match=r"book.txt: the tokenizer's tokens near character \d+ depend on text more "
                                          r"than 1024 characters away, so the file cannot be tokenised in pieces"):
        list(packing.whole_text_ids(pieces, encode, "book.txt"))
    ids = np.concatenate(list(packing.whole_text_ids(["a" * 2000] * 4, encode, "book.txt")))  # no '!': in pieces as at once
    np.testing.assert_array_equal(ids, encode("a" * 8000)[0])


# --- sources ----------------------------------------------------------------------------------------


def write_sources(folder, lines) -> dict[str, str]:
    """The same documents as a text file, JSONL, Parquet (one file and a folder of two), a saved dataset,
    a saved DatasetDict, and pre-tokenised Parquet; returns the task spec of each."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_lines(folder / "corpus.txt", lines)
    with open(folder / "corpus.jsonl", "w") as handle:
        for index, line in enumerate(lines):
            handle.write(json.dumps({"id": index, "body": line}) + "\n")
    table = pa.table({"id": list(range(len(lines))), "text": lines})
    pq.write_table(table, folder / "corpus.parquet")
    (folder / "parts").mkdir()
    pq.write_table(table.slice(0, 11), folder / "parts" / "a.parquet")
    pq.write_table(table.slice(11), folder / "parts" / "b.parquet")
    pq.write_table(pa.table({"input_ids": [word_ids(line) for line in lines]}), folder / "ids.parquet")
    saved = datasets.Dataset.from_dict({"text": lines, "id": list(range(len(lines)))})
    saved.save_to_disk(str(folder / "saved"))
    datasets.DatasetDict({"train": saved, "test": saved.select(range(3))}).save_to_disk(str(folder / "splits"))
    return {
        "text": f"text:path={folder / 'corpus.txt'}",
        "jsonl": f"jsonl:path={folder / 'corpus.jsonl'},field=body",
        "parquet": f"parquet:path={folder / 'corpus.parquet'}",
        "parquet folder": f"parquet:path={folder / 'parts'}",
        "saved dataset": f"hf:path={folder / 'saved'}",
        "saved split": f"hf:path={folder / 'splits'},split=train",
        "token ids": f"parquet:path={folder / 'ids.parquet'},column=input_ids,tokenized=true",
    }


@pytest.mark.slow
def test_every_source_of_the_same_texts_gives_the_same_store(tmp_path, model_dir, lines):
    specs = write_sources(tmp_path, lines)
    reference = arrays_of(run(model_dir, tmp_path / "text.zarr", specs.pop("text") + ",context=16"))
    for name, spec in specs.items():
        store = run(model_dir, tmp_path / f"{name}.zarr", spec + ",context=16")
        assert_same_arrays(arrays_of(store), reference)
    assert read_attrs(str(tmp_path / "parquet.zarr"))["task"]["rows"] == len(lines)  # from the Parquet metadata


@pytest.mark.slow
def test_token_ids_need_no_tokenizer(tmp_path, model_dir, sources, lines):
    bare = write_model(tmp_path / "bare", tokenizer=False)  # the same weights as model_dir, no tokenizer files
    store = run(bare, tmp_path / "ids.zarr", sources["token ids"] + ",context=16")
    reference = run(model_dir, tmp_path / "text.zarr", sources["text"] + ",context=16")
    for name in ("tokens", "valid", "target", "scored", "document", "offset", "resid_post", "q"):
        np.testing.assert_array_equal(store[name].values, reference[name].values, err_msg=name)
    assert (store["token_str"].values == reference["tokens"].values.astype(str)).all()  # a token's string is its id
    task = store.attrs["task"]
    assert (task["bos"], task["separator"], task["tokenizer"]) == (BOS, EOS, "token ids (no tokenizer)")  # config.json's
    with pytest.raises(ConfigError, match=r"a text corpus needs the model's tokenizer, and this model has none"):
        run(bare, tmp_path / "no.zarr", sources["text"] + ",context=16")


@pytest.mark.slow
def test_resuming_with_another_tokenizer_of_the_same_class_is_refused(tmp_path, model_dir, lines):
    text = write_lines(tmp_path / "corpus.txt", lines)
    out = tmp_path / "s.zarr"
    run(model_dir, out, f"text:path={text},context=16", n_samples=4)
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    write_word_tokenizer(other, split_punctuation=True)  # the same class, weights and tokens of this corpus; other rules
    with pytest.raises(JobMismatchError, match=r"made by a different job: its task.tokenizer_sha256 is '[0-9a-f]{64}', "
                                               r"this job's is '[0-9a-f]{64}'"):
        run(other, out, f"text:path={text},context=16", n_samples=4, mode="resume")
    assert read_attrs(str(out))["complete"]
    run(model_dir, out, f"text:path={text},context=16", n_samples=4, mode="resume")  # the same tokenizer resumes


# --- bfloat16 and float16 ---------------------------------------------------------------------------


def bfloat16_store(tmp_path, values: np.ndarray):
    """A store whose q holds the given bfloat16 values."""
    model = {"n_layers": 1, "d_model": 4, "n_heads": 2, "n_kv_heads": 2, "d_head": 2}
    writer = create_store(str(tmp_path / "bf16.zarr"), model=model, task={"name": "synthetic"}, n_samples=len(values),
                          n_pos=values.shape[2], sites=("q",), dtype="bfloat16", with_weights=False)
    n = len(values)
    writer.write(0, {"tokens": np.zeros((n, values.shape[2]), np.int32), "valid": np.ones((n, values.shape[2]), bool),
                     "pred": np.zeros((n, values.shape[2]), np.int32), "target": np.zeros((n, values.shape[2]), np.int32),
                     "scored": np.ones((n, values.shape[2]), bool), "q": values})
    writer.mark_shard_complete(0)
    writer.finish()
    return str(tmp_path / "bf16.zarr")


@pytest.mark.filterwarnings("ignore:invalid value encountered in equal:RuntimeWarning")  # zarr compares the NaNs
def test_bfloat16_round_trips_every_bit_pattern(tmp_path):
    bits = np.arange(2**16, dtype=np.uint16).reshape(2**10, 1, 16, 2, 2)  # every bfloat16, inf and nan included
    url = bfloat16_store(tmp_path, bits.view(bfloat16_dtype()))
    raw = zarr.open_group(url, mode="r")["q"]
    assert str(raw.metadata.data_type.to_json(3)) == "bfloat16"
    np.testing.assert_array_equal(raw[:].view(np.uint16), bits)
    plain = xr.open_zarr(url)  # plain xarray: bfloat16 values, bit for bit
    assert plain["q"].dtype == bfloat16_dtype()
    np.testing.assert_array_equal(plain["q"].values.view(np.uint16), bits)
    widened = open_store(url)["q"]  # open_store: float32, exactly the same numbers
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened.values.view(np.uint32), bits.astype(np.uint32) << 16)


@pytest.mark.slow
def test_xarray_in_a_fresh_process_reads_bfloat16_after_importing_the_store(tmp_path):
    values = np.linspace(-3e38, 3e38, 64, dtype=np.float32).reshape(2, 1, 8, 2, 2)
    url = bfloat16_store(tmp_path, values.astype(bfloat16_dtype()))
    script = (f"import orthosphere.store, xarray as xr; q = xr.open_zarr({url!r})['q']; "
              "print(q.dtype, float(q.astype('float32').values.max()))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["bfloat16", str(float(values.astype(bfloat16_dtype()).astype(np.float32).max()))]


@pytest.mark.slow
def test_bfloat16_extraction_holds_the_float32_values_rounded(tmp_path, model_dir, lines):
    text = write_lines(tmp_path / "corpus.txt", lines)
    exact = run(model_dir, tmp_path / "f32.zarr", f"text:path={text},context=16", n_samples=6)
    bf16 = run(model_dir, tmp_path / "bf16.zarr", f"text:path={text},context=16", n_samples=6, dtype="bfloat16")
    raw = xr.open_zarr(str(tmp_path / "bf16.zarr"))
    for site in ("resid_pre", "q", "k", "v", "resid_post"):
        rounded = torch.from_numpy(exact[site].values).to(torch.bfloat16).view(torch.int16).numpy()
        np.testing.assert_array_equal(raw[site].values.view(np.int16), rounded, err_msg=site)
        assert bf16[site].dtype == np.float32
    assert info(str(tmp_path / "bf16.zarr"))["dtype"] == "bfloat16"


@pytest.mark.slow
def test_float16_overflow_is_refused_and_bfloat16_keeps_it(tmp_path, lines):
    loud = write_model(tmp_path / "loud", embedding_scale=1e7)  # embeddings far beyond 65504
    text = write_lines(tmp_path / "corpus.txt", lines)
    out = tmp_path / "f16.zarr"
    with pytest.raises(Float16OverflowError, match=r"site resid_pre of layer 0 \(sample 0\) holds values beyond float16's range"):
        run(loud, out, f"text:path={text},context=16", n_samples=4, dtype="float16")
    assert not read_attrs(str(out))["complete"]
    kept = run(loud, tmp_path / "bf16.zarr", f"text:path={text},context=16", n_samples=4, dtype="bfloat16")
    assert float(abs(kept["resid_pre"]).max()) > 65504 and np.isfinite(kept["resid_pre"].values).all()


# --- jobs: Dask, resume, info ------------------------------------------------------------------------


@pytest.mark.slow
def test_packed_shards_on_dask_read_their_tokens_from_the_store(tmp_path, model_dir, lines):
    from distributed import Client, LocalCluster

    text = write_lines(tmp_path / "corpus.txt", lines)
    reference = arrays_of(run(model_dir, tmp_path / "local.zarr", f"text:path={text},context=16"))
    # the worker's default threads: shards run at once on the shared model (capture state belongs to each forward pass)
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        run_job(ExtractJob(model=str(model_dir), task=f"text:path={text},context=16", out=str(tmp_path / "dask.zarr"),
                           batch_size=3, device="cpu", samples_per_chunk=2, n_shards=3), client=client, progress=False)
    assert_same_arrays(arrays_of(open_store(str(tmp_path / "dask.zarr"))), reference)


def run_cli(model_dir, text, out, crash_at=None, resume=False, context=16, dtype="float16"):
    arguments = [CLI, "extract", str(model_dir), "--task", f"text:path={text},context={context}", "--out", str(out),
                 "--samples-per-chunk", "2", "--shards", "3", "--batch-size", "3", "--device", "cpu", "--dtype", dtype]
    environment = {key: value for key, value in os.environ.items() if key != "ORTHOSPHERE_CRASH_AT"}
    if crash_at:
        environment["ORTHOSPHERE_CRASH_AT"] = crash_at
    return subprocess.run(arguments + ["--resume"] * resume, env=environment, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("context, dtype", [(16, "float16"), (64, "float32")])
def test_killed_packed_job_resumes_bitwise_identical(tmp_path, model_dir, lines, context, dtype):
    """At context 64 in float32 every piece of every site is a multiple of 4096 bytes: on a local
    disk the chunks are written with O_DIRECT (store.stream); at 16 in float16 through the page cache."""
    from orthosphere.store.stream import DIRECT_ALIGNMENT

    text = write_lines(tmp_path / "corpus.txt", lines)
    reference = arrays_of(run(model_dir, tmp_path / "reference.zarr", f"text:path={text},context={context}", dtype=dtype))
    resid_sample = context * 32 * np.dtype(dtype).itemsize  # d_model 32; q, k and v as large or half as large
    assert (resid_sample // 2 % DIRECT_ALIGNMENT == 0) == (context == 64)
    out = tmp_path / "store.zarr"
    for attempt, point in enumerate(["samples-written:2", "chunk-written:2", "shard-complete:1"]):
        result = run_cli(model_dir, text, out, crash_at=point, resume=attempt > 0, context=context, dtype=dtype)
        assert result.returncode == -signal.SIGKILL, f"expected a SIGKILL at {point}: {result.stderr[-2000:]}"
    resumed = run_cli(model_dir, text, out, resume=True, context=context, dtype=dtype)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_arrays(arrays_of(open_store(str(out))), reference)


@pytest.mark.slow
def test_info_gives_bytes_per_real_token_within_two_percent_of_the_sites(tmp_path):
    wide = write_model(tmp_path / "wide", d_model=256)  # sites of 6 kB a token: like a real model's, they outweigh the rest
    text = write_lines(tmp_path / "corpus.txt", sentences(100))
    # whole chunks (a store's last chunk is stored whole however few samples it holds)
    options = {"dtype": "float16", "samples_per_chunk": 16, "batch_size": 16}
    run(wide, tmp_path / "packed.zarr", f"text:path={text},context=16", n_samples=128, **options)
    run(wide, tmp_path / "padded.zarr", f"text:path={text},max_length=16", n_samples=32, **options)
    packed, padded = info(str(tmp_path / "packed.zarr")), info(str(tmp_path / "padded.zarr"))
    assert packed["real_tokens"] == packed["positions"] == 128 * 16
    assert padded["real_tokens"] < padded["positions"]
    site_bytes = 2 * 2 * (4 * 256 + 4 * 64 + 2 * 2 * 64 + 1)  # float16, 2 layers: four d_model sites, q, k, v, norm_scale
    assert packed["site_bytes_per_position"] == site_bytes
    assert site_bytes < packed["bytes_per_real_token"] <= 1.02 * site_bytes  # tokens, labels and metadata: under 2 %
    assert padded["bytes_per_real_token"] > 1.02 * site_bytes  # padding costs what a real token does
    assert "kB per real token besides the weight maps" in format_info(packed)


def test_weight_and_corpus_hashes_are_computed_once_per_file_version(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTHOSPHERE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "weights.bin"
    data.write_bytes(b"abc" * 1000)
    first = hashing.files_sha256([data])
    monkeypatch.setattr(hashing.hashlib, "sha256", None)  # any further hashing would fail
    assert hashing.files_sha256([data]) == first
    monkeypatch.undo()
    monkeypatch.setenv("ORTHOSPHERE_CACHE", str(tmp_path / "cache"))
    data.write_bytes(b"abd" * 1000)  # same size, new content and modification time
    assert hashing.files_sha256([data]) != first


# --- bad input ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory, lines):
    return write_sources(tmp_path_factory.mktemp("sources"), lines)


@pytest.fixture(scope="module")
def earlier_store(tmp_path_factory, model_dir, lines):
    """A complete store that a job with bad input is asked to overwrite."""
    folder = tmp_path_factory.mktemp("earlier")
    run(model_dir, folder / "s.zarr", f"text:path={write_lines(folder / 'corpus.txt', lines)},context=16", n_samples=4)
    return str(folder / "s.zarr")


def source_paths(sources, bad_folder) -> dict[str, str]:
    """The paths the bad-input specs name: the good sources' and the folder of bad files."""
    folder = os.path.dirname(sources["text"].split("=", 1)[1])
    return {"parquet": f"{folder}/corpus.parquet", "saved": f"{folder}/saved", "splits": f"{folder}/splits",
            "jsonl": f"{folder}/corpus.jsonl", "text": f"{folder}/corpus.txt", "bad": str(bad_folder)}


def bad_files(folder):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "latin1.txt").write_bytes("the cat\na dog\nthe caf\xe9 sat\n".encode("latin-1"))
    (folder / "blank.txt").write_text("\n   \n\n")
    (folder / "short.txt").write_text("the cat\n")
    (folder / "bad.jsonl").write_text('{"text": "the cat"}\n{"text": "a dog"\n')
    (folder / "numbers.jsonl").write_text('{"text": 3}\n')
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / "empty.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2, 99]]}), folder / "outside.parquet")


@pytest.mark.parametrize("task, error", [
    ("parquet:path={parquet},column=body,context=8", r"corpus.parquet has no column 'body' \(columns: \['id', 'text'\]\)"),
    ("hf:path={saved},column=body,context=8", r"has no column 'body'"),
    ("jsonl:path={jsonl},field=text,context=8", r"corpus.jsonl, line 1: no field 'text' \(found \['body', 'id'\]\)"),
    ("parquet:path={parquet},column=id,context=8", r"column 'id' holds int64, not text"),
    ("jsonl:path={jsonl},field=id,context=8", r"line 1: 'id' holds int, not text"),
    ("parquet:path={parquet},column=text,tokenized=true,context=8", r"column 'text' holds string, not lists of integer token ids"),
    ("hf:path={splits},context=8", r"saved DatasetDict with splits \['train', 'test'\]: choose one with split=NAME"),
    ("hf:path={parquet},context=8", r"not a dataset saved with datasets' save_to_disk"),
    ("text:path={bad}/latin1.txt,context=8", r"latin1.txt, line 3: invalid UTF-8 \(invalid continuation byte at byte 7"),
    ("text:path={bad}/latin1.txt,document=file,context=8", r"latin1.txt, line 3: invalid UTF-8 \(invalid continuation"),
    ("text:path={bad}/blank.txt,context=8", r"holds no documents"),
    ("text:path={bad}/blank.txt,document=file,context=8", r"blank.txt holds no documents"),
    ("parquet:path={bad}/empty.parquet,context=8", r"holds no documents"),
    ("text:path={bad}/short.txt,context=8", r"has 2 tokens, fewer than one window of 7"),
    ("jsonl:path={bad}/bad.jsonl,context=8", r"bad.jsonl, line 2: not valid JSON"),
    ("jsonl:path={bad}/numbers.jsonl,context=8", r"line 1: 'text' holds int, not text"),
    ("parquet:path={bad}/outside.parquet,column=input_ids,tokenized=true,context=8", r"token id 99, outside the model's vocabulary 0..22"),
    ("text:path={bad}/missing.txt,context=8", r"missing.txt not found"),
    ("text:path={text},context=16", r"packs into \d+ windows of 16 tokens, fewer than n_samples=1000: ask for fewer samples"),
])
@pytest.mark.slow
def test_bad_corpus_is_a_clear_error_and_leaves_the_store_there_untouched(tmp_path, model_dir, sources, earlier_store,
                                                                          task, error):
    bad_files(tmp_path)
    out = tmp_path / "s.zarr"
    shutil.copytree(earlier_store, out)  # mode="overwrite": the store there is replaced only once the corpus is read
    samples = 1000 if "fewer than n_samples" in error else None
    with pytest.raises((CorpusError, ConfigError), match=error):
        run(model_dir, out, task.format(**source_paths(sources, tmp_path)), n_samples=samples, mode="overwrite")
    assert read_attrs(str(out)) == read_attrs(earlier_store)  # still complete, still the earlier job's
    np.testing.assert_array_equal(open_store(str(out))["q"].values, open_store(earlier_store)["q"].values)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".orthosphere-tokens-")]


@pytest.mark.parametrize("task, samples, error", [
    ("text:path={text},context=65", None, r"samples of 65 positions are longer than the model's 64 positions: use context=64 or less"),
    ("parquet:path={parquet},max_length=8", 1000, r"corpus.parquet has 30 rows, fewer than n_samples=1000 \(one padded sample a document\)"),
])
def test_a_layout_the_model_or_corpus_cannot_hold_is_refused_before_tokenising(tmp_path, model_dir, sources, monkeypatch,
                                                                               task, samples, error):
    monkeypatch.setattr(TokenizedCorpus, "_tokenise", lambda *_: pytest.fail("the corpus was tokenised"))
    with pytest.raises(ConfigError, match=error):
        run(model_dir, tmp_path / "s.zarr", task.format(**source_paths(sources, tmp_path)), n_samples=samples)
    assert not (tmp_path / "s.zarr").exists()


def test_padded_documents_longer_than_the_model_takes_are_refused_once_tokenised(tmp_path, model_dir):
    text = write_lines(tmp_path / "long.txt", ["the cat sat", " ".join(["dog"] * 80)])
    with pytest.raises(ConfigError, match=r"samples of 81 positions are longer than the model's 64 positions: "
                                          r"use max_length=64 or less"):
        run(model_dir, tmp_path / "s.zarr", f"text:path={text},max_length=100")
    assert not (tmp_path / "s.zarr").exists()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".orthosphere-tokens-")]


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1], "long_factor": [2.0, 4.0], "original_max_position_embeddings": 16}


def test_padded_documents_straddling_a_longrope_switch_are_refused(tmp_path):
    """A longrope model picks its rotary set from a batch's largest position: a short document padded
    past original_max_position_embeddings would be stored with the long set it does not get alone."""
    model_dir = write_model(tmp_path / "longrope", d_model=16, rope_parameters=LONGROPE)
    text = write_lines(tmp_path / "docs.txt", ["the cat sat", " ".join(["dog"] * 20)])
    with pytest.raises(ConfigError, match=r"padded documents of 4-21 tokens with a longrope model: .*"
                                          r"original_max_position_embeddings=16 .*the 1 documents of 16 tokens or fewer.*"
                                          r"use max_length=16 or less, or packed windows"):
        run(model_dir, tmp_path / "s.zarr", f"text:path={text},max_length=100")
    assert not (tmp_path / "s.zarr").exists()
    cut = run(model_dir, tmp_path / "cut.zarr", f"text:path={text},max_length=16")  # every document on the short set
    assert cut.sizes["pos"] == 16
    long_only = write_lines(tmp_path / "long.txt", [" ".join(["dog"] * 20), " ".join(["cat"] * 24)])
    assert run(model_dir, tmp_path / "long.zarr", f"text:path={long_only},max_length=100").sizes["pos"] == 25


def test_a_dynamic_rope_model_is_told_why_its_limit_is_its_original_length(tmp_path):
    model_dir = write_model(tmp_path / "dynamic", max_positions=16, d_model=16,
                            rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    text = write_lines(tmp_path / "docs.txt", [" ".join(["dog"] * 20)])
    with pytest.raises(ConfigError, match=r"longer than the model's 16 positions \(its dynamic rope rescales its frequencies "
                                          r"beyond them by each batch's length.*use max_length=16 or less"):
        run(model_dir, tmp_path / "s.zarr", f"text:path={text},max_length=100")
