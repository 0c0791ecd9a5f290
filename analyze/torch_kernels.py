"""The attention kernels of the replay and the norms in torch, for a GPU (``device``, see device.py).

The same definitions as the numpy kernels (``attention.BlockAttention``, ``replay_blocks.HeadBlock``), in the
same layout (kpos, sample, head, qpos) and float32: ``TorchAttention`` scores and normalises a block,
``TorchHeadBlock`` is the replay's block with the dense work on the device and what the rest of the
replay reads (instance masks, winners, sparse rows, per-instance changes) handed back to the CPU as
numpy. Imported only when a device other than "cpu" is chosen.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .attention import ScoreFrame, ScoreTerms
from .device import torch_device
from .replay_blocks import count_instances, framed_messages, key_major, nonfinite_rows


def _tensor(array: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(device, non_blocking=True)


def _host(tensor: torch.Tensor, dtype=np.float64) -> np.ndarray:
    return tensor.to("cpu", torch.float64 if dtype == np.float64 else torch.float32).numpy()


class TorchAttention:
    """``BlockAttention`` on a torch device (`device`, a resolved name: see device.py): scaled dot
    products, offset, the clean softmax (``attention``, ``total``), key-major; ``valid``, ``n_allowed``
    and what ``received`` returns are numpy, on the CPU."""

    def __init__(self, q: np.ndarray, k: np.ndarray, valid: np.ndarray, terms: ScoreTerms, device: str):
        self.terms, self.device = terms, torch_device(device)
        self.valid = np.asarray(valid, bool)
        frame = ScoreFrame.of(self.valid, terms)
        self.n_allowed = frame.n_allowed
        self.no_keys = None if frame.no_keys is None else torch.from_numpy(frame.no_keys).to(self.device)
        self.offset = _tensor(frame.offset, self.device)
        sink = terms.sink_column()
        self.sink = None if sink is None else _tensor(sink, self.device)
        n_samples, n_pos, n_heads, d_head = q.shape
        self.n_kv_heads = k.shape[2]
        group = n_heads // self.n_kv_heads
        queries = _tensor(q, self.device).reshape(n_samples, n_pos, self.n_kv_heads, group, d_head).permute(0, 2, 3, 4, 1)
        keys = _tensor(k, self.device).permute(0, 2, 1, 3)[:, :, None]  # (sample, kv_head, 1, kpos, d_head)
        dots = torch.matmul(keys, queries)  # (sample, kv_head, group, kpos, qpos)
        dots = dots.reshape(n_samples, n_heads, k.shape[1], n_pos).permute(2, 0, 1, 3).contiguous()
        dots.mul_(np.float32(terms.scale))
        self.scaled_dots = dots.masked_fill_(torch.from_numpy(frame.refused).to(self.device), 0.0)
        self.attention, _, self.total = self.softmax(self.scores())

    def scores(self, factor: torch.Tensor | None = None) -> torch.Tensor:
        """As ``BlockAttention.scores``: `factor` (the norm factors' product) is scratch space."""
        scaled = self.scaled_dots.clone() if factor is None else factor.mul_(self.scaled_dots)
        if self.terms.softcap is not None:
            softcap = float(np.float32(self.terms.softcap))
            scaled.div_(softcap).tanh_().mul_(softcap)
        return scaled.add_(self.offset)

    def softmax(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``BlockAttention.softmax``: attention over keys in place, the maxima and the denominators."""
        peak = scores.amax(dim=0)
        scores.sub_(peak).exp_()
        total = scores.sum(dim=0)
        if self.sink is not None:
            total.add_((self.sink - peak).exp_())
        if self.no_keys is not None:
            total.masked_fill_(self.no_keys, float("inf"))
        return scores.div_(total), peak, total

    def received(self, mask: np.ndarray) -> np.ndarray:
        """As ``BlockAttention.received``: (sample, head, kpos) attention each key in `mask` receives from
        the queries in it, float32."""
        weights = _tensor(mask, self.device)  # (sample, qpos)
        return _host(torch.einsum("kshq,sq->shk", self.attention, weights) * weights[:, None, :], np.float32)


class TorchHeadBlock:
    """``replay.HeadBlock`` of a ``TorchAttention``, its dense work on the device; see that class for
    the definitions. Its attributes and the values its methods return are numpy, on the CPU."""

    def __init__(self, attention: TorchAttention, sparse_threshold: float, v=None, frame=None, *, min_keys: int):
        self.threshold, self.terms, self.block_attention = sparse_threshold, attention.terms, attention
        self.n_pos, _, self.n_heads, _ = attention.attention.shape
        self.n_kv_heads = attention.n_kv_heads
        self.attention = attention.attention
        self.max_attention = _host(1.0 / attention.total, np.float32)
        count_instances(self, attention.valid, attention.n_allowed, min_keys)
        self.messages = self.output_sq = None
        if v is not None and frame is not None:
            self.messages = _tensor(framed_messages(np.asarray(v), frame), attention.device)
            self.output_sq = self._output_sq(self.attention)

    @functools.cached_property
    def winner(self) -> np.ndarray:
        return self.attention.argmax(dim=0).cpu().numpy()

    def nonfinite(self) -> int:
        """As ``HeadBlock.nonfinite``."""
        return nonfinite_rows(self.max_attention, self.output_sq)

    def _output_sq(self, weights: torch.Tensor) -> np.ndarray:
        outputs = torch.matmul(weights.permute(1, 2, 3, 0), self.messages)  # (sample, head, qpos, d_head)
        return _host(outputs.square().sum(dim=-1, dtype=torch.float64))

    def entropy(self) -> np.ndarray:
        a = self.attention.double()
        return _host(-(a * torch.log(torch.where(a > 0, a, torch.ones_like(a)))).sum(dim=0))

    def smooth_changes(self, unit_q: np.ndarray, unit_k: np.ndarray, unit_m: np.ndarray,
                       levels) -> dict[str, np.ndarray]:
        """As ``HeadBlock.smooth_changes``: (level, sample, head, qpos) changes, level by level."""
        changes = [self.attention_change(level * unit_q, level * unit_k, level * unit_m) for level in levels]
        return {name: np.stack([change[name] for change in changes]) for name in changes[0]}

    def attention_change(self, kq: np.ndarray, kk: np.ndarray, km: np.ndarray) -> dict[str, np.ndarray]:
        """As ``HeadBlock.attention_change``: total variation and output change squared (sample, head, qpos)."""
        device = self.block_attention.device
        fq = _tensor((1.0 + kq).transpose(0, 2, 1), device)[None]
        fk = _tensor(key_major(1.0 + kk, self.n_heads), device)
        attention, _, _ = self.block_attention.softmax(self.block_attention.scores(fq * fk))
        change = attention - self.attention
        effects = {"tv": 0.5 * _host(change.abs().sum(dim=0, dtype=torch.float64))}
        if self.messages is not None:
            attention.mul_(_tensor(key_major(km, self.n_heads), device))
            effects["output_change_sq"] = self._output_sq(change.add_(attention))
        return effects

    def sparse_rows(self) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, np.ndarray]:
        """As ``HeadBlock.sparse_rows``."""
        rows = np.nonzero(self.sparse)
        sample, head, query = (torch.from_numpy(index).to(self.block_attention.device) for index in rows)
        attention = self.block_attention
        offset_head = head if attention.offset.shape[2] > 1 else torch.zeros_like(head)
        return (rows, _host(attention.scaled_dots[:, sample, head, query]),
                _host(attention.offset[:, sample, offset_head, query]),
                self.attention[:, sample, head, query].argmax(dim=0).cpu().numpy())
