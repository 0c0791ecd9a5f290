"""The attention function "orthosphere", registered with transformers' AttentionInterface.

Families on the ``interface`` route call it with q (batch, head, pos, d_head), k and v (batch,
kv_head, pos, d_head) after projection, rotary embedding and any QK-norm, the model's mask (which
carries causality, padding and sliding windows), the scale, for Gemma 2/3 the soft-cap, for T5 the
relative position bias and, for GPT-OSS, the sink logits (``s_aux``). In a forward pass traced by an
adapter (``trace.py``) it edits and records q, k, v of the layer and checks that the scale, window,
soft-cap, position bias and sinks it is called with are the ones the adapter stored in the model
description; then it attends with SDPA, or explicitly (transformers' eager attention) when the
pattern is recorded or the score is soft-capped or has sinks, which SDPA cannot do.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .trace import _ACTIVE

ATTENTION_IMPLEMENTATION = "orthosphere"
QKV_SITES = ("q", "k", "v")


def routed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention function "orthosphere" (see the module docstring)."""
    softcap, sinks = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)
    trace = _ACTIVE.get()
    layer = trace.owner.layer_of.get(module) if trace is not None else None
    if layer is None:
        return attend(module, query, key, value, attention_mask, scaling, dropout, softcap, sinks, **kwargs)
    trace.owner.check_score_call(layer, scaling, kwargs.get("sliding_window"), softcap, kwargs.get("position_bias"),
                                 sinks)
    if trace.edit is not None:
        q, k, v = trace.edit(layer, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        query, key, value = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    recording = trace.recording
    if recording is not None:
        for site, tensor in zip(QKV_SITES, (query, key, value)):
            recording.record(site, layer, tensor.transpose(1, 2))
    if recording is not None and recording.wants("pattern", layer):
        output, pattern = explicit_attention(module, query, key, value, attention_mask, scaling, dropout, softcap,
                                             kwargs.get("position_bias"), sinks)
        recording.record("pattern", layer, pattern)
        return output, pattern
    return attend(module, query, key, value, attention_mask, scaling, dropout, softcap, sinks, **kwargs)


def attend(module, query, key, value, attention_mask, scaling, dropout, softcap, sinks=None, **kwargs):
    """SDPA, or the explicit eager attention when the score is soft-capped or has sink logits."""
    if softcap is not None or sinks is not None:
        return explicit_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, sinks=sinks)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def explicit_attention(module, query, key, value, attention_mask, scaling, dropout, softcap=None, position_bias=None,
                       sinks=None):
    """transformers' eager attention for every family: grouped-query heads, soft-capping, a position
    bias added to the score (T5), a boolean (True = attend), additive or absent mask (absent:
    causal if the module is), and per-head sink logits that take their share of the softmax (GPT-OSS)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is None and getattr(module, "is_causal", True) and query.shape[2] > 1:
        attention_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        scores = torch.cat([scores, column], dim=-1)
    pattern = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        pattern = pattern[..., :-1]
    pattern = nn.functional.dropout(pattern, p=dropout, training=module.training)
    output = torch.matmul(pattern, value).transpose(1, 2).contiguous()
    return output, pattern


def same_term(described, called) -> bool:
    """Whether a score term the model was called with is the one described (None = absent)."""
    if described is None or called is None:
        return described is None and called is None
    return math.isclose(float(described), float(called), rel_tol=1e-6)


def register_attention() -> None:
    """Register the "orthosphere" attention function and its (SDPA-style) mask with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, routed_attention)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
