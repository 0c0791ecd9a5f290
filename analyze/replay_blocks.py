"""The replay's kernels: one block of samples of one layer, its clean attention (``HeadBlock``) and
its perturbations under the study's settings (``ReplaySettings``), counted per (level, head)
(``kernels.replay_block``); the definitions are in ``replay.py``'s docstring."""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np
import scipy.sparse

from orthosphere.params import Interval, Items, Rule, parameter

from .attention import BlockAttention, ScoreTerms, ScoreWindow, per_head
from .critical import clean_differences, collapsed_at, linear_critical, near_keys, noise_slopes, quadratic_critical
from .device import resolve_device
from .inputs import as_float32
from .noise import unit_noise
from .options import DEVICE, AnalysisConfig, choice, integer

TARGETS = ("q", "k", "m")


DISTRIBUTIONS = ("uniform", "gaussian")
NOISE_BOUNDS = {"uniform": math.sqrt(3.0), "gaussian": None}
"""The largest |u| of each distribution's unit noise (None: unbounded)."""


DEFAULT_LEVELS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3)


DEFINITIONS = ("collapse", "strict")


DEFAULT_SMOOTH_DRAWS = 2
"""Draws of the smooth summaries (total variation, output change) by default: means over every
instance, whose Monte Carlo error (reported) is small after a few draws."""


SMOOTH_DRAWS = Rule(lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool) and (value == 0 or value >= 2),
                    "0 (no smooth summaries: the perturbed softmax of every instance, most of the replay's time, is "
                    "skipped) or an integer >= 2, the fewest that state a Monte Carlo error of the total variation "
                    "and output change")


CURVE_STEPS_PER_OCTAVE = 64
"""Points of the collapse-rate curve per factor 2 of the level (1.1 % apart)."""


STRICT_ROWS = 4096
"""Collapsed (row, level) pairs whose softmax the strict definition evaluates at once."""


KEY_RANGE = 32
"""Sparse rows are grouped by where their allowed keys begin and end, in steps of this many keys."""


QUERY_WINDOW = 32
"""Queries per window of the smooth summaries' passes (``HeadBlock.smooth_changes``): each window
spans only the keys its queries may see, so a causal model's passes skip most of the masked half
of (key, query) (62.5 % of the square at 128 positions). Measured at 128 positions, 9 heads: 16
and 32 are fastest, 64 slower, and the whole square 3-6x slower (its attention-weighted messages
product falls off BLAS's fast path)."""


SWITCHABLE_KEYS = 2
"""A query with fewer allowed keys attends fully to one and can never switch."""


DEFAULT_MIN_KEYS = 4
"""The fewest allowed keys of a query that counts as an instance, by default (``min_keys``)."""


PREDICTIONS = ("theory", "exact")
"""The predicted collapses counted beside the measured ones: Theorem 7's first-order condition and
the exact condition (see the module docstring)."""


PREDICTION_COUNTS = ("predicted", "missed", "false_alarm")

SPARSE_THRESHOLD = Interval(float, 0, 1, closed="right", hint="a maximum attention (the paper uses 0.95)")
MIN_KEYS = integer(SWITCHABLE_KEYS, (
    f"the fewest allowed keys a query needs to count as an instance: {DEFAULT_MIN_KEYS} (the default) leaves "
    f"out the trivially sparse first positions, {SWITCHABLE_KEYS} counts every query that can switch"))
"""The constraints of the sparse threshold and of the fewest keys, shared by every analysis that counts sparse queries."""


@dataclass(frozen=True)
class ReplaySettings(AnalysisConfig):
    """What to perturb and how (the options that reach each block of the replay)."""

    levels: tuple[float, ...] = parameter(
        DEFAULT_LEVELS, Items(Interval(float, 0, 1, closed="neither"), single=True, increasing=True,
                              hint="RMS noise levels (0.01 is 1 % noise), e.g. replay.levels=[0.01,0.1]"),
        help="the noise levels swept (RMS, relative)")
    n_draws: int = parameter(32, integer(1, "noise draws per level"), help="noise draws per level")
    seed: int = parameter(0, integer(0), help="seed of the noise")
    distribution: str = parameter("uniform", choice(*DISTRIBUTIONS), help="the noise's distribution")
    targets: tuple[str, ...] = parameter(
        TARGETS, Items(choice(*TARGETS), single=True, hint="q: queries, k: keys, m: messages W_O v"),
        help="what the noise perturbs")
    sparse_threshold: float = parameter(0.95, SPARSE_THRESHOLD,
                                        help="a query is a sparse instance when its largest attention reaches this")
    min_keys: int = parameter(DEFAULT_MIN_KEYS, MIN_KEYS, help="the fewest allowed keys of an instance")
    smooth_draws: int | None = parameter(
        None, SMOOTH_DRAWS, None,
        help=f"draws of the smooth summaries (default {DEFAULT_SMOOTH_DRAWS}, at most n_draws; 0: none)")
    device: str = parameter("cpu", DEVICE, help="where the dense attention work runs (device.py), resolved here")

    def check(self) -> None:
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in self.targets))
        if self.smooth_draws is None:
            object.__setattr__(self, "smooth_draws", min(DEFAULT_SMOOTH_DRAWS, self.n_draws))
        elif self.smooth_draws > self.n_draws:
            raise self.error("smooth_draws", self.smooth_draws, f"0 or an integer from 2 to n_draws = {self.n_draws}")
        object.__setattr__(self, "device", resolve_device(self.device))

    @property
    def curve_levels(self) -> np.ndarray:
        """The levels of the collapse-rate curve: the swept levels and CURVE_STEPS_PER_OCTAVE log-spaced
        levels an octave in, from a quarter of the lowest level to the highest."""
        low, high = self.levels[0] / 4, self.levels[-1]
        steps = int(math.ceil(CURVE_STEPS_PER_OCTAVE * math.log2(high / low))) + 1
        return np.unique(np.concatenate([np.geomspace(low, high, steps), self.levels]))

    def kappa(self, target: str, layer: int, samples, draw: int, n_pos: int, n_heads: int) -> np.ndarray:
        """Unit-RMS noise for this target (zeros when the target is not perturbed)."""
        if target not in self.targets:
            return np.zeros((len(samples), n_pos, n_heads))
        return unit_noise(self.seed, target, layer, samples, draw, n_pos, n_heads, self.distribution)


class HeadBlock:
    """Clean attention of one layer for a block of samples, ready to be perturbed.

    The score and the attention, clean and perturbed, come from the layer's ``BlockAttention``
    (the one implementation of the model's attention), laid out (kpos, sample, head, qpos) in
    float32: the noise enters it as the factors of the query and key norms, and the new arg-max
    and its attention come from the row maximum and the softmax denominator. Messages are kept in
    each head's own d_head-dimensional frame (``message_frame``), where their norms and dot
    products are those of W_O v; their noise multiplies the perturbed attention. ``instance`` and
    ``sparse`` mask the (sample, head, qpos) instances with at least ``min_keys`` allowed keys,
    ``trivial`` and ``sparse_trivial`` the trivial ones (see the module docstring). Built from q, k
    and valid, or (``of_attention``) from a block's clean attention computed once for every analysis.
    """

    def __init__(self, q, k, valid, terms: ScoreTerms, sparse_threshold: float, v=None, frame=None, *, min_keys: int):
        self._start(BlockAttention.of(q, k, valid, terms), sparse_threshold, v, frame, min_keys)

    @classmethod
    def of_attention(cls, attention: BlockAttention, sparse_threshold: float, v=None, frame=None, *,
                     min_keys: int) -> HeadBlock:
        block = cls.__new__(cls)
        block._start(attention, sparse_threshold, v, frame, min_keys)
        return block

    def _start(self, attention: BlockAttention, sparse_threshold: float, v, frame, min_keys: int) -> None:
        self.threshold, self.terms, self.block_attention = sparse_threshold, attention.terms, attention
        self.n_pos, _, self.n_heads, _ = attention.attention.shape
        self.n_kv_heads = attention.n_kv_heads
        self.attention = attention.attention
        self.max_attention = 1.0 / attention.total
        count_instances(self, attention.valid, attention.n_allowed, min_keys)
        self.messages = self.output_sq = None
        if v is not None and frame is not None:
            self.messages = framed_messages(np.asarray(v), frame)
            self.output_sq = self._output_sq()

    @property
    def pattern(self) -> np.ndarray:
        """The clean attention as (sample, head, qpos, kpos)."""
        return self.block_attention.pattern

    def nonfinite(self) -> int:
        """Instances whose clean attention or output is NaN or Inf: what a NaN or Inf in q, k (at a key a
        query may see) or v, or scores beyond float32's range, lead to (see ``inputs.FiniteCheck``)."""
        return nonfinite_rows(self.max_attention, self.output_sq)

    @functools.cached_property
    def winner(self) -> np.ndarray:
        """(sample, head, qpos) the clean arg-max key."""
        return self.attention.argmax(axis=0)

    @functools.cached_property
    def windows(self) -> list[ScoreWindow]:
        """The block's ``QUERY_WINDOW``-query windows that see a key."""
        windows = (self.block_attention.window(slice(start, start + QUERY_WINDOW))
                   for start in range(0, self.n_pos, QUERY_WINDOW))
        return [window for window in windows if window is not None]

    def _output_sq(self) -> np.ndarray:
        """|sum_j a_j m_j|^2 per (sample, head, qpos) of the clean attention a, window by window."""
        output_sq = np.zeros(self.max_attention.shape)
        for window in self.windows:
            outputs = window.attention.transpose(1, 2, 3, 0) @ self.messages[:, :, window.keys]  # (sample, head, query, d_head)
            output_sq[:, :, window.queries] = np.einsum("shie,shie->shi", outputs, outputs)
        return output_sq

    def entropy(self) -> np.ndarray:
        """(sample, head, qpos) entropy of the clean attention (nats): float32 terms, summed in float64."""
        terms = np.zeros_like(self.attention)
        np.log(self.attention, out=terms, where=self.attention > 0)
        terms *= self.attention
        return -terms.sum(axis=0, dtype=np.float64)

    def perturb(self, kq: np.ndarray, kk: np.ndarray) -> dict[str, np.ndarray]:
        """The collapse conditions of one draw, evaluated directly: kappa arrays (sample, pos, head or
        kv_head) of the queries and keys.

        Returns collapse, strict, theory_predicted (Theorem 7's first order) and exact_predicted
        (the exact condition: the key noise alone) of the sparse instances as bools, (sample, head,
        qpos): what the online check compares with the model, and the critical levels' reference.
        """
        fq = np.ascontiguousarray((1.0 + kq).transpose(0, 2, 1), dtype=np.float32)[None]  # (1, sample, head, qpos)
        fk = key_major(1.0 + kk, self.n_heads)  # (kpos, sample, head, 1)
        scores = self.block_attention.scores((fq - 1) + fk)  # 1 + kq + kk_j, exactly fk (fq) when kq (kk) is 0
        theory_predicted = self._winner_beaten(scores)
        np.copyto(scores, fk)  # the exact condition: query noise cancels
        exact_predicted = self._winner_beaten(self.block_attention.scores(scores))
        logits = self.block_attention.scores(fq * fk)
        at_winner = np.take_along_axis(logits, self.winner[None], axis=0)[0]
        _, peak, total = self.block_attention.softmax(logits)
        collapse = self.sparse & (peak > at_winner)
        return {
            "collapse": collapse,
            "strict": collapse & (1.0 / total >= self.threshold),
            "theory_predicted": self.sparse & theory_predicted,
            "exact_predicted": self.sparse & exact_predicted,
        }

    def attention_change(self, kq: np.ndarray, kk: np.ndarray, km: np.ndarray) -> dict[str, np.ndarray]:
        """Total variation and output change squared (sample, head, qpos) of one draw (kappa arrays as
        in ``perturb``): the perturbed softmax without the collapse conditions."""
        return {name: change[0] for name, change in self.smooth_changes(kq, kk, km, (1.0,)).items()}

    def smooth_changes(self, unit_q: np.ndarray, unit_k: np.ndarray, unit_m: np.ndarray,
                       levels) -> dict[str, np.ndarray]:
        """Total variation ``tv`` and output change squared ``output_change_sq`` (level, sample, head,
        qpos), float64, of one draw's unit noise (arrays as in ``perturb``) at each level: the perturbed
        softmax window by window (``windows``), every level of a window while its arrays are in cache.

        With a = the clean attention, a' the perturbed one and km = level * unit_m, the output changes
        by sum_j (a'_j (1 + km_j) - a_j) m_j = sum_j (a'_j - a_j)(1 + km_j) m_j + level sum_j a_j unit_m_j m_j:
        the second term once per draw, the first from the difference a' - a the total variation reads.
        Message noise, shared by a group's heads as key noise is, multiplies (key, sample, kv_head,
        group x query) views, as ``ScoreWindow.perturbed_scores`` does.
        """
        shape = (len(levels), *self.max_attention.shape)
        changes = {"tv": np.zeros(shape)} | ({"output_change_sq": np.zeros(shape)} if self.messages is not None else {})
        query_units = np.ascontiguousarray(unit_q.transpose(0, 2, 1))[None]  # (1, sample, head, qpos)
        key_units, message_units = (unit.transpose(1, 0, 2)[..., None] for unit in (unit_k, unit_m))  # (kpos, sample, kv_head, 1)

        def grouped(array):  # (key, sample, head, query) -> (key, sample, kv_head, group x query)
            return array.reshape(*array.shape[:2], self.n_kv_heads, -1)

        for window in self.windows:
            keys, queries = window.keys, window.queries
            messages = None if self.messages is None else self.messages[:, :, keys]
            if messages is not None:
                noise_weighted = grouped(window.attention) * message_units[keys].astype(np.float32)
                clean_noise = noise_weighted.reshape(window.attention.shape).transpose(1, 2, 3, 0) @ messages
            scaled, magnitude = np.empty_like(window.scaled_dots), np.empty_like(window.scaled_dots)
            for index, level in enumerate(levels):
                scores = window.perturbed_scores((1.0 + level * key_units[keys]).astype(np.float32),
                                                 (1.0 + level * query_units[..., queries]).astype(np.float32), scaled)
                change, _, _ = window.softmax(scores)
                change -= window.attention
                np.abs(change, out=magnitude)
                changes["tv"][index, :, :, queries] = 0.5 * magnitude.sum(axis=0)
                if messages is not None:
                    np.multiply(grouped(change), (1.0 + level * message_units[keys]).astype(np.float32), out=grouped(change))
                    outputs = change.transpose(1, 2, 3, 0) @ messages  # (sample, head, query, d_head)
                    outputs += np.float32(level) * clean_noise
                    changes["output_change_sq"][index, :, :, queries] = np.einsum("shie,shie->shi", outputs, outputs)
        return changes

    def sparse_rows(self) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, np.ndarray]:
        """The sparse instances as rows: their (sample, head, qpos) indices, (key, row) float64 arrays
        of their scaled clean dot products and of what their score adds after the soft-cap, and their
        clean arg-max keys."""
        sample, head, query = rows = np.nonzero(self.sparse)
        attention = self.block_attention
        offset_head = head if attention.offset.shape[2] > 1 else np.zeros_like(head)
        return (rows, attention.scaled_dots[:, sample, head, query].astype(np.float64),
                attention.offset[:, sample, offset_head, query].astype(np.float64),
                self.attention[:, sample, head, query].argmax(axis=0))

    def _winner_beaten(self, scores: np.ndarray) -> np.ndarray:
        """(sample, head, qpos): some allowed key scores above the clean arg-max in `scores`."""
        return scores.max(axis=0) > np.take_along_axis(scores, self.winner[None], axis=0)[0]


def nonfinite_rows(max_attention, output_sq) -> int:
    """(sample, head, qpos) rows whose largest attention or output norm is NaN or Inf."""
    bad = ~np.isfinite(max_attention)
    return int(np.count_nonzero(bad if output_sq is None else bad | ~np.isfinite(output_sq)))


def count_instances(block, valid: np.ndarray, n_allowed: np.ndarray, min_keys: int) -> None:
    """Set a block's (sample, head, qpos) masks ``instance``, ``trivial``, ``sparse`` and
    ``sparse_trivial`` from its valid queries, their allowed keys and its ``max_attention``."""
    shape = block.max_attention.shape
    counted = instance_queries(valid, n_allowed, min_keys)
    block.instance = np.broadcast_to(counted[:, None, :], shape)
    block.trivial = np.broadcast_to((instance_queries(valid, n_allowed, SWITCHABLE_KEYS) & ~counted)[:, None, :], shape)
    block.sparse = block.instance & (block.max_attention >= block.threshold)
    block.sparse_trivial = block.trivial & (block.max_attention >= block.threshold)


def instance_queries(valid: np.ndarray, n_allowed: np.ndarray, min_keys: int) -> np.ndarray:
    """(sample, qpos) queries that count as instances: valid, with at least `min_keys` allowed keys."""
    return np.asarray(valid, bool) & (n_allowed >= min_keys)


def key_major(kappa: np.ndarray, n_heads: int) -> np.ndarray:
    """(sample, kpos, kv_head) -> float32 (kpos, sample, head, 1), heads sharing their group's value."""
    kappa = per_head(kappa, n_heads)
    return np.ascontiguousarray(kappa.transpose(1, 0, 2), dtype=np.float32)[..., None]


def message_frame(w_o: np.ndarray) -> np.ndarray:
    """Per head F = R^T from W_O[h]^T = Q R (head, d_head, d_head): F F^T = W_O[h] W_O[h]^T, so the
    message m = v W_O[h] has |m| = |v F| and m . m' = (v F) . (v' F), in d_head dimensions (a QR,
    6x cheaper than the SVD that gives another such F)."""
    return np.linalg.qr(np.asarray(w_o, dtype=np.float64).swapaxes(-1, -2), mode="r").swapaxes(-1, -2)


def framed_messages(v: np.ndarray, frame: np.ndarray) -> np.ndarray:
    """Messages v F per head (sample, head, kpos, d_head), float32 as the attention they are weighted
    by; heads share kv_heads in groups."""
    v = per_head(np.asarray(as_float32(np.asarray(v)), np.float32), frame.shape[0])
    return v.transpose(0, 2, 1, 3) @ frame.astype(np.float32)[None]


def collapse_indicators(block: HeadBlock, *, samples, layer: int, draw: int, level: float,
                        settings: ReplaySettings) -> dict[str, np.ndarray]:
    """Per-instance sparse mask, clean and new arg-max, collapse and strict collapse for one draw.

    Arrays (sample, head, qpos) for one layer's block of samples (global indices ``samples``);
    what the online check compares with the model's own attention under the same draw.
    """
    kq, kk = (level * settings.kappa(t, layer, samples, draw, block.n_pos, n)
              for t, n in (("q", block.n_heads), ("k", block.n_kv_heads)))
    effects = block.perturb(kq, kk)
    return {"instance": block.instance, "sparse": block.sparse, "winner": block.winner,
            "collapse": effects["collapse"], "strict": effects["strict"]}


def replay_sub_block(block, *, samples, layer: int, draws: range, settings: ReplaySettings,
                      n_bins: int) -> dict[str, np.ndarray]:
    """``replay_block``'s partial sums for samples whose arrays fit in cache: the collapses of every
    draw from critical levels (``SparseRows``), the smooth summaries from the softmax of the first
    ``smooth_draws`` draws."""
    n_samples, n_heads, n_pos = block.instance.shape
    n_levels, n_smooth = len(settings.levels), settings.smooth_draws
    instance, sparse = block.instance, block.sparse
    sets = np.stack([sparse, instance])  # INSTANCE_SETS order
    once = float(draws.start == 0)
    sums = {
        "nonfinite": once * block.nonfinite(),
        "n_instances": once * instance.sum(axis=(0, 2)),
        "n_sparse": once * sparse.sum(axis=(0, 2)),
        "n_instances_trivial": once * block.trivial.sum(axis=(0, 2)),
        "n_sparse_trivial": once * block.sparse_trivial.sum(axis=(0, 2)),
        "entropy": once * np.where(instance, block.entropy(), 0.0).sum(axis=(0, 2)),
        "max_attention_hist": once * _histogram(block.max_attention, instance, n_bins),
        "collapses": np.zeros((len(DEFINITIONS), n_levels, n_heads)),
        **{f"{rule}_{count}": np.zeros((n_levels, n_heads)) for rule in PREDICTIONS for count in PREDICTION_COUNTS},
        "sample_sparse": once * sparse.sum(axis=(1, 2)),
        "sample_collapses": np.zeros((n_samples, len(DEFINITIONS), n_levels)),
        "sample_curve": np.zeros((n_samples, len(settings.curve_levels))),
        "sample_predictions": np.zeros((n_samples, len(PREDICTIONS), len(PREDICTION_COUNTS), n_levels)),
    }
    smooth = () if not n_smooth else ("tv", "output_change_sq") if block.messages is not None else ("tv",)
    for name in smooth:  # per sample, over the task's smooth draws: the sum and the sum of squares
        sums[f"sample_smooth_{name}"] = np.zeros((n_samples, 2, len(INSTANCE_SETS), n_levels, n_heads))
    if "output_change_sq" in smooth:
        sums["output_sq"] = once * (sets * block.output_sq).sum(axis=(1, 3))
    rows = SparseRows(block, settings)
    for draw in draws:
        if draw >= n_smooth and not rows.any:
            continue
        unit = {t: settings.kappa(t, layer, samples, draw, n_pos, n)
                for t, n in (("q", n_heads), ("k", block.n_kv_heads))}
        rows.count_draw(sums, unit["q"], unit["k"])
        if draw >= n_smooth:
            continue
        unit["m"] = settings.kappa("m", layer, samples, draw, n_pos, block.n_kv_heads)
        changes = block.smooth_changes(unit["q"], unit["k"], unit["m"], settings.levels)
        for name in smooth:
            per_sample = (sets[:, None] * changes[name][None]).sum(axis=4).transpose(2, 0, 1, 3)  # (sample, set, level, head)
            sums[f"sample_smooth_{name}"] += np.stack([per_sample, per_sample**2], axis=1)
    return sums


@dataclass(frozen=True, eq=False)
class RowGroup:
    """Sparse rows whose allowed keys lie in one range: their (key, row) float64 arrays over it alone,
    what no draw changes of their critical levels, and the entries of the keys that may overtake
    their winner in the measured or exact collapse (``critical.near_keys``)."""

    rows: np.ndarray
    """Indices of the rows among the block's."""
    keys: slice
    dots: np.ndarray
    bias: np.ndarray
    winner: np.ndarray
    """The clean arg-max key of each row, counted from keys.start."""
    alpha: np.ndarray
    constant: np.ndarray
    near: tuple[np.ndarray, np.ndarray]
    """Flat (key, row) entries, sorted by row."""

    @classmethod
    def of(cls, rows: np.ndarray, keys: slice, dots: np.ndarray, bias: np.ndarray, winner: np.ndarray, s_max: float,
           bound: float | None) -> RowGroup:
        alpha, constant = clean_differences(dots, bias, winner)
        return cls(rows, keys, dots, bias, winner, alpha, constant, near_keys(dots, winner, alpha, constant, s_max, bound))


class SparseRows:
    """The sparse instances of a block as rows (key, row) in float64: the scaled clean dot
    products, what the score adds after the soft-cap, the winner; per draw their critical levels
    (``orthosphere.analyze.critical``) and from them the counts at every level. Rows are grouped
    by the range of keys they may see (``KEY_RANGE``-key steps): a causal model's rows then skip
    the keys after them, about half."""

    def __init__(self, block: HeadBlock, settings: ReplaySettings):
        (self.sample, self.head, self.query), dots, bias, winner = block.sparse_rows()
        self.n_heads, self.n_samples = block.n_heads, block.instance.shape[0]
        self.settings, self.softcap = settings, block.terms.softcap
        self.sinks = None if block.terms.sink_logits is None else np.asarray(block.terms.sink_logits, np.float64)
        self.levels = np.asarray(settings.levels)
        self.curve_levels = settings.curve_levels
        n_rows = len(winner)
        self.of_sample = scipy.sparse.csr_array((np.ones(n_rows), (self.sample, np.arange(n_rows))),
                                                shape=(self.n_samples, n_rows))
        """(sample, row) ones: a (row, ...) indicator's per-sample counts are its product with it."""
        self.of_head = scipy.sparse.csr_array((np.ones(n_rows), (self.head, np.arange(n_rows))),
                                              shape=(self.n_heads, n_rows))
        bound = NOISE_BOUNDS[settings.distribution]
        self.groups = _row_groups(dots, bias, winner, float(self.levels[-1]), bound) if n_rows else []

    @property
    def any(self) -> bool:
        """Whether the block has a sparse instance (without one, no draw needs its noise)."""
        return bool(self.groups)

    def count_draw(self, sums: dict, unit_q: np.ndarray, unit_k: np.ndarray) -> None:
        """Add one draw's collapses, strict collapses, predictions and curve counts to ``sums``."""
        if not self.groups:
            return
        u_queries = unit_q[self.sample, self.query, self.head]
        u_keys = per_head(unit_k, self.n_heads).transpose(1, 0, 2)  # (key, sample, head)
        shape = (len(self.sample), len(self.levels))
        measured, strict = np.empty(shape, bool), np.empty(shape, bool)
        predicted = {rule: np.empty(shape, bool) for rule in PREDICTIONS}
        s_max = self.levels[-1]
        for group in self.groups:
            rows, n = group.rows, len(group.rows)
            u_query, u_key = u_queries[rows], u_keys[group.keys][:, self.sample[rows], self.head[rows]]  # (key, row)
            beta = noise_slopes(group.dots, u_key, group.winner)
            predicted["theory"][rows] = self.levels > linear_critical(group.constant, beta + u_query * group.alpha)[:, None]
            key, row = group.near
            slope, u_row, constant = beta[key, row], u_query[row], group.constant[key, row]
            a, b = u_row * slope, slope + u_row * group.alpha[key, row]
            predicted["exact"][rows] = self.levels > linear_critical(constant, slope, row, n)[:, None]
            critical, flagged = quadratic_critical(a, b, constant, s_max, row, n)
            collapsed = self.levels > critical[:, None]  # (row, level)
            if flagged.any():
                at = flagged[row]
                collapsed[flagged] = collapsed_at(a[at], b[at], constant[at], self.levels, row[at], n)[flagged]
                sums["sample_curve"] += self.of_sample[:, rows[flagged]] @ collapsed_at(
                    a[at], b[at], constant[at], self.curve_levels, row[at], n)[flagged]
            sums["sample_curve"] += self._curve_counts(critical[~flagged], self.sample[rows[~flagged]])
            measured[rows], strict[rows] = collapsed, self._strict(group, collapsed, u_query, u_key)
        for d, indicator in enumerate((measured, strict)):
            sums["collapses"][d] += self._per_head(indicator)
            sums["sample_collapses"][:, d] += self.of_sample @ indicator
        for r, rule in enumerate(PREDICTIONS):
            guessed = predicted[rule]
            for c, (count, indicator) in enumerate(zip(PREDICTION_COUNTS, (guessed, measured & ~guessed, guessed & ~measured))):
                sums[f"{rule}_{count}"] += self._per_head(indicator)
                sums["sample_predictions"][:, r, c] += self.of_sample @ indicator

    def _strict(self, group: RowGroup, measured: np.ndarray, u_query: np.ndarray, u_key: np.ndarray) -> np.ndarray:
        """(row, level) collapses of a group's rows whose new arg-max holds >= the sparse threshold:
        the perturbed softmax of the collapsed rows only."""
        strict = np.zeros_like(measured)
        row, level = np.nonzero(measured)
        for start in range(0, len(row), STRICT_ROWS):
            r, at = row[start:start + STRICT_ROWS], level[start:start + STRICT_ROWS]
            s = self.levels[at]
            scaled = group.dots[:, r] * ((1 + s * u_query[r]) * (1 + s * u_key[:, r]))
            if self.softcap is not None:
                scaled = self.softcap * np.tanh(scaled / self.softcap)
            logits = scaled + group.bias[:, r]
            peak = logits.max(axis=0)
            total = np.exp(logits - peak).sum(axis=0)
            if self.sinks is not None:
                total += np.exp(self.sinks[self.head[group.rows[r]]] - peak)
            peak_share = 1.0 / total
            strict[r, at] = peak_share >= self.settings.sparse_threshold
        return strict

    def _per_head(self, indicator: np.ndarray) -> np.ndarray:
        """(level, head) counts of a (row, level) indicator."""
        return (self.of_head @ indicator.astype(np.float64)).T

    def _curve_counts(self, critical: np.ndarray, sample: np.ndarray) -> np.ndarray:
        """(sample, curve level) counts of rows collapsed at each curve level, of rows whose collapse holds
        beyond their critical level: a row counts from the first curve level above its critical one on."""
        n_levels = len(self.curve_levels)
        first = np.searchsorted(self.curve_levels, critical, side="right")
        counts = np.bincount(sample * (n_levels + 1) + first, minlength=self.n_samples * (n_levels + 1))
        return np.cumsum(counts.reshape(self.n_samples, n_levels + 1), axis=1)[:, :n_levels]


def _row_groups(dots: np.ndarray, bias: np.ndarray, winner: np.ndarray, s_max: float,
                bound: float | None) -> list[RowGroup]:
    """Rows (key, row) grouped by the ``KEY_RANGE``-key steps where their allowed keys (finite bias)
    begin and end; each group over the keys any of its rows may see (`s_max` and `bound`: ``RowGroup.of``).
    Outside them a row's scores are -inf, clean and perturbed: no key there can win, and its softmax
    terms are zeros."""
    allowed = np.isfinite(bias)
    first = allowed.argmax(axis=0)
    last = len(allowed) - 1 - allowed[::-1].argmax(axis=0)
    steps = len(allowed) // KEY_RANGE + 1
    code = (first // KEY_RANGE) * steps + last // KEY_RANGE
    groups = []
    for value in np.unique(code):
        rows = np.flatnonzero(code == value)
        keys = slice(int(first[rows].min()), int(last[rows].max()) + 1)
        groups.append(RowGroup.of(rows, keys, dots[keys][:, rows], bias[keys][:, rows], winner[rows] - keys.start,
                                  s_max, bound))
    return groups


def _histogram(max_attention: np.ndarray, instance: np.ndarray, n_bins: int) -> np.ndarray:
    """(head, bin) counts of max attention over instances; bins split [0, 1] evenly."""
    n_heads = max_attention.shape[1]
    bins = np.clip(np.nan_to_num(max_attention * n_bins), 0, n_bins - 1).astype(np.int64)  # NaN: refused later
    heads = np.broadcast_to(np.arange(n_heads)[None, :, None], bins.shape)
    flat = (heads * n_bins + bins)[instance]
    return np.bincount(flat, minlength=n_heads * n_bins).reshape(n_heads, n_bins).astype(np.float64)



INSTANCE_SETS = ("sparse", "all")


def in_sample_order(parts: list[dict]) -> dict:
    """Partial sums of consecutive blocks of samples -> theirs together: every count summed,
    per-sample counts concatenated in sample order."""
    return {name: np.concatenate([p[name] for p in parts]) if name.startswith("sample_")
            else np.sum([p[name] for p in parts], axis=0)
            for name in parts[0]}
