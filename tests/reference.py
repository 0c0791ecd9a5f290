"""Float64 references for float32 results: compare each float32 computation against these, never two
float32 kernels against each other (different BLAS libraries round differently)."""
from __future__ import annotations

import numpy as np

ATTENTION_ATOL = 1e-5
"""The suite's tolerance on attention probabilities for logits up to LOGIT_SCALE in magnitude."""
LOGIT_SCALE = 32.0


def attention_float64(q, k, valid, *, attn_scale: float, causal: bool, sliding_window: int | None = None,
                      softcap: float | None = None, alibi_slopes=None, relative_bias=None,
                      sink_logits=None) -> tuple[np.ndarray, float]:
    """The attention pattern (..., head, qpos, kpos) in float64 from q (..., pos, head, d_head) and
    k (..., pos, kv_head, d_head), and the largest |logit| among the allowed scores. The optional
    terms follow transformers: softcap * tanh(score / softcap); key j allowed for query i when
    |i - j| < sliding_window; ALiBi adds slope_h * (number of valid tokens before j); relative_bias
    (head, 2D + 1), T5's, adds row h's entry D + (j - i), its end entries for farther keys; sink_logits
    (head,), GPT-OSS's, add exp(sink_h) to the softmax's denominator."""
    q = np.swapaxes(np.asarray(q, np.float64), -2, -3)
    k = np.swapaxes(np.asarray(k, np.float64), -2, -3)
    k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    scores = q @ np.swapaxes(k, -1, -2) * attn_scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    valid = np.asarray(valid, bool)
    if alibi_slopes is not None:
        key_position = np.cumsum(valid, axis=-1) - 1
        scores = scores + np.asarray(alibi_slopes, np.float64)[:, None, None] * key_position[..., None, None, :]
    if relative_bias is not None:
        table = np.asarray(relative_bias, np.float64)
        reach = table.shape[1] // 2
        n_pos = scores.shape[-1]
        for i in range(n_pos):
            for j in range(n_pos):
                scores[..., i, j] += table[:, reach + min(max(j - i, -reach), reach)]
    allowed = valid[..., None, None, :]
    i, j = np.indices(scores.shape[-2:])
    if causal:
        allowed = allowed & (j <= i)
    if sliding_window is not None:
        allowed = allowed & (np.abs(i - j) < sliding_window)
    largest = float(np.abs(np.where(allowed, scores, 0.0)).max())
    scores = np.where(allowed, scores, -np.inf)
    peak = scores.max(-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.exp(scores - peak)
    total = weights.sum(-1, keepdims=True)
    if sink_logits is not None:
        total = total + np.where(total > 0, np.exp(np.asarray(sink_logits, np.float64)[:, None, None] - peak), 0.0)
    return np.divide(weights, total, out=np.zeros_like(weights), where=total > 0), largest


def attention_atol(largest_logit: float) -> float:
    """Tolerance for a float32 pattern against the float64 one: float32 logits carry an error that
    grows with their magnitude, so the tolerance does too beyond LOGIT_SCALE."""
    return ATTENTION_ATOL * max(1.0, largest_logit / LOGIT_SCALE)


def assert_attention_close(found, q, k, valid, *, where=None, **terms) -> None:
    """A float32 pattern equals the float64 attention of q, k with the score `terms` (attn_scale,
    causal, ...: see attention_float64) within attention_atol (on `where`)."""
    expected, largest = attention_float64(q, k, valid, **terms)
    found = np.asarray(found, np.float64)
    if where is not None:
        found, expected = np.where(where, found, 0.0), np.where(where, expected, 0.0)
    np.testing.assert_allclose(found, expected, rtol=0, atol=attention_atol(largest))
