"""Architecture adapters: read and edit what a model's attention layers compute.

One interface over the project's arithmetic transformers and the Hugging Face GPT-2, Llama
and BERT families, used by extraction and by the replay's online noise check::

    adapter = adapter_for(model)
    adapter.describe()                  # the store's `model` attribute
    adapter.head_weights(layer)         # w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o (float32, store layout)
    logits = adapter.forward(tokens, valid)   # (batch, pos, vocab); valid marks real tokens
    with adapter.capture(sites, layers, dtype=torch.float16) as recording:
        logits = adapter.forward(tokens, valid)
        activations = recording.take()  # site -> CPU tensor (batch, layer, pos, ...) as in the store
    with adapter.edit_qkv(fn):          # fn(layer, q, k, v) -> (q, k, v)
        logits = adapter.forward(tokens, valid)

Sites of block (layer) l, each (batch, pos, ...):

- ``resid_pre``: the stream the block reads; ``resid_post``: the stream it writes, so
  ``resid_post[l] == resid_pre[l + 1]``.
- ``resid_mid``: the stream the feed-forward residual adds to. In Pre-Norm families (GPT-2,
  Llama, arithmetic ``none``/``pre``/``qkv``) that is resid_pre plus the attention output;
  in Post-Norm ones (BERT, arithmetic ``post``) it is LayerNorm(resid_pre + attention
  output), the input of the feed-forward block.
- ``attn_in``: what W_Q, W_K and W_V read: ln_1's output (GPT-2), input_layernorm's output
  (Llama), the block input (BERT), the norm's output or the raw stream (arithmetic).
- ``q`` (head, d_head), ``k`` and ``v`` (kv_head, d_head): as they enter the score and the
  weighted sum -- after rotary embedding and any per-head norm, before grouped-query heads
  are repeated -- so softmax(q . k * attn_scale + mask) is the model's own attention, and
  head h reads kv_head h // (n_heads // n_kv_heads).
- ``pattern`` (head, qpos, kpos): that softmax.

``edit_qkv`` hands ``fn`` q (batch, pos, head, d_head) and k, v (batch, pos, kv_head, d_head)
of every layer as they enter the score; what it returns is used instead (and is what a
simultaneous capture records). Scaling v of a token scales its message W_O v exactly.

Hugging Face models are routed through an attention function registered with transformers'
AttentionInterface under the name "orthosphere": it receives q, k, v after projection and
rotary embedding, records or edits them, and then runs SDPA (or, when the pattern is wanted,
an explicit softmax that matches transformers' eager attention).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from orthosphere.store import DEFAULT_SITES, SITES

from .model import ArithmeticTransformer, ConfigError

SUPPORTED_FAMILIES = ("arithmetic", "gpt2", "llama", "bert")
"""Model families an adapter exists for (Hugging Face `model_type` for the last three)."""

ATTENTION_IMPLEMENTATION = "orthosphere"
ROUTE_ATTRIBUTE = "_orthosphere_route"
QKV_SITES = ("q", "k", "v")

EditFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple]


class UnsupportedModelError(ConfigError):
    """A model of an architecture that no adapter covers."""


def unsupported_message(what: str) -> str:
    return (
        f"{what} is not supported: expected one of the families {list(SUPPORTED_FAMILIES)} "
        "(the project's arithmetic transformers; Hugging Face GPT-2, Llama and BERT)"
    )


class Recording:
    """Activations of one forward pass, gathered by hooks into CPU tensors laid out as in the store."""

    def __init__(self, sites, layers, dtype: torch.dtype, pin_memory: bool, allocate=None):
        """allocate(shape, dtype, pin_memory) gives each forward pass's buffers (default: new ones);
        a pool that takes them back once written spares a fresh allocation per batch."""
        self.allocate = allocate or _new_buffer
        self.sites = tuple(sites)
        self.layers = tuple(layers)
        self.slot = {layer: index for index, layer in enumerate(self.layers)}
        self.dtype = dtype
        self.pin_memory = pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self._filled: set[tuple[str, int]] = set()

    def wants(self, site: str, layer: int) -> bool:
        return site in self.sites and layer in self.slot

    def record(self, site: str, layer: int, value: torch.Tensor) -> None:
        """Copy one layer's value (batch, ...) into the site's (batch, layer, ...) buffer."""
        if not self.wants(site, layer):
            return
        buffer = self._buffers.get(site)
        if buffer is None:
            shape = (value.shape[0], len(self.layers), *value.shape[1:])
            buffer = self.allocate(shape, self.dtype, self.pin_memory)
            self._buffers[site] = buffer
        if self.pin_memory:
            buffer[:, self.slot[layer]].copy_(value.detach(), non_blocking=True)
        else:
            with _one_thread():
                buffer[:, self.slot[layer]].copy_(value.detach())
        self._filled.add((site, layer))

    def take(self) -> dict[str, torch.Tensor]:
        """The recorded activations of the last forward pass; the recording starts afresh."""
        missing = [(site, layer) for site in self.sites for layer in self.layers if (site, layer) not in self._filled]
        if missing:
            raise RuntimeError(
                f"the forward pass did not reach sites {missing[:5]}: run adapter.forward inside "
                "the capture block before take()"
            )
        if self.pin_memory:
            torch.cuda.synchronize()
        buffers, self._buffers, self._filled = self._buffers, {}, set()
        return buffers


def _new_buffer(shape, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)


_THREADS_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_thread():
    """Copy on one CPU thread: a copy of a few MB is memory-bound, and a parallel copy waits
    for its slowest thread, which on a busy machine costs far more than it saves."""
    with _THREADS_LOCK:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@dataclass
class Route:
    """Per attention module: its layer, and the recording and edit active on it."""

    layer: int
    recording: Recording | None = None
    edit: EditFn | None = None
    held: dict = field(default_factory=dict)


class Adapter:
    """The architecture-neutral view of a model (see the module docstring)."""

    family = ""
    sites = SITES

    def __init__(self, model: nn.Module):
        self.model = model
        self.routes = [self._route(layer) for layer in range(self.n_layers)]

    # --- what a family defines -------------------------------------------------------
    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def attention(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError

    def head_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """w_q (head, d_model, d_head), w_k, w_v (kv_head, d_model, d_head), w_o (head, d_head, d_model),
        biases b_q, b_k, b_v (.., d_head) and b_o (d_model), float32: q = attn_in @ w_q[h] + b_q[h]
        before rotary embedding or any per-head norm."""
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def _install_route(self, layer: int, route: Route) -> None:
        """Make the layer's attention consult `route` for q, k, v (and edits)."""
        raise NotImplementedError

    def _residual_hooks(self, layer: int, recording: Recording) -> list:
        raise NotImplementedError

    # --- shared ----------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def check_sites(self, sites) -> tuple[str, ...]:
        """The requested sites in schema order; one the model cannot provide is an error."""
        sites = tuple(DEFAULT_SITES if sites is None else sites)
        unknown = [site for site in sites if site not in self.sites]
        if unknown or not sites:
            raise ConfigError(
                f"site(s) {unknown or 'none'} cannot be provided by this {self.family} model: "
                f"expected one or more of {list(self.sites)}"
            )
        return tuple(site for site in SITES if site in sites)

    def check_layers(self, layers) -> tuple[int, ...]:
        """Sorted, unique layer indices; one the model does not have is an error."""
        if layers is None:
            return tuple(range(self.n_layers))
        layers = sorted({int(layer) for layer in layers})
        outside = [layer for layer in layers if not 0 <= layer < self.n_layers]
        if outside or not layers:
            raise ConfigError(
                f"layer(s) {outside or 'none'} out of range: the model has {self.n_layers} layers, "
                f"expected indices 0..{self.n_layers - 1}"
            )
        return tuple(layers)

    @contextlib.contextmanager
    def capture(self, sites=None, layers=None, dtype: torch.dtype = torch.float32, allocate=None):
        """Record the sites of the layers on every forward pass; take() returns and resets them
        (buffers from allocate, see Recording)."""
        sites, layers = self.check_sites(sites), self.check_layers(layers)
        recording = Recording(sites, layers, dtype, pin_memory=self.device.type == "cuda", allocate=allocate)
        handles = [handle for layer in layers for handle in self._residual_hooks(layer, recording)]
        for layer in layers:
            self.routes[layer].recording = recording
        try:
            yield recording
        finally:
            for handle in handles:
                handle.remove()
            for layer in layers:
                self.routes[layer].recording = None

    @contextlib.contextmanager
    def edit_qkv(self, fn: EditFn):
        """Replace q, k, v as they enter the score by fn(layer, q, k, v) in every layer."""
        for route in self.routes:
            route.edit = fn
        try:
            yield
        finally:
            for route in self.routes:
                route.edit = None

    def all_head_weights(self, layers) -> dict:
        """head_weights of the layers, stacked along a leading layer dim, as numpy float32."""
        per_layer = [self.head_weights(layer) for layer in layers]
        return {name: torch.stack([w[name] for w in per_layer]).cpu().numpy() for name in per_layer[0]}

    def _route(self, layer: int) -> Route:
        module = self.attention(layer)
        route = getattr(module, ROUTE_ATTRIBUTE, None)
        if route is None:
            route = Route(layer)
            setattr(module, ROUTE_ATTRIBUTE, route)
            self._install_route(layer, route)
        return route


def _output_tensor(output):
    return output[0] if isinstance(output, tuple) else output


def _output_hook(recording: Recording, site: str, layer: int):
    def hook(module, args, output):
        recording.record(site, layer, _output_tensor(output))

    return hook


def _input_hook(recording: Recording, site: str, layer: int):
    def hook(module, args, kwargs):
        recording.record(site, layer, args[0] if args else kwargs["hidden_states"])

    return hook


# --- the project's arithmetic transformers --------------------------------------------


class ArithmeticAdapter(Adapter):
    """The arithmetic transformers: every site is a HookPoint of the model."""

    family = "arithmetic"

    @property
    def blocks(self):
        return self.model.blocks

    def attention(self, layer):
        return self.model.blocks[layer].attn

    def describe(self) -> dict:
        return dict(self.model.describe())

    def head_weights(self, layer):
        return self.attention(layer).head_weights()

    def forward(self, tokens, valid=None):
        """Logits; padding sits after the real tokens, so causal attention needs no mask."""
        return self.model(tokens)

    def _install_route(self, layer, route):
        """q and k are held until v arrives; the edit then rewrites them in place, before the
        score is computed from them, and replaces v."""
        attention = self.attention(layer)

        def hold(name):
            def hook(module, args, output):
                route.held[name] = output

            return hook

        def complete(module, args, v):
            q, k = route.held.pop("q"), route.held.pop("k")
            if route.edit is not None:
                new_q, new_k, v = route.edit(layer, q, k, v)
                for old, new in ((q, new_q), (k, new_k)):
                    if new is not old:
                        old.copy_(new)
            if route.recording is not None:
                for site, value in zip(QKV_SITES, (q, k, v)):
                    route.recording.record(site, layer, value)
            return v

        attention.hook_q.register_forward_hook(hold("q"))
        attention.hook_k.register_forward_hook(hold("k"))
        attention.hook_v.register_forward_hook(complete)

    def _residual_hooks(self, layer, recording):
        block = self.model.blocks[layer]
        points = {
            "resid_pre": block.hook_resid_pre,
            "resid_mid": block.hook_resid_mid,
            "resid_post": block.hook_resid_post,
            "attn_in": block.attn.hook_attn_in,
            "pattern": block.attn.hook_pattern,
        }
        return [
            point.register_forward_hook(_output_hook(recording, site, layer))
            for site, point in points.items()
            if recording.wants(site, layer)
        ]


# --- Hugging Face families ------------------------------------------------------------


def routed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention function "orthosphere": q (batch, head, pos, d_head), k and v
    (batch, kv_head, pos, d_head) arrive after projection and rotary embedding; they are edited
    and recorded here, then attended with SDPA, or explicitly when the pattern is recorded."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    route = getattr(module, ROUTE_ATTRIBUTE, None)
    if route is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if route.edit is not None:
        q, k, v = route.edit(route.layer, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        query, key, value = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    recording = route.recording
    if recording is not None:
        for site, tensor in zip(QKV_SITES, (query, key, value)):
            recording.record(site, route.layer, tensor.transpose(1, 2))
    if recording is not None and recording.wants("pattern", route.layer):
        output, pattern = explicit_attention(module, query, key, value, attention_mask, scaling, dropout)
        recording.record("pattern", route.layer, pattern)
        return output, pattern
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def explicit_attention(module, query, key, value, attention_mask, scaling, dropout):
    """transformers' eager attention for every family, with grouped-query heads and a boolean
    (True = attend), additive or absent mask (absent: causal if the module is)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None and getattr(module, "is_causal", True) and query.shape[2] > 1:
        attention_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask
    pattern = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    pattern = nn.functional.dropout(pattern, p=dropout, training=module.training)
    output = torch.matmul(pattern, value).transpose(1, 2).contiguous()
    return output, pattern


def register_attention() -> None:
    """Register the "orthosphere" attention function and its (SDPA-style) mask with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, routed_attention)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)


def _split_heads(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A projection (d_model, n_heads * d_head), input first, as (head, d_model, d_head)."""
    d_model = weight.shape[0]
    return weight.reshape(d_model, n_heads, -1).permute(1, 0, 2)


def _float32(weights: dict) -> dict[str, torch.Tensor]:
    return {name: value.detach().float().contiguous() for name, value in weights.items()}


def _bias(linear: nn.Module, size: int, like: torch.Tensor) -> torch.Tensor:
    return linear.bias if linear.bias is not None else torch.zeros(size, dtype=like.dtype, device=like.device)


class HuggingFaceAdapter(Adapter):
    """Shared by the transformers families: routes attention through "orthosphere"."""

    norm_placement = "pre"
    norm_type = "layer"
    positions = "learned"
    causal = True

    def __init__(self, model):
        register_attention()
        model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
        if model.config._attn_implementation != ATTENTION_IMPLEMENTATION:
            raise UnsupportedModelError(unsupported_message(f"{type(model).__name__} (no attention interface)"))
        super().__init__(model)

    @property
    def config(self):
        return self.model.config

    def _install_route(self, layer, route):
        """Nothing to install: routed_attention reads the route from the module."""

    def _mid_hook(self, layer: int, recording: Recording):
        raise NotImplementedError

    def _residual_hooks(self, layer, recording):
        block, handles = self.blocks[layer], []
        if recording.wants("resid_pre", layer):
            handles.append(block.register_forward_pre_hook(_input_hook(recording, "resid_pre", layer), with_kwargs=True))
        if recording.wants("resid_post", layer):
            handles.append(block.register_forward_hook(_output_hook(recording, "resid_post", layer)))
        if recording.wants("attn_in", layer):
            handles.append(
                self.attention(layer).register_forward_pre_hook(_input_hook(recording, "attn_in", layer), with_kwargs=True)
            )
        if recording.wants("resid_mid", layer):
            handles.append(self._mid_hook(layer, recording))
        return handles

    def forward(self, tokens, valid=None):
        mask = None if valid is None else valid.to(torch.long)
        return self.model(input_ids=tokens, attention_mask=mask, **self._forward_options).logits

    _forward_options = {"use_cache": False}

    def describe(self) -> dict:
        n_heads, d_head = self._head_layout()
        return {
            "family": self.family,
            "architecture": type(self.model).__name__,
            "n_layers": self.n_layers,
            "d_model": self.config.hidden_size,
            "n_heads": n_heads,
            "n_kv_heads": self._n_kv_heads(),
            "d_head": d_head,
            "d_ff": self._d_ff(),
            "vocab_size": self.config.vocab_size,
            "attn_scale": self._attn_scale(),
            "causal": self.causal,
            "norm_placement": self.norm_placement,
            "norm_type": self.norm_type,
            "norm_eps": self._norm_eps(),
            "qk_norm": False,
            "positions": self.positions,
            "activation": self._activation(),
            "n_parameters": sum(p.numel() for p in self.model.parameters()),
        }

    def _head_layout(self) -> tuple[int, int]:
        n_heads = self.config.num_attention_heads
        return n_heads, self.config.hidden_size // n_heads

    def _n_kv_heads(self) -> int:
        return self._head_layout()[0]

    def _attn_scale(self) -> float:
        return float(self.attention(0).scaling)


class GPT2Adapter(HuggingFaceAdapter):
    family = "gpt2"

    def __init__(self, model):
        if model.config.scale_attn_by_inverse_layer_idx:
            raise UnsupportedModelError(
                "GPT-2 with scale_attn_by_inverse_layer_idx=True has a different attention scale in every "
                "layer; the store holds one attn_scale: use a model without it"
            )
        super().__init__(model)

    @property
    def blocks(self):
        return self.model.transformer.h

    def attention(self, layer):
        return self.blocks[layer].attn

    def _mid_hook(self, layer, recording):
        return self.blocks[layer].ln_2.register_forward_pre_hook(_input_hook(recording, "resid_mid", layer), with_kwargs=True)

    def head_weights(self, layer):
        attention = self.attention(layer)
        n_heads, d_head = self._head_layout()
        d_model = self.config.hidden_size
        w_q, w_k, w_v = attention.c_attn.weight.split(d_model, dim=1)
        b_q, b_k, b_v = attention.c_attn.bias.split(d_model)
        return _float32({
            "w_q": _split_heads(w_q, n_heads), "w_k": _split_heads(w_k, n_heads), "w_v": _split_heads(w_v, n_heads),
            "w_o": attention.c_proj.weight.reshape(n_heads, d_head, d_model),
            "b_q": b_q.reshape(n_heads, d_head), "b_k": b_k.reshape(n_heads, d_head), "b_v": b_v.reshape(n_heads, d_head),
            "b_o": attention.c_proj.bias,
        })

    def _d_ff(self):
        return self.config.n_inner or 4 * self.config.hidden_size

    def _norm_eps(self):
        return float(self.config.layer_norm_epsilon)

    def _activation(self):
        return self.config.activation_function


class LlamaAdapter(HuggingFaceAdapter):
    family = "llama"
    norm_type = "rms"
    positions = "rotary"

    @property
    def blocks(self):
        return self.model.model.layers

    def attention(self, layer):
        return self.blocks[layer].self_attn

    def _mid_hook(self, layer, recording):
        norm = self.blocks[layer].post_attention_layernorm
        return norm.register_forward_pre_hook(_input_hook(recording, "resid_mid", layer), with_kwargs=True)

    def _head_layout(self):
        attention = self.attention(0)
        return self.config.num_attention_heads, attention.head_dim

    def _n_kv_heads(self):
        return self.config.num_key_value_heads

    def head_weights(self, layer):
        attention = self.attention(layer)
        n_heads, d_head = self._head_layout()
        n_kv = self._n_kv_heads()
        weights = {}
        for name, linear, heads in (("q", attention.q_proj, n_heads), ("k", attention.k_proj, n_kv), ("v", attention.v_proj, n_kv)):
            weights[f"w_{name}"] = _split_heads(linear.weight.T, heads)
            weights[f"b_{name}"] = _bias(linear, heads * d_head, linear.weight).reshape(heads, d_head)
        weights["w_o"] = attention.o_proj.weight.T.reshape(n_heads, d_head, -1)
        weights["b_o"] = _bias(attention.o_proj, self.config.hidden_size, attention.o_proj.weight)
        return _float32(weights)

    def describe(self):
        description = super().describe()
        description["rope_parameters"] = dict(self.config.rope_parameters)
        return description

    def _d_ff(self):
        return self.config.intermediate_size

    def _norm_eps(self):
        return float(self.config.rms_norm_eps)

    def _activation(self):
        return self.config.hidden_act


class BertAdapter(HuggingFaceAdapter):
    """BERT: bidirectional, Post-Norm; resid_mid is the attention's add-and-LayerNorm output."""

    family = "bert"
    norm_placement = "post"
    causal = False
    _forward_options = {}

    def __init__(self, model):
        if model.config.is_decoder:
            raise UnsupportedModelError(
                "BERT configured as a decoder (is_decoder=True) is not supported: expected the "
                "bidirectional encoder"
            )
        super().__init__(model)

    @property
    def blocks(self):
        return self.model.bert.encoder.layer

    def attention(self, layer):
        return self.blocks[layer].attention.self

    def _mid_hook(self, layer, recording):
        return self.blocks[layer].attention.register_forward_hook(_output_hook(recording, "resid_mid", layer))

    def head_weights(self, layer):
        attention = self.attention(layer)
        output = self.blocks[layer].attention.output.dense
        n_heads, d_head = self._head_layout()
        weights = {}
        for name, linear in (("q", attention.query), ("k", attention.key), ("v", attention.value)):
            weights[f"w_{name}"] = _split_heads(linear.weight.T, n_heads)
            weights[f"b_{name}"] = linear.bias.reshape(n_heads, d_head)
        weights["w_o"] = output.weight.T.reshape(n_heads, d_head, -1)
        weights["b_o"] = output.bias
        return _float32(weights)

    def _d_ff(self):
        return self.config.intermediate_size

    def _norm_eps(self):
        return float(self.config.layer_norm_eps)

    def _activation(self):
        return self.config.hidden_act


HUGGING_FACE_ADAPTERS = {
    "gpt2": (GPT2Adapter, "GPT2LMHeadModel"),
    "llama": (LlamaAdapter, "LlamaForCausalLM"),
    "bert": (BertAdapter, "BertForMaskedLM"),
}
"""transformers model_type -> (adapter, the model class with a language-model head it reads)."""


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of a loaded model; any other architecture is an UnsupportedModelError."""
    if isinstance(model, ArithmeticTransformer):
        return ArithmeticAdapter(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in HUGGING_FACE_ADAPTERS:
        raise UnsupportedModelError(unsupported_message(f"model {type(model).__name__} (model_type {model_type!r})"))
    adapter, model_class = HUGGING_FACE_ADAPTERS[model_type]
    if type(model).__name__ != model_class:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not supported for {model_type}: expected {model_class}, whose "
            "language-model head gives the predictions"
        )
    return adapter(model)

