"""The adapter of the project's arithmetic transformers (``base.Adapter``): every site is a
HookPoint of the model, and its norms sit where its placement puts them."""
from __future__ import annotations

from ..families import Norm
from ..interface import QKV_SITES
from ..norms import described_norms, norm_summary
from ..trace import active
from .base import Adapter, dtype_name, first_output

ARITHMETIC_NORMS = {
    "pre": (Norm("attn_input", "norm_attn"), Norm("mlp_input", "norm_ff"), Norm("final", "norm_final")),
    "post": (Norm("resid_mid", "norm_attn"), Norm("resid_post", "norm_ff")),
    "qkv": (Norm("q", "attn.head_norms.q", "head"), Norm("k", "attn.head_norms.k", "head"),
            Norm("v", "attn.head_norms.v", "head"), Norm("mlp_input", "norm_ff"), Norm("final", "norm_final")),
    "none": (Norm("mlp_input", "norm_ff"), Norm("final", "norm_final")),
}


class ArithmeticAdapter(Adapter):
    """The arithmetic transformers: every site is a HookPoint of the model."""

    family = "arithmetic"

    @property
    def blocks(self):
        return self.model.blocks

    def attention(self, layer):
        return self.model.blocks[layer].attn

    def norms(self):
        return ARITHMETIC_NORMS[self.model.config.norm_placement]

    def _norm_kind(self, module):
        return self.model.config.norm_type

    def model_heads(self):
        return self.model.config.n_heads, self.model.config.n_heads

    def describe(self) -> dict:
        description = dict(self.model.describe())
        norms = self.norms()
        description.update(
            score=self.score_terms(), dtype=dtype_name(self.model),
            **norm_summary(norms, placement=description["norm_placement"]),
            **described_norms(self.model, self.blocks[0], norms, "weight", kind=self.model.config.norm_type),
        )
        return description

    def score_terms(self):
        n = self.n_layers
        return {"scale": [float(self.model.config.attn_scale)] * n, "sliding_window": [None] * n,
                "softcap": [None] * n, "alibi_slopes": None}

    def head_weights(self, layer):
        return self.attention(layer).head_weights()

    def _logits(self, tokens, valid):
        """Logits; padding sits after the real tokens, so causal attention needs no mask."""
        return self.model(tokens)

    def _install_hooks(self):
        for layer, block in enumerate(self.blocks):
            attention = block.attn
            points = {"resid_pre": block.hook_resid_pre, "resid_mid": block.hook_resid_mid,
                      "resid_post": block.hook_resid_post, "attn_in": attention.hook_attn_in,
                      "pattern": attention.hook_pattern}
            for site, point in points.items():
                point.register_forward_hook(self._record_hook(site, layer, read=first_output))
            attention.hook_q.register_forward_hook(self._hold("q"))
            attention.hook_k.register_forward_hook(self._hold("k"))
            attention.hook_v.register_forward_hook(self._complete(layer))

    def _install_output_hooks(self):
        """z at the attention's hook_z; attn_out and mlp_out: the attention's and feed-forward's outputs."""
        for layer, block in enumerate(self.blocks):
            block.attn.hook_z.register_forward_hook(self._record_hook("z", layer, read=first_output))
            block.attn.register_forward_hook(self._record_hook("attn_out", layer, read=first_output))
            block.ff.register_forward_hook(self._record_hook("mlp_out", layer, read=first_output))

    def _hold(self, name):
        """q and k wait in the trace until v arrives."""
        def hook(module, args, output):
            trace = active(self)
            if trace is not None:
                trace.held[name] = output

        return hook

    def _complete(self, layer):
        """The edit rewrites the held q and k in place, before the score is computed from them,
        and replaces v; then q, k, v are recorded."""
        def hook(module, args, v):
            trace = active(self)
            if trace is None:
                return v
            q, k = trace.held.pop("q"), trace.held.pop("k")
            if trace.edit is not None:
                new_q, new_k, v = trace.edit(layer, q, k, v)
                for old, new in ((q, new_q), (k, new_k)):
                    if new is not old:
                        old.copy_(new)
            if trace.recording is not None:
                for site, value in zip(QKV_SITES, (q, k, v)):
                    trace.recording.record(site, layer, value)
            return v

        return hook
