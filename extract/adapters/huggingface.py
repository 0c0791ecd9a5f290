"""The adapter of the transformers families (``base.Adapter``), driven by each family's
declarative description in ``families.py``."""
from __future__ import annotations

import inspect
from dataclasses import replace

import torch
from torch import nn

from ..families import Family, UnsupportedModelError, check_supported, split_heads_rows, unsupported
from ..interface import ATTENTION_IMPLEMENTATION, QKV_SITES, register_attention
from ..norms import described_norms, norm_summary, norm_type
from ..trace import active
from .base import Adapter, dtype_name, first_input, first_output, pre_hook


class HuggingFaceAdapter(Adapter):
    """Any transformers family of ``families.py``, driven by its declarative description."""

    def __init__(self, model: nn.Module, family: Family):
        self.model = model
        check_supported(family, self.config)
        self.spec = family.resolved(self.config)
        self.lm_head = type(model).__name__ == family.lm_class
        if not self.lm_head and family.lm_class is not None:
            import transformers

            self.spec = self.spec.without_head(getattr(transformers, family.lm_class).base_model_prefix)
        if self.spec.mlp is None and hasattr(model.get_submodule(self.spec.blocks)[0], "mlp"):
            self.spec = replace(self.spec, mlp="mlp")
        self.family, self.causal, self.window_in_mask = family.model_type, family.causal, family.window_in_mask
        if family.route == "interface":
            register_attention()
            model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
            if model.config._attn_implementation != ATTENTION_IMPLEMENTATION:
                raise UnsupportedModelError(unsupported(f"{type(model).__name__} (it ignores transformers' attention interface)"))
        else:
            model.config._attn_implementation = "eager"  # its own attention, returning the pattern
        self.n_heads, self.d_head, self.n_kv_heads = self._head_layout()
        super().__init__(model)

    @property
    def config(self):
        """The config of the language model: the model's own, or a multimodal model's text config."""
        return self.model.config.get_text_config()

    @property
    def output_multiplier(self) -> float:
        """The factor on the attention output before the residual add (1 but for Granite and ESM C)."""
        multiplier = self.spec.output_multiplier
        if multiplier is None:
            return 1.0
        return float(multiplier(self.config) if callable(multiplier) else getattr(self.config, multiplier))

    @property
    def blocks(self):
        return self.model.get_submodule(self.spec.blocks)

    def attention(self, layer):
        return self.blocks[layer].get_submodule(self.spec.attention)

    @property
    def parallel(self) -> bool:
        return self.spec.parallel

    def _logits(self, tokens, valid):
        mask = None if valid is None else valid.to(torch.long)
        options = {"use_cache": False} if self.causal else {}
        output = self.model(input_ids=tokens, attention_mask=mask, **options)
        return output.logits if self.lm_head else None

    # --- description ---
    def norms(self):
        return tuple(norm for norm in self.spec.norms if self._norm_module(norm, 0) is not None)

    def _norm_kind(self, module):
        return self.spec.norm_kind or norm_type(module)

    def model_heads(self):
        return self.n_heads, self.n_kv_heads

    def describe(self) -> dict:
        """The model description (store/SCHEMA.md); its norms read from the last block, as the first may
        lack one (ModernBERT's first layer reads the embedding norm's output, no norm of its own)."""
        norms = self.norms()
        description = {
            "family": self.family,
            "architecture": type(self.model).__name__,
            "lm_head": self.lm_head,
            "n_layers": self.n_layers,
            "d_model": self.config.hidden_size,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "d_head": self.d_head,
            "d_ff": self._config_value(self.spec.d_ff_keys, 4 * self.config.hidden_size),
            "vocab_size": self.config.vocab_size,
            "attn_scale": self._score["scale"][0],
            "causal": self.causal,
            "score": self._score,
            "positions": self.spec.positions,
            **norm_summary(norms, parallel=self.spec.parallel),
            **described_norms(self.model, self.blocks[-1], norms, self.spec.norm_gain, self.spec.norm_kind),
            "activation": self._config_value(self.spec.activation_keys, None),
            "dtype": dtype_name(self.model),
            "n_parameters": sum(p.numel() for p in self.model.parameters()),
        }
        if self.spec.output_multiplier:
            description["output_multiplier"] = self.output_multiplier
        rope = getattr(self.config, "rope_parameters", None)
        if self.spec.positions == "rotary" and rope:
            description["rope_parameters"] = _plain(rope)
        for key in self.spec.extra_config:
            value = config_value(self.config, key)
            if value is not None:
                description[key.rpartition(".")[2]] = _plain(value)
        return description

    def score_terms(self):
        attentions = [self.attention(layer) for layer in range(self.n_layers)]
        if self.spec.scale_of is not None:
            scales = [float(self.spec.scale_of(a)) for a in attentions]
        elif self.spec.route == "projection":
            scales = [float(a.inv_norm_factor) for a in attentions]
        else:
            scales = [1.0 if self.spec.query_scale_of is not None else float(a.scaling) for a in attentions]
        windows = [self._sliding_window(attention, layer) for layer, attention in enumerate(attentions)]
        softcaps = [getattr(a, "attn_logit_softcapping", None) for a in attentions]
        alibi = None
        if self.spec.alibi_slopes is not None:
            alibi = [self.spec.alibi_slopes(self.config, self.config.num_attention_heads)] * self.n_layers
        terms = {"scale": scales, "sliding_window": [None if w is None else int(w) for w in windows],
                 "softcap": [None if c is None else float(c) for c in softcaps], "alibi_slopes": alibi}
        if self.spec.relative_bias is not None:
            terms["relative_bias"] = self.spec.relative_bias(self.model, attentions)
        if self.spec.sinks is not None:
            terms["sink_logits"] = [self._sink_logits(attention, layer) for layer, attention in enumerate(attentions)]
        return terms

    def _sink_logits(self, attention, layer: int) -> list[float]:
        """A layer's learned sink logits, one finite value per head; any other is an UnsupportedModelError."""
        sinks = getattr(attention, self.spec.sinks, None)
        values = None if sinks is None else sinks.detach().float().cpu()
        if values is None or values.shape != (self.config.num_attention_heads,) or not bool(values.isfinite().all()):
            found = "none" if values is None else f"shape {tuple(values.shape)}, finite: {bool(values.isfinite().all())}"
            raise UnsupportedModelError(
                f"layer {layer} of this {self.family} model ({type(self.model).__name__}) has sink logits "
                f"`{self.spec.attention}.{self.spec.sinks}` ({found}) that a softmax term cannot describe: expected "
                f"one finite logit per head ({self.config.num_attention_heads}); check the checkpoint's sinks tensors"
            )
        return values.tolist()

    def _sliding_window(self, attention, layer: int):
        """The layer's sliding window: the family's own rule, else the attention module's attribute, else
        the config's window where ``layer_types`` makes the layer a sliding one (or has no layer_types)."""
        if self.spec.sliding_window is not None:
            return self.spec.sliding_window(attention)
        if hasattr(attention, "sliding_window"):
            return attention.sliding_window
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None and layer_types[layer] != "sliding_attention":
            return None
        return getattr(self.config, "sliding_window", None)

    def _config_value(self, keys, default):
        for key in keys:
            value = config_value(self.config, key)
            if value is not None:
                return value
        return default

    def _head_layout(self) -> tuple[int, int, int]:
        """(n_heads, d_head, n_kv_heads), checked against the projections' sizes."""
        attention, config = self.attention(0), self.config
        n_heads = config.num_attention_heads
        d_head = next((getattr(attention, name) for name in ("head_dim", "head_size", "attention_head_size",
                                                              "key_value_proj_dim")
                       if isinstance(getattr(attention, name, None), int)), config.hidden_size // n_heads)
        n_kv = (getattr(attention, "num_kv_heads", None) or getattr(attention, "kv_heads", None)  # GPTBigCode's
                or getattr(config, "num_key_value_heads", None) or n_heads)
        q_rows, k_rows = (_out_features(self.blocks[0].get_submodule(p)) for p in (self.spec.projections.q, self.spec.projections.k))
        fused = ((n_heads + 2 * n_kv) * d_head,) * 2
        expected = {"separate": (n_heads * d_head, n_kv * d_head), "concat": fused, "grouped": fused, "codegen": fused}[self.spec.projections.layout]
        if (q_rows, k_rows) != expected:
            raise UnsupportedModelError(
                f"{self.family} model with q/k projections of {q_rows}/{k_rows} outputs: expected {expected} for "
                f"{n_heads} heads of {d_head} and {n_kv} key/value heads; this configuration is not supported"
            )
        return n_heads, d_head, n_kv

    # --- weights ---
    def head_weights(self, layer):
        block, projections = self.blocks[layer], self.spec.projections
        rows = split_heads_rows(projections.layout, self.n_heads, self.n_kv_heads, self.d_head)
        weights = {}
        for name in QKV_SITES:
            module = block.get_submodule(getattr(projections, name))
            matrix, bias = _out_in(module), _bias(module)
            weights[f"w_{name}"] = matrix[torch.as_tensor(rows[name])].permute(0, 2, 1)
            weights[f"b_{name}"] = bias[torch.as_tensor(rows[name])]
        if self.spec.query_scale_of is not None:
            scaling = float(self.spec.query_scale_of(self.attention(layer)))
            weights["w_q"], weights["b_q"] = weights["w_q"] * scaling, weights["b_q"] * scaling
        output = block.get_submodule(projections.o)
        weights["w_o"] = _out_in(output).T.reshape(self.n_heads, self.d_head, -1) * self.output_multiplier
        weights["b_o"] = _bias(output) * self.output_multiplier
        return {name: value.detach().float() for name, value in weights.items()}

    # --- hooks ---
    def _install_hooks(self):
        for layer in range(self.n_layers):
            block, attention = self.blocks[layer], self.attention(layer)
            pre_hook(block, self._record_hook("resid_pre", layer, read=first_input))
            block.register_forward_hook(self._record_hook("resid_post", layer, read=first_output))
            pre_hook(attention, self._record_hook("attn_in", layer, read=first_input))
            pre_hook(block, self._hold_input(layer))
            self._install_mid_hook(layer)
            if self.spec.route == "projection":
                self._install_projection_hooks(layer)

    def _install_projection_hooks(self, layer):
        """The projection route: q, k, v from the projections' outputs; the pattern from the attention
        module's second output (asked for where its forward takes ``output_attentions``); the position
        bias it is called with checked against the description."""
        block, attention = self.blocks[layer], self.attention(layer)
        pre_hook(attention, self._hold_rotation)
        if self.spec.projections.layout == "separate":
            self._install_separate_projection_hooks(layer)
        else:
            block.get_submodule(self.spec.projections.q).register_forward_hook(self._projection_hook(layer))
        if "output_attentions" in inspect.signature(attention.forward).parameters:
            pre_hook(attention, self._ask_pattern(layer))
        if self.spec.relative_bias is not None:
            pre_hook(attention, self._check_position_bias(layer))
        attention.register_forward_hook(self._record_hook("pattern", layer, read=lambda args, output: output[1]))

    def _ask_pattern(self, layer):
        """A pre-hook asking an attention module that returns its pattern only on request (MPNet) for it."""
        def hook(module, args, kwargs):
            trace = active(self)
            if trace is not None and trace.recording is not None and trace.recording.wants("pattern", layer):
                return args, {**kwargs, "output_attentions": True}
            return None

        return hook

    def _check_position_bias(self, layer):
        """A pre-hook refusing a call with another position bias than the described one (MPNet passes it third)."""
        def hook(module, args, kwargs):
            if active(self) is not None:
                bias = kwargs["position_bias"] if "position_bias" in kwargs else args[2]
                self.check_score_call(layer, self._score["scale"][layer], None, None, bias)

        return hook

    def _install_separate_projection_hooks(self, layer):
        """q, k, v from three projections, recorded by each one's hook; an edit needs all three at once,
        so the q projection's hook computes k and v from the same input (the modules' own forward,
        without their hooks), edits, and the k and v projections' hooks return the edited ones."""
        block, projections = self.blocks[layer], self.spec.projections
        modules = {name: block.get_submodule(getattr(projections, name)) for name in QKV_SITES}

        def heads(output):
            return output.view(*output.shape[:-1], -1, self.d_head)

        def q_hook(module, args, output):
            trace = active(self)
            if trace is None:
                return output
            if trace.edit is not None:
                q, k, v = trace.edit(layer, heads(output), *(heads(modules[name].forward(args[0])) for name in ("k", "v")))
                trace.held["edited"] = {"k": k, "v": v}
                output = q.reshape(output.shape)
            if trace.recording is not None:
                trace.recording.record("q", layer, heads(output))
            return output

        def held_hook(name):
            def hook(module, args, output):
                trace = active(self)
                if trace is None:
                    return output
                if trace.edit is not None:
                    output = trace.held["edited"].pop(name).reshape(output.shape)
                if trace.recording is not None:
                    trace.recording.record(name, layer, heads(output))
                return output

            return hook

        modules["q"].register_forward_hook(q_hook)
        for name in ("k", "v"):
            modules[name].register_forward_hook(held_hook(name))

    def _install_mid_hook(self, layer):
        block, mid = self.blocks[layer], self.spec.mid
        if mid == "parallel":
            self.attention(layer).register_forward_hook(self._record_hook("resid_mid", layer, read=self._parallel_mid(layer)))
            return
        where, _, path = mid.partition(":")
        module = block.get_submodule(path)
        if where == "input":
            pre_hook(module, self._record_hook("resid_mid", layer, read=self._token_shaped(first_input)))
        else:
            module.register_forward_hook(self._record_hook("resid_mid", layer, read=self._token_shaped(first_output)))

    def output_refusals(self):
        refusals = {}
        if self.spec.mlp is None:
            refusals["mlp_out"] = (f"needs the MLP module: the {self.family} description in extract/families.py (module "
                                   "orthosphere.extract.families) names none (Family.mlp) and its blocks have no 'mlp'")
        if getattr(self.config, "pretraining_tp", 1) > 1 and getattr(self.config, "slow_but_exact", False):
            why = ("is not read: with pretraining_tp > 1 and slow_but_exact=True this model multiplies by slices of its "
                   "output projections' weights, outside the modules whose hooks record it")
            refusals.update({site: why for site in ("z", "attn_out", "mlp_out")})
        return refusals

    def _install_output_hooks(self):
        """z from the output projection's input; attn_out and mlp_out from what the block adds to the
        residual: the output norm's output (sandwich, output-norm families), else the output
        projection's and the MLP's output times the output multiplier (Granite)."""
        norms = {norm.site: norm for norm in self.norms()}
        for layer in range(self.n_layers):
            block = self.blocks[layer]
            output = block.get_submodule(self.spec.projections.o)
            pre_hook(output, self._record_hook("z", layer, read=self._heads_of))
            self._install_added_hook("attn_out", layer, norms.get("attn_output"), output)
            if self.spec.mlp is not None:
                self._install_added_hook("mlp_out", layer, norms.get("mlp_output"), block.get_submodule(self.spec.mlp))

    def _heads_of(self, args, kwargs):
        """The output projection's input (batch, pos, head * d_head) as (batch, pos, head, d_head)."""
        return first_input(args, kwargs).unflatten(-1, (self.n_heads, self.d_head))

    def _install_added_hook(self, site, layer, norm, module):
        """Record `site`: the output of `norm` (a Norm of the block, or None) or else of `module`, times
        the output multiplier; a copy on a GPU, where the model may change it in place before the
        recording's copy runs (Falcon adds the attention output into the MLP's)."""
        multiplier = 1.0 if norm is not None else self.output_multiplier

        def read(args, output):
            value = first_output(args, output)
            if multiplier != 1.0:
                return value * multiplier
            return value.clone() if value.is_cuda else value

        source = self._norm_module(norm, layer) if norm is not None else module
        source.register_forward_hook(self._record_hook(site, layer, read=self._token_shaped(read)))

    def _hold_input(self, layer):
        """Keep the block input in the trace for resid_mid (parallel families add to it) and the
        norm factors (OPT's flattened stream takes its shape)."""
        def hook(module, args, kwargs):
            trace = active(self)
            if trace is not None and trace.recording is not None:
                trace.held["resid_pre"] = first_input(args, kwargs)

        return hook

    def _parallel_mid(self, layer):
        def read(args, output):
            return active(self).held["resid_pre"] + self.output_multiplier * first_output(args, output)

        return read

    def _hold_rotation(self, module, args, kwargs):
        """Keep the cos and sin the attention module receives, for the projection hook's rotary embedding."""
        trace = active(self)
        if trace is not None and self.spec.rotary is not None:
            trace.held["rotation"] = kwargs["position_embeddings"]

    def _projection_hook(self, layer):
        """q, k, v from the fused projection's output, split by its layout, rotary embedding applied
        as the family does: recorded; edited (before the rotation, by its inverse) in a copy of the
        output."""
        rows = {name: torch.as_tensor(index) for name, index in
                split_heads_rows(self.spec.projections.layout, self.n_heads, self.n_kv_heads, self.d_head).items()}
        rotate = _function(self.spec.rotary) if self.spec.rotary else None

        def turn(q, k, cos, sin):  # (batch, pos, head, d_head) in and out
            q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return q.transpose(1, 2), k.transpose(1, 2)

        def hook(module, args, output):
            trace = active(self)
            if trace is None:
                return output
            q, k, v = (output[..., rows[name].to(output.device)] for name in QKV_SITES)
            if rotate is not None:
                cos, sin = trace.held["rotation"]
                q, k = turn(q, k, cos, sin)
            if trace.edit is not None:
                q, k, v = trace.edit(layer, q, k, v)
                unturned = turn(q, k, cos, -sin) if rotate is not None else (q, k)
                output = output.clone()
                for name, value in zip(QKV_SITES, (*unturned, v)):
                    output[..., rows[name].to(output.device)] = value
            if trace.recording is not None:
                for site, value in zip(QKV_SITES, (q, k, v)):
                    trace.recording.record(site, layer, value)
            return output

        return hook


def config_value(config, key: str):
    """The config's value at `key`, a dotted path through sub-configs (DBRX's "attn_config.clip_qkv");
    None where it has none."""
    value = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
        if value is None:
            return None
    return value


def _function(path: str):
    """The function at a dotted path (a family's own rotary embedding)."""
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _out_features(module: nn.Module) -> int:
    return _out_in(module).shape[0]


def _out_in(module: nn.Module) -> torch.Tensor:
    """A projection's weight as (out, in): nn.Linear's own layout; GPT-2's Conv1D stores (in, out)."""
    return module.weight.T if type(module).__name__ == "Conv1D" else module.weight


def _bias(module: nn.Module) -> torch.Tensor:
    weight = _out_in(module)
    bias = getattr(module, "bias", None)
    return bias if bias is not None else torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)


def _plain(value):
    """A config value as plain JSON-able data."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
