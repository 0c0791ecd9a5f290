"""The model's attention from a store: the stored `pattern`, or recomputed from the stored q and k.

q and k are stored as they enter the score, and the store's model description says, per layer,
what turns q . k into the model's score (``model["score"]``, see store/SCHEMA.md). ``ScoreTerms``
holds one layer's terms, and ``BlockAttention`` is the one implementation that turns stored q, k
and these terms into the model's attention: ``attention_from_qk`` (the analyses) is its clean
pattern, and the replay perturbs exactly its score, passing the norm factors of q and k to it
(``BlockAttention.scores``). For query position i and key position j of head h:

    score = softcap(scale * q_i . k_j) + alibi_h(i, j) + relative_h(j - i),
    attention_j = exp(score_j) / (sum over allowed j' of exp(score_j') + exp(sink_h))

- ``scale``: the layer's multiplier of q . k (1/sqrt(d_head), Granite's attention_multiplier,
  Gemma's query_pre_attn_scalar^-1/2, GPT-2's per-layer scale_attn_by_inverse_layer_idx ...);
- ``softcap``: c * tanh(x / c) when the layer soft-caps its logits (Gemma 2), else x;
- ``alibi``: -slope_h * (p_i - p_j), p counting the valid tokens before a position (Bloom);
  softmax cannot tell it from the model's slope_h * p_j;
- ``relative``: T5's learned relative position bias, a table of head h's bias by key offset
  j - i (positions in the padded sequence) from -D to D, whose ends hold for every farther key;
- ``sink``: GPT-OSS's learned sink logit of head h, a key every query sees whose value is
  zero: it takes its share of the softmax and leaves the keys' attention summing to less than 1
  (absent: exp(sink_h) = 0, the plain softmax);
- allowed keys: valid (not padding), j <= i when causal, and |i - j| < window when the layer has a
  sliding window (transformers' convention, positions counted in the padded sequence; two-sided
  in a bidirectional model, ModernBERT's local layers).

Stores written before the score terms were stored hold only ``attn_scale`` and ``causal``:
their terms are those alone. ``store_attention`` gives the attention lazily for a whole store,
one block of samples at a time, never the whole pattern in memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import dask.array as da
import numpy as np
import xarray as xr

from .blocks import single_block
from .errors import AnalysisError
from .inputs import align, as_float32, check_layers, require_site, square_norms, store_url


@dataclass(frozen=True)
class ScoreTerms:
    """What turns one layer's q . k into the model's score (see the module docstring)."""

    scale: float
    causal: bool
    sliding_window: int | None = None
    softcap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    relative_bias: tuple[tuple[float, ...], ...] | None = None
    """(head, 2D + 1) bias by key offset j - i from -D to D (T5), or None."""
    sink_logits: tuple[float, ...] | None = None
    """One learned sink logit per head in the softmax's denominator (GPT-OSS), or None."""

    @property
    def has_bias(self) -> bool:
        """Whether the score adds a position bias (ALiBi or relative) after the soft-cap."""
        return self.alibi_slopes is not None or self.relative_bias is not None

    @classmethod
    def of_layer(cls, model: dict, layer: int) -> ScoreTerms:
        """Layer `layer`'s terms from a store's model description; missing keys are an AnalysisError."""
        missing = [key for key in ("attn_scale", "causal") if key not in model]
        if missing:
            raise AnalysisError(
                f"the store's model description lacks {missing}, which recomputing attention from q and k needs: "
                "re-extract the store with a current orthosphere, or extract the pattern site"
            )
        score = model.get("score")
        if score is None:
            return cls(scale=float(model["attn_scale"]), causal=bool(model["causal"]))
        slopes = score.get("alibi_slopes")
        window, softcap = score["sliding_window"][layer], score["softcap"][layer]
        return cls(
            scale=float(score["scale"][layer]), causal=bool(model["causal"]),
            sliding_window=None if window is None else int(window), softcap=None if softcap is None else float(softcap),
            alibi_slopes=None if slopes is None else tuple(float(s) for s in slopes[layer]),
            relative_bias=_relative_table(score.get("relative_bias"), layer),
            sink_logits=None if score.get("sink_logits") is None else tuple(float(s) for s in score["sink_logits"][layer]),
        )

    def sink_column(self) -> np.ndarray | None:
        """The sink logits as a float32 (head, 1) column, which broadcasts over (sample, head, qpos); None without."""
        return None if self.sink_logits is None else np.asarray(self.sink_logits, np.float32)[:, None]


def _relative_table(relative: dict | None, layer: int) -> tuple[tuple[float, ...], ...] | None:
    """Layer `layer`'s relative-bias table from the description's score.relative_bias, or None."""
    if relative is None:
        return None
    return tuple(tuple(float(b) for b in row) for row in relative["tables"][relative["table_of_layer"][layer]])


def allowed_keys(valid: np.ndarray, terms: ScoreTerms) -> np.ndarray:
    """(sample, qpos, kpos) mask of the keys each query may attend to: valid, earlier or equal
    when causal, within the sliding window."""
    valid = np.asarray(valid, bool)
    n_pos = valid.shape[-1]
    allowed = np.broadcast_to(valid[..., None, :], (*valid.shape, n_pos))
    offset = np.arange(n_pos)[:, None] - np.arange(n_pos)[None, :]  # i - j
    reach = np.ones((n_pos, n_pos), bool)
    if terms.causal:
        reach &= offset >= 0
    if terms.sliding_window is not None:
        reach &= np.abs(offset) < terms.sliding_window
    return allowed & reach


def score_bias(valid: np.ndarray, terms: ScoreTerms) -> np.ndarray | None:
    """The position bias, float32: ALiBi's (sample, head, qpos, kpos), the relative bias's (1, head,
    qpos, kpos); None when the score has none."""
    if terms.relative_bias is not None:
        table = np.asarray(terms.relative_bias, np.float32)
        reach = table.shape[1] // 2
        positions = np.arange(np.shape(valid)[-1])
        offsets = np.clip(positions[None, :] - positions[:, None], -reach, reach) + reach  # j - i
        return table[:, offsets][None]
    if terms.alibi_slopes is None:
        return None
    counted = np.cumsum(np.asarray(valid, bool), axis=-1) - 1  # p: valid tokens before each position
    distance = (counted[..., :, None] - counted[..., None, :]).astype(np.float64)  # p_i - p_j
    slopes = np.asarray(terms.alibi_slopes, np.float64)[:, None, None]
    return (-slopes * distance[..., None, :, :]).astype(np.float32)


def per_head(kv: np.ndarray, n_heads: int) -> np.ndarray:
    """A (sample, pos, kv_head, ...) array for every query head: head h reads kv_head h // group."""
    group = n_heads // kv.shape[2]
    return np.repeat(kv, group, axis=2) if group > 1 else kv


def key_major_dots(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q . k laid out (kpos, sample, head, qpos), C-contiguous, float32 as in the model; heads share
    kv_heads in groups (head h reads kv_head h // group). One product per (sample, kv_head) covers its
    group's heads, read from q and k in their stored layout and written in place into the key-major
    result: no per-head copy of k and no transposed copies."""
    n_samples, n_pos, n_heads, d_head = q.shape
    n_keys, n_kv_heads = k.shape[1], k.shape[2]
    group = n_heads // n_kv_heads
    queries = np.asarray(q, np.float32).reshape(n_samples, n_pos, n_kv_heads, group, d_head).transpose(0, 2, 3, 4, 1)
    keys = np.asarray(k, np.float32).transpose(0, 2, 1, 3)[:, :, None]  # (sample, kv_head, 1, kpos, d_head)
    dots = np.empty((n_keys, n_samples, n_heads, n_pos), np.float32)
    grouped = dots.reshape(n_keys, n_samples, n_kv_heads, group, n_pos).transpose(1, 2, 3, 0, 4)
    np.matmul(keys, queries, out=grouped)
    return dots


@dataclass(frozen=True)
class ScoreFrame:
    """What a block's score takes from its valid tokens and the layer's terms, key-major as
    ``BlockAttention`` lays it out: the allowed keys per query, the queries that may see none, the
    refused (kpos, sample, 1, qpos) scores, and the offset every score adds after the soft-cap (the
    position bias and the mask, -inf where refused)."""

    n_allowed: np.ndarray
    """(sample, qpos) allowed keys."""
    no_keys: np.ndarray | None
    """(sample, 1, qpos) queries that may see no key (scored unmasked, attention all zero), or None."""
    refused: np.ndarray
    offset: np.ndarray

    @classmethod
    def of(cls, valid: np.ndarray, terms: ScoreTerms) -> ScoreFrame:
        valid = np.asarray(valid, bool)
        allowed = allowed_keys(valid, terms)  # (sample, qpos, kpos)
        n_allowed = allowed.sum(axis=-1)
        no_keys = n_allowed == 0
        refused = ~(allowed | no_keys[..., None]).transpose(2, 0, 1)[:, :, None, :]  # (kpos, sample, 1, qpos)
        mask = np.where(refused, np.float32(-np.inf), np.float32(0))
        bias = score_bias(valid, terms)
        offset = mask if bias is None else np.ascontiguousarray(bias.transpose(3, 0, 1, 2) + mask)
        return cls(n_allowed, no_keys[:, None, :] if no_keys.any() else None, refused, offset)


@dataclass(eq=False)
class KeyMajorScores:
    """Scaled dot products (kpos, sample, head, qpos) and what turns them into scores and attention:
    the layer's terms, the offset added after the soft-cap (position bias, and the mask: -inf where
    refused) and the queries that may see no key ((sample, 1, qpos), or None)."""

    terms: ScoreTerms
    scaled_dots: np.ndarray
    offset: np.ndarray | None
    no_keys: np.ndarray | None

    def scores(self, factor: np.ndarray | None = None) -> np.ndarray:
        """The masked score (kpos, sample, head, qpos) of the scaled dot products times `factor`:
        soft-capped, plus the bias and the mask. `factor`, a float32 array of that shape (the
        product of the norm factors of q and k), is used as scratch space; without it, the clean
        score."""
        scaled = self.scaled_dots.copy() if factor is None else np.multiply(factor, self.scaled_dots, out=factor)
        return self.scores_of_scaled(scaled)

    def scores_of_scaled(self, scaled: np.ndarray) -> np.ndarray:
        """The masked score of scaled dot products (perturbed ones, of this shape), in place:
        softcap * tanh(scaled / softcap) (the model's order of operations) plus the offset."""
        if self.terms.softcap is not None:
            softcap = np.float32(self.terms.softcap)
            np.divide(scaled, softcap, out=scaled)
            np.tanh(scaled, out=scaled)
            scaled *= softcap
        scaled += self.offset
        return scaled

    def softmax(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Attention over keys (axis 0) from ``scores``, in place; also the score maxima over the keys
        and the softmax denominators relative to them (sample, head, qpos: the sink's term included,
        so that the largest attention is 1 / total), inf for a query that may see no key."""
        peak = scores.max(axis=0)
        scores -= peak
        np.exp(scores, out=scores)
        total = scores.sum(axis=0)
        sink = self.terms.sink_column()
        if sink is not None:
            with np.errstate(over="ignore"):  # a sink far above every key's score: inf, the keys' attention 0
                total += np.exp(sink - peak)
        if self.no_keys is not None:
            np.copyto(total, np.float32(np.inf), where=self.no_keys)
        scores /= total
        return scores, peak, total


@dataclass(eq=False)
class ScoreWindow(KeyMajorScores):
    """The scores of a range of queries over the range of keys any of them may see, and their clean
    attention, as contiguous arrays of one shape (``BlockAttention.window``): outside the keys, every
    query's attention is zero, clean or perturbed. Where the score adds nothing but the mask (no
    soft-cap, no position bias), ``scaled_dots`` holds the mask already (-inf where refused) and
    ``offset`` is None: a perturbed score is then two products, not three passes."""

    attention: np.ndarray
    keys: slice
    queries: slice

    def perturbed_scores(self, key_factor: np.ndarray, query_factor: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The masked score of the scaled dot products times the norm factors of the keys, float32
        (key, sample, kv_head, 1), and of the queries (1, sample, head, query), into `out`. Heads
        share their kv_head's factor: it multiplies (key, sample, kv_head, group x query) views, whose
        rows are longer than one head's, where numpy's broadcasting costs most."""
        n_keys, n_samples, n_kv_heads = key_factor.shape[:3]
        np.multiply(self.scaled_dots.reshape(n_keys, n_samples, n_kv_heads, -1), key_factor,
                    out=out.reshape(n_keys, n_samples, n_kv_heads, -1))
        out *= query_factor
        if self.offset is not None:
            return self.scores_of_scaled(out)
        if key_factor.min() <= 0 or query_factor.min() <= 0:  # a reversed norm: -inf times it is not -inf
            np.copyto(out, np.float32(-np.inf), where=np.isneginf(self.scaled_dots))
        return out


@dataclass(eq=False)
class BlockAttention(KeyMajorScores):
    """One layer's score and attention for a block of samples: the one implementation.

    Built by ``of`` from q (sample, pos, head, d_head), k (sample, pos, kv_head, d_head), valid
    (sample, pos) and the layer's score terms. Arrays are laid out key-major, (kpos, sample, head,
    qpos), float32: every reduction over keys is an element-wise pass over contiguous memory and
    yields per-query arrays (sample, head, qpos) directly, which the replay's kernel needs. Dot
    products are bilinear, so the score of queries and keys scaled by norm factors (1 + kq_i),
    (1 + kk_j) is ``scores`` of the factor (1 + kq_i)(1 + kk_j). A query that may see no key is
    scored unmasked (so that no NaN arises) and gets an all-zero attention row. ``attention`` is
    the clean attention, ``total`` its softmax denominators.
    """

    valid: np.ndarray
    n_allowed: np.ndarray
    """(sample, qpos) allowed keys."""
    n_kv_heads: int
    attention: np.ndarray | None = None
    total: np.ndarray | None = None

    @classmethod
    def of(cls, q: np.ndarray, k: np.ndarray, valid: np.ndarray, terms: ScoreTerms) -> BlockAttention:
        valid = np.asarray(valid, bool)
        frame = ScoreFrame.of(valid, terms)
        scaled_dots = key_major_dots(q, k)
        scaled_dots *= np.float32(terms.scale)
        np.copyto(scaled_dots, np.float32(0), where=frame.refused)
        block = cls(terms, scaled_dots, frame.offset, frame.no_keys, valid, frame.n_allowed, k.shape[2])
        block.attention, _, block.total = block.softmax(block.scores())
        return block

    @property
    def pattern(self) -> np.ndarray:
        """The clean attention as (sample, head, qpos, kpos), a view."""
        return self.attention.transpose(1, 2, 3, 0)

    def received(self, mask: np.ndarray) -> np.ndarray:
        """(sample, head, kpos) attention each key in `mask` (sample, pos) receives from the queries in
        it, float32 (einsum reads the key-major attention in place; a matrix product would copy it)."""
        weights = np.asarray(mask, np.float32)
        return np.einsum("kshq,sq->shk", self.attention, weights) * weights[:, None, :]

    def window(self, queries: slice) -> ScoreWindow | None:
        """The scores and clean attention of `queries` over the keys any of them may see (None when
        they may see none), as contiguous copies: what a pass over them needs, and no more."""
        allowed = np.isfinite(self.offset[:, :, :, queries]).any(axis=2) & (self.n_allowed[:, queries] > 0)
        seen = allowed.any(axis=(1, 2))  # (kpos,)
        if not seen.any():
            return None
        first, last = np.flatnonzero(seen)[[0, -1]]
        keys = slice(int(first), int(last) + 1)
        no_keys = None if self.no_keys is None else self.no_keys[:, :, queries]

        def cut(array):  # a contiguous copy (ascontiguousarray would return the block's own array when whole)
            return array[keys, :, :, queries].copy()

        dots = cut(self.scaled_dots)
        offset = np.ascontiguousarray(np.broadcast_to(self.offset[keys, :, :, queries], dots.shape))  # added unbroadcast: 3x faster
        if self.terms.softcap is None and not self.terms.has_bias:
            dots += offset
            offset = None
        return ScoreWindow(self.terms, dots, offset, no_keys, cut(self.attention), keys, queries)


def attention_from_qk(q: np.ndarray, k: np.ndarray, valid: np.ndarray, terms: ScoreTerms) -> np.ndarray:
    """Pattern (sample, head, qpos, kpos), float32 as in the model, from q (sample, pos, head, d_head),
    k (sample, pos, kv_head, d_head), valid (sample, pos) and the layer's score terms; head h reads
    kv_head h // (n_heads // n_kv_heads). A query that may see no key gets an all-zero row. A view of
    the key-major computation (not C-contiguous: copy it where that matters)."""
    return BlockAttention.of(q, k, valid, terms).pattern


def analysed_tokens(valid: np.ndarray, exclude_start: bool) -> np.ndarray:
    """(sample, pos) tokens the analyses count in a block (``inputs.token_mask``): the valid ones,
    without each sequence's first valid one when `exclude_start`."""
    valid = np.asarray(valid, bool)
    return valid & (np.cumsum(valid, axis=1) != 1) if exclude_start else valid


def attention_inputs(dataset: xr.Dataset, layer: int) -> list[tuple]:
    """The delayed (q, k, valid) blocks of one layer, along q's sample chunks: the store's read tasks,
    the same keys for every analysis of a call."""
    q = da.asarray(dataset["q"].sel(layer=layer).data)
    q = align(q, q)
    arrays = (q, align(da.asarray(dataset["k"].sel(layer=layer).data), q), align(da.asarray(dataset["valid"].data), q))
    return list(zip(*(array.to_delayed(optimize_graph=False).ravel() for array in arrays)))


def query_sums(attention: np.ndarray, valid: np.ndarray, terms: ScoreTerms, sparse_threshold: float,
               min_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (sample, head) of a block, float64: the attention its analysed queries (valid, not the sequence's
    start token) put on the start token, summed over them; and how many of them may see at least
    `min_keys` keys and put at least `sparse_threshold` on one. `attention` is key-major (kpos, sample,
    head, qpos), a numpy array or a view (norm_geometry's sinks and sparse share)."""
    valid = np.asarray(valid, bool)
    on_start = attention[np.argmax(valid, axis=1), np.arange(len(valid))]  # (sample, head, qpos): each start token's
    sparse = attention.max(axis=0) >= sparse_threshold
    return (np.einsum("shq,sq->sh", on_start, analysed_tokens(valid, True).astype("float64")),
            np.einsum("shq,sq->sh", sparse.astype("float64"), sparse_candidates(valid, terms, min_keys).astype("float64")))


def sparse_candidates(valid: np.ndarray, terms: ScoreTerms, min_keys: int) -> np.ndarray:
    """(sample, qpos) the analysed queries (``analysed_tokens`` without the start token) that may see at
    least `min_keys` keys: those whose sparse attention norm_geometry counts."""
    return analysed_tokens(valid, True) & (allowed_keys(valid, terms).sum(axis=-1) >= min_keys)


def token_norms(block) -> np.ndarray:
    """|x| (float32) of each token (and head) of a block of a site (sample, pos, ..., width)."""
    return np.sqrt(square_norms(as_float32(np.asarray(single_block(block)))))


SHARED_SITES = ("q", "k", "v")
"""The sites whose blocks the attention's tasks read (v: the replay's messages), and whose norms they
hand to the norms of the call (``AttentionShare``)."""


@dataclass(frozen=True)
class Wish:
    """What the analyses of a call wish from the attention's tasks of one layer and device: the attention
    each key receives, per value of ``exclude_start`` (`received`); |x| of the shared `sites`; the start
    token's attention and the sparse queries, per (sparse_threshold, min_keys) (`queries`, ``query_sums``)."""

    received: tuple[bool, ...] = ()
    sites: tuple[str, ...] = ()
    queries: tuple[tuple[float, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.received or self.sites or self.queries)


class AttentionShare:
    """One ``run_analyses`` call's sharing of the tasks that read a block's q, k and v and compute its
    clean attention, handed to the plans of the analyses that share it (``Analysis.shares_attention``:
    the norms, norm_geometry and the replay; an analysis run alone gets none): the norms and
    norm_geometry, planned first, ``wish`` for what they read of the attention (the attention each key
    receives, |x| of the shared sites, the start token's attention and the sparse queries); the replay's
    block tasks, which read those blocks and compute the attention anyway, compute these too
    (``kernels.attention_sums``) and ``provide`` them; the wishers' work, built when its pass computes (a
    deferred ``Plan``), reads the ``provider`` tasks' outputs. Each block's attention is computed once a
    call, and each block of q, k and v has one reader: a second one, which Dask may run long after the
    first, would hold the block in memory until then (every q block of every layer, on a language model's
    store)."""

    def __init__(self):
        self.wishes: dict[tuple[int, str], Wish] = {}
        self.providers: dict[tuple[int, str], tuple[list, tuple[str, ...]]] = {}

    def wish(self, layer: int, device: str, *, exclude_start: bool | None = None, norm_sites: tuple[str, ...] = (),
             queries: tuple[float, int] | None = None) -> None:
        """Add to the layer's wish: the received attention for `exclude_start`, the norms of `norm_sites`, the
        query sums for `queries` (sparse_threshold, min_keys)."""
        before = self.wishes.get((layer, device), Wish())
        self.wishes[layer, device] = Wish(
            tuple(sorted(set(before.received) | ({exclude_start} if exclude_start is not None else set()))),
            tuple(site for site in SHARED_SITES if site in before.sites or site in norm_sites),
            tuple(sorted(set(before.queries) | ({queries} if queries is not None else set()))))

    def wished(self, layer: int, device: str) -> Wish:
        """What is wished for at this layer and device."""
        return self.wishes.get((layer, device), Wish())

    def provide(self, layer: int, device: str, tasks: list, norm_sites: tuple[str, ...]) -> None:
        """Per block of samples, a delayed ``kernels.attention_sums`` dict, holding the norms of `norm_sites`."""
        self.providers[layer, device] = (tasks, norm_sites)

    def provider(self, layer: int, device: str) -> tuple[list, tuple[str, ...]] | None:
        return self.providers.get((layer, device))


def attention_source(dataset: xr.Dataset) -> str:
    """"pattern" when the store holds it, else "q,k" (recomputed); an error when it holds neither."""
    if "pattern" in dataset.data_vars:
        return "pattern"
    if "q" in dataset.data_vars and "k" in dataset.data_vars:
        ScoreTerms.of_layer(dataset.attrs.get("model", {}), 0)
        return "q,k"
    raise AnalysisError(
        f"store {store_url(dataset)} holds neither the attention pattern nor both q and k, so "
        "attention cannot be known: extract with sites pattern or q,k, or analyse without "
        "attention weighting"
    )


def layer_attention(dataset: xr.Dataset, layer: int) -> da.Array:
    """Lazy pattern (sample, head, qpos, kpos) of one layer: stored, or recomputed per block of samples."""
    if attention_source(dataset) == "pattern":
        return dataset["pattern"].sel(layer=layer).data
    terms = ScoreTerms.of_layer(dataset.attrs["model"], layer)
    q = dataset["q"].sel(layer=layer).data
    k = align(dataset["k"].sel(layer=layer).data, q)
    valid = align(dataset["valid"].data, q)

    def block(q_block, k_block, valid_block):
        return attention_from_qk(single_block(q_block), single_block(k_block), valid_block, terms)

    return da.blockwise(
        block, "shqk", q, "sqhd", k, "skgd", valid, "sk", concatenate=False, dtype="float32",
        meta=np.empty((0, 0, 0, 0), dtype="float32"),
    )


def store_attention(dataset: xr.Dataset, layers=None) -> xr.DataArray:
    """Lazy attention (sample, layer, head, qpos, kpos) of the chosen layers, stored or recomputed."""
    layers = check_layers(dataset, layers)
    source = attention_source(dataset)
    if source == "pattern":
        return require_site(dataset, "pattern", "attention").sel(layer=layers)
    pattern = da.stack([layer_attention(dataset, layer) for layer in layers], axis=1)
    return xr.DataArray(
        pattern,
        dims=("sample", "layer", "head", "qpos", "kpos"),
        coords={"sample": dataset["sample"], "layer": layers, "head": dataset["head"]},
        attrs={"source": "recomputed from q, k"},
    )
