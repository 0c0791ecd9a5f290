"""Corpora: sources (text, JSONL, Parquet, saved datasets), packing, labels, bfloat16 and float16 range, resume.

A tiny Llama with a word-level tokenizer built here (BOS <s>, EOS </s>; nothing downloaded) runs
over generated sentences, so every token is a word and the tokenised corpus is known exactly.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import xarray as xr
import zarr

from orthosphere.extract import corpus as corpus_module
from orthosphere.extract import hashing
from orthosphere.extract.corpus import CorpusError
from orthosphere.extract.job import ExtractJob, Float16OverflowError, extract
from orthosphere.extract.model import ConfigError
from orthosphere.store import create_store, format_info, info, open_store, read_attrs
from orthosphere.store.bfloat16 import BFLOAT16

WORDS = "the a cat dog sat ran on under mat rug big small red blue and then bird tree sang".split()
SPECIALS = ["[PAD]", "[UNK]", "<s>", "</s>"]
VOCAB = SPECIALS + WORDS
PAD, BOS, EOS = 0, 2, 3
NOT_APPLICABLE = int(np.iinfo(np.int64).min)
CLI = os.path.join(os.path.dirname(sys.executable), "orthosphere")


def write_model(directory, max_positions: int = 64, embedding_scale: float = 1.0):
    """A tiny random Llama (2 layers, d_model 32, grouped-query attention) and its word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(VOCAB), max_position_embeddings=max_positions,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embedding_scale)
    model.save_pretrained(directory, safe_serialization=True)
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(VOCAB)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)
    return directory


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
    extract(ExtractJob(model=str(model_dir), task=task, out=str(out), **options), progress=False)
    return open_store(str(out))


def arrays_of(store) -> dict[str, np.ndarray]:
    return {name: store[name].values for name in store.variables}


def assert_same_arrays(left: dict, right: dict):
    assert left.keys() == right.keys()
    for name in left:
        np.testing.assert_array_equal(left[name], right[name], err_msg=name)


# --- packing ---------------------------------------------------------------------------------------


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


def test_without_bos_and_separator_the_windows_are_the_stream(tmp_path, model_dir, lines):
    text = write_lines(tmp_path / "corpus.txt", lines)
    store = run(model_dir, tmp_path / "s.zarr", f"text:path={text},context=8,bos=false,separator=none", n_samples=20)
    stream = np.concatenate([word_ids(line) for line in lines])
    np.testing.assert_array_equal(store["tokens"].values.ravel(), stream[:160])
    assert store.attrs["task"]["bos"] is None and "dropped_tokens" not in store.attrs["task"]  # --samples: a prefix


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


def test_a_whole_file_is_one_document_read_in_pieces(tmp_path, model_dir, lines, monkeypatch):
    text = write_lines(tmp_path / "book.txt", lines)
    whole = arrays_of(run(model_dir, tmp_path / "whole.zarr", f"text:path={text},document=file,context=16"))
    np.testing.assert_array_equal(whole["tokens"][:, 1:].ravel()[:100], np.concatenate([word_ids(line) for line in lines])[:100])
    assert (whole["document"][:, 1:] == 0).all()
    np.testing.assert_array_equal(whole["offset"][:, 1:].ravel(), np.arange(whole["offset"][:, 1:].size))
    monkeypatch.setattr(corpus_module, "PIECE_BYTES", 50)  # many pieces, each tokenised on its own
    assert_same_arrays(arrays_of(run(model_dir, tmp_path / "pieces.zarr", f"text:path={text},document=file,context=16")), whole)


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
    url = bfloat16_store(tmp_path, bits.view(BFLOAT16))
    raw = zarr.open_group(url, mode="r")["q"]
    assert str(raw.metadata.data_type.to_json(3)) == "bfloat16"
    np.testing.assert_array_equal(raw[:].view(np.uint16), bits)
    plain = xr.open_zarr(url)  # plain xarray: bfloat16 values, bit for bit
    assert plain["q"].dtype == BFLOAT16
    np.testing.assert_array_equal(plain["q"].values.view(np.uint16), bits)
    widened = open_store(url)["q"]  # open_store: float32, exactly the same numbers
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened.values.view(np.uint32), bits.astype(np.uint32) << 16)


def test_xarray_in_a_fresh_process_reads_bfloat16_after_importing_the_store(tmp_path):
    values = np.linspace(-3e38, 3e38, 64, dtype=np.float32).reshape(2, 1, 8, 2, 2)
    url = bfloat16_store(tmp_path, values.astype(BFLOAT16))
    script = (f"import orthosphere.store, xarray as xr; q = xr.open_zarr({url!r})['q']; "
              "print(q.dtype, float(q.astype('float32').values.max()))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["bfloat16", str(float(values.astype(BFLOAT16).astype(np.float32).max()))]


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


def test_packed_shards_on_dask_read_their_tokens_from_the_store(tmp_path, model_dir, lines):
    from distributed import Client, LocalCluster

    text = write_lines(tmp_path / "corpus.txt", lines)
    reference = arrays_of(run(model_dir, tmp_path / "local.zarr", f"text:path={text},context=16"))
    # the worker's default threads: shards run at once on the shared model (capture state belongs to each forward pass)
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        extract(ExtractJob(model=str(model_dir), task=f"text:path={text},context=16", out=str(tmp_path / "dask.zarr"),
                           batch_size=3, device="cpu", samples_per_chunk=2, n_shards=3), client=client, progress=False)
    assert_same_arrays(arrays_of(open_store(str(tmp_path / "dask.zarr"))), reference)


def run_cli(model_dir, text, out, crash_at=None, resume=False):
    arguments = [CLI, "extract", str(model_dir), "--task", f"text:path={text},context=16", "--out", str(out),
                 "--samples-per-chunk", "2", "--shards", "3", "--batch-size", "3", "--device", "cpu"]
    environment = {key: value for key, value in os.environ.items() if key != "ORTHOSPHERE_CRASH_AT"}
    if crash_at:
        environment["ORTHOSPHERE_CRASH_AT"] = crash_at
    return subprocess.run(arguments + ["--resume"] * resume, env=environment, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_killed_packed_job_resumes_bitwise_identical(tmp_path, model_dir, lines):
    text = write_lines(tmp_path / "corpus.txt", lines)
    reference = arrays_of(run(model_dir, tmp_path / "reference.zarr", f"text:path={text},context=16"))
    out = tmp_path / "store.zarr"
    for attempt, point in enumerate(["samples-written:2", "chunk-written:2", "shard-complete:1"]):
        result = run_cli(model_dir, text, out, crash_at=point, resume=attempt > 0)
        assert result.returncode == -signal.SIGKILL, f"expected a SIGKILL at {point}: {result.stderr[-2000:]}"
    resumed = run_cli(model_dir, text, out, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_arrays(arrays_of(open_store(str(out))), reference)


def test_info_gives_bytes_per_real_token(tmp_path, model_dir, lines):
    text = write_lines(tmp_path / "corpus.txt", lines)
    run(model_dir, tmp_path / "packed.zarr", f"text:path={text},context=16", dtype="float16")
    run(model_dir, tmp_path / "padded.zarr", f"text:path={text},max_length=16", dtype="float16")
    packed, padded = info(str(tmp_path / "packed.zarr")), info(str(tmp_path / "padded.zarr"))
    assert packed["real_tokens"] == packed["positions"] == packed["n_samples"] * 16
    assert padded["real_tokens"] < padded["positions"]
    site_bytes = 2 * 2 * (4 * 32 + 4 * 8 + 2 * 2 * 8)  # float16, 2 layers: four d_model sites, q, k and v
    assert packed["site_bytes_per_position"] == site_bytes
    assert site_bytes < packed["bytes_per_real_token"] < padded["bytes_per_real_token"]
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
    ("text:path={bad}/latin1.txt,context=8", r"latin1.txt, line 3: invalid UTF-8"),
    ("text:path={bad}/blank.txt,context=8", r"holds no documents"),
    ("parquet:path={bad}/empty.parquet,context=8", r"holds no documents"),
    ("text:path={bad}/short.txt,context=8", r"has 2 tokens, fewer than one window of 7"),
    ("jsonl:path={bad}/bad.jsonl,context=8", r"bad.jsonl, line 2: not valid JSON"),
    ("jsonl:path={bad}/numbers.jsonl,context=8", r"line 1: 'text' holds int, not text"),
    ("parquet:path={bad}/outside.parquet,column=input_ids,tokenized=true,context=8", r"token id 99, outside the model's vocabulary 0..22"),
    ("text:path={bad}/missing.txt,context=8", r"missing.txt not found"),
    ("text:path={text},context=65", r"samples of 65 positions are longer than the model's 64 positions: use context=64 or less"),
    ("text:path={text},context=16", r"packs into \d+ windows of 16 tokens, fewer than --samples 1000"),
])
def test_bad_corpus_is_a_clear_error_and_leaves_no_store(tmp_path, model_dir, sources, task, error):
    folder = os.path.dirname(sources["text"].split("=", 1)[1])
    bad_files(tmp_path)
    paths = {"parquet": f"{folder}/corpus.parquet", "saved": f"{folder}/saved", "splits": f"{folder}/splits",
             "jsonl": f"{folder}/corpus.jsonl", "text": f"{folder}/corpus.txt", "bad": str(tmp_path)}
    out = tmp_path / "s.zarr"
    samples = 1000 if "fewer than --samples" in error else None
    with pytest.raises((CorpusError, ConfigError), match=error):
        run(model_dir, out, task.format(**paths), n_samples=samples)
    assert not out.exists()
