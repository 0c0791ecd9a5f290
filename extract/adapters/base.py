"""The base class of the adapters (``Adapter``): what every model's adapter shares -- checking sites and
layers, capturing and editing through the trace of a forward pass, the norm factors' hooks, the score
terms' checks. Each kind of model derives from it (``arithmetic.py``, ``huggingface.py``); the package's
docstring describes the interface and the sites.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from orthosphere.store import DEFAULT_SITES, SITES
from orthosphere.store.schema import NORM_SCALE_SITES, model_layers

from ..families import OUTSIDE_BLOCKS, Norm, UnsupportedModelError
from ..interface import same_term
from ..model import ConfigError
from ..norms import norm_eps, norm_factor, norm_type
from ..recording import Recording
from ..trace import active, tracing


class StopForward(BaseException):
    """Raised by the hook after the last layer a capture needs, and caught by ``Adapter.forward``: control
    flow, not an error (a BaseException, so that no ``except Exception`` in a model's code takes it)."""


@dataclass(frozen=True)
class ScaleSource:
    """Where a norm-factor site of one layer is read: the norm module (None: no norm, NaN), its type
    and eps, and its input's layout: ``token`` (batch, pos[, head], width), ``heads_first`` (batch,
    head, pos, d_head) or ``projection`` (batch, pos, heads * d_head: one factor for all heads)."""

    module: nn.Module | None
    kind: str = ""
    eps: float = 0.0
    layout: str = "token"
    heads: int | None = None
    """The heads of a norm on q or k; None for a norm on the residual stream."""


NO_NORM = ScaleSource(None)


class Adapter:
    """The architecture-neutral view of a model (see the module docstring)."""

    family = ""

    parallel = False
    """Whether attention and MLP both read the block input."""

    window_in_mask = False
    """Whether the model's mask, not its attention call, applies the sliding windows (Phi-MoE): the call's
    window is then not compared with the description (the exactness tests compare the attention itself)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layer_of: dict[nn.Module, int] = {self.attention(layer): layer for layer in range(self.n_layers)}
        self._position_bias: dict = {}
        self._score = self.score_terms()
        self.mlp_norm, self.refusals = self._mlp_input_norm()
        self.refusals.update(self.output_refusals())
        self.scale_sources = self._scale_sources()
        self._install_hooks()
        self._install_scale_hooks()
        self._install_output_hooks()
        self._install_mlp_input_hooks()
        for layer in range(self.n_layers):
            self.blocks[layer].register_forward_hook(self._stop_hook(layer))

    # --- what a family defines -------------------------------------------------------
    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def attention(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError

    def score_terms(self) -> dict:
        """Per layer, what turns q . k into the model's score: {"scale": [...], "sliding_window":
        [...], "softcap": [...], "alibi_slopes": [...] or None} (None where a term is absent)."""
        raise NotImplementedError

    def head_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """w_q (head, d_model, d_head), w_k, w_v (kv_head, d_model, d_head), w_o (head, d_head, d_model),
        biases b_q, b_k, b_v (.., d_head) and b_o (d_model), float32: q = attn_in @ w_q[h] + b_q[h]
        before rotary embedding, any per-head norm and, where the description has ``clip_qkv``
        (OLMo), the clamp of q, k and v to [-clip_qkv, clip_qkv], which makes them nonlinear in
        attn_in. Views of the parameters where the layout allows (all_head_weights copies them
        once, into its stack): copy before changing them."""
        raise NotImplementedError

    def _logits(self, tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor | None:
        """The model's forward pass: logits (batch, pos, vocab), None without a language-model head."""
        raise NotImplementedError

    def _install_hooks(self) -> None:
        """Install the (stateless) hooks that serve every capture and edit of this model."""
        raise NotImplementedError

    def output_refusals(self) -> dict[str, str]:
        """Why the model cannot provide z, attn_out or mlp_out (site -> reason), for those it cannot."""
        return {}

    def _install_output_hooks(self) -> None:
        """Install the hooks recording z, attn_out and mlp_out (see the module docstring)."""
        raise NotImplementedError

    def norms(self) -> tuple[Norm, ...]:
        """The model's norms (families.Norm), those absent from this configuration left out."""
        raise NotImplementedError

    def _norm_kind(self, module: nn.Module) -> str:
        return norm_type(module)

    # --- shared ----------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def sites(self) -> tuple[str, ...]:
        """The sites this model provides: all but the norm factors of norms it does not have and the
        sites it refuses (``refusals``)."""
        return tuple(site for site in SITES if site not in self.refusals
                     and (site not in NORM_SCALE_SITES or site in self.scale_sources))

    def check_sites(self, sites) -> tuple[str, ...]:
        """The requested sites in schema order (None: DEFAULT_SITES that the model provides); one
        the model cannot provide is an error that says why."""
        sites = tuple(site for site in DEFAULT_SITES if site in self.sites) if sites is None else tuple(sites)
        unknown = [site for site in sites if site not in self.sites]
        if unknown or not sites:
            reasons = [f"{site} {self.refusals[site]}" for site in unknown if site in self.refusals]
            lacking = [site for site in unknown if site in NORM_SCALE_SITES and site not in self.refusals]
            if lacking:
                reasons.append(f"{lacking} are the factors of norms this model does not have (norm_scale: a norm "
                               "whose output the attention reads; q_norm_scale, k_norm_scale: a norm on q and k; "
                               "mlp_norm_scale: a norm whose output the MLP reads), see the norms of its description "
                               "in extract/families.py (module orthosphere.extract.families)")
            why = "".join(f"; {reason}" for reason in reasons)
            raise ConfigError(
                f"site(s) {unknown or 'none'} cannot be provided by this {self.family} model: "
                f"expected one or more of {list(self.sites)}{why}"
            )
        return tuple(site for site in SITES if site in sites)

    def check_layers(self, layers) -> tuple[int, ...]:
        """Sorted, unique layer indices; one the model does not have is an error."""
        return tuple(model_layers(layers, self.n_layers, ConfigError))

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits (batch, pos, vocab); None for a model without a language-model head, or when a
        capture that stops early ended the pass after its last layer."""
        try:
            return self._logits(tokens, valid)
        except StopForward:
            return None

    @contextlib.contextmanager
    def capture(self, sites=None, layers=None, dtype: torch.dtype = torch.float32, allocate=None,
                stop_early: bool = False):
        """Record the sites of the layers on every forward pass of this thread inside the block;
        take() returns and resets them (buffers from allocate, see Recording). With `stop_early`, each
        pass stops after the last of the layers (forward then returns None: no logits)."""
        sites, layers = self.check_sites(sites), self.check_layers(layers)
        recording = Recording(sites, layers, dtype, pin_memory=self.device.type == "cuda", allocate=allocate)
        stop_after = layers[-1] if stop_early and layers[-1] < self.n_layers - 1 else None
        with tracing(self, recording=recording, stop_after=stop_after):
            yield recording

    @contextlib.contextmanager
    def edit_qkv(self, fn):
        """Replace q, k, v as they enter the score by fn(layer, q, k, v) in every layer, in this
        thread's forward passes inside the block."""
        with tracing(self, edit=fn):
            yield

    def all_head_weights(self, layers) -> dict:
        """head_weights of the layers, stacked along a leading layer dim, as numpy float32."""
        per_layer = [self.head_weights(layer) for layer in layers]
        return {name: torch.stack([w[name] for w in per_layer]).cpu().numpy() for name in per_layer[0]}

    def check_score_call(self, layer: int, scaling, sliding_window, softcap, position_bias=None, sinks=None) -> None:
        """Refuse a forward pass whose attention call uses other score terms than those described."""
        called = {"scale": scaling, "softcap": softcap} | ({} if self.window_in_mask else {"sliding_window": sliding_window})
        differing = {name: value for name, value in called.items() if not same_term(self._score[name][layer], value)}
        if not self._same_position_bias(layer, position_bias):
            differing["relative_bias"] = "a position bias other than the described one"
        if not self._same_sinks(layer, sinks):
            differing["sink_logits"] = None if sinks is None else sinks.detach().float().cpu().tolist()
        if differing:
            raise UnsupportedModelError(
                f"layer {layer} of this {self.family} model attends with {differing}, but its description says "
                f"{ {name: self._layer_term(name, layer) for name in differing} }: the family's description in "
                "extract/families.py (module orthosphere.extract.families) does not match this model"
            )

    def _layer_term(self, name: str, layer: int):
        """The described score term `name` of a layer (None where the description has none)."""
        terms = self._score.get(name)
        return terms if terms is None or name == "relative_bias" else terms[layer]

    def _same_sinks(self, layer: int, called) -> bool:
        """Whether the sink logits a layer's attention is called with (GPT-OSS's ``s_aux``) are the described ones."""
        described = self._score.get("sink_logits")
        if described is None or called is None:
            return described is None and called is None
        return torch.equal(called.detach().float().cpu(), torch.tensor(described[layer], dtype=torch.float32))

    def _same_position_bias(self, layer: int, called) -> bool:
        """Whether the position bias a layer's attention is called with (T5: (1, head, q, k)) is the
        described relative bias (None when the description has none)."""
        relative = self._score.get("relative_bias")
        if relative is None or called is None:
            return relative is None and (called is None or not bool(called.any()))
        n_pos = called.shape[-1]
        key = (relative["table_of_layer"][layer], n_pos, called.device)
        if key not in self._position_bias:
            self._position_bias[key] = relative_bias_matrix(relative, layer, n_pos).to(called.device)
        described = self._position_bias[key]
        return called.shape[-3:] == described.shape and bool(torch.equal(called[0].float(), described)) \
            and all(torch.equal(row.float(), described) for row in called[1:])

    def _norm_module(self, norm: Norm, layer: int):
        root = self.model if norm.site in OUTSIDE_BLOCKS else self.blocks[layer]
        try:
            return root.get_submodule(norm.module)
        except AttributeError:
            return None

    def _scale_sources(self) -> dict[str, dict[int, ScaleSource]]:
        """Per norm-factor site that the model provides, per layer, where it is read: norm_scale from
        the Pre-Norm (where a layer's is the identity, ModernBERT's first, from the embedding norm whose
        output it passes on), else (Post-Norm) from the norm on the previous block's residual (layer 0:
        the embedding norm, or none); q_norm_scale and k_norm_scale from the norms on q and k."""
        norms, layers = {norm.site: norm for norm in self.norms()}, range(self.n_layers)
        sources = {}
        if "attn_input" in norms:
            sources["norm_scale"] = {layer: self._input_norm_source(norms, layer) for layer in layers}
        elif "resid_post" in norms:
            first = self._scale_source(norms["embedding"], 0) if "embedding" in norms else NO_NORM
            sources["norm_scale"] = {layer: self._scale_source(norms["resid_post"], layer - 1) if layer else first
                                     for layer in layers}
        for name in ("q", "k"):
            if name in norms:
                sources[f"{name}_norm_scale"] = {layer: self._scale_source(norms[name], layer) for layer in layers}
        if self.mlp_norm is not None:
            sources["mlp_norm_scale"] = {layer: self._scale_source(self.mlp_norm, layer) for layer in layers}
        return sources

    def _input_norm_source(self, norms: dict, layer: int) -> ScaleSource:
        if not isinstance(self._norm_module(norms["attn_input"], layer), nn.Identity):
            return self._scale_source(norms["attn_input"], layer)
        return self._scale_source(norms["embedding"], 0) if layer == 0 and "embedding" in norms else NO_NORM

    def _mlp_input_norm(self) -> tuple[Norm | None, dict[str, str]]:
        """The norm whose output the MLP reads (its Pre-Norm; in Post-Norm models the norm giving
        resid_mid), or None; and why mlp_in and mlp_norm_scale are not sites of their own where they
        are not (site -> reason)."""
        norms = {norm.site: norm for norm in self.norms()}
        own, attention = norms.get("mlp_input"), norms.get("attn_input")
        if own is not None and (attention is None or own.module != attention.module):
            return own, {}
        if own is not None or self.parallel:
            why = "in this model's parallel blocks the MLP reads the output of the attention's input norm"
            return None, {"mlp_in": f"equals attn_in: {why} (store attn_in)",
                          "mlp_norm_scale": f"equals norm_scale: {why} (store norm_scale)"}
        if "resid_mid" in norms:
            return norms["resid_mid"], {"mlp_in": "equals resid_mid: in this Post-Norm model the MLP reads the "
                                                  "normalised resid_mid (store resid_mid)"}
        why = "the MLP reads resid_mid with no norm before it"
        return None, {"mlp_in": f"equals resid_mid: {why} (store resid_mid)",
                      "mlp_norm_scale": f"does not exist: {why}"}

    def _install_mlp_input_hooks(self) -> None:
        if self.mlp_norm is None:
            return
        for layer in range(self.n_layers):
            module = self._norm_module(self.mlp_norm, layer)
            module.register_forward_hook(self._record_hook("mlp_in", layer, read=self._token_shaped(first_output)))

    def _token_shaped(self, read):
        """read, with a (batch * pos, d_model) value (OPT flattens the stream around its MLP) put back
        to (batch, pos, d_model)."""
        def shaped(args, *rest):
            value = read(args, *rest)
            return value.view(active(self).held["resid_pre"].shape) if value.dim() == 2 else value

        return shaped

    def _stop_hook(self, layer: int):
        """A hook on block `layer` that ends the forward pass when the trace asks to stop after it."""
        def hook(module, args, output):
            trace = active(self)
            if trace is not None and trace.stop_after == layer:
                raise StopForward

        return hook

    def _scale_source(self, norm: Norm, layer: int) -> ScaleSource:
        module = self._norm_module(norm, layer)
        layout = "projection" if norm.scope == "projection" else "heads_first" if norm.heads_first else "token"
        heads = None if norm.site not in ("q", "k") else self.model_heads()[0 if norm.site == "q" else 1]
        return ScaleSource(module, self._norm_kind(module), norm_eps(module), layout, heads)

    def model_heads(self) -> tuple[int, int]:
        """(n_heads, n_kv_heads)."""
        raise NotImplementedError

    def _install_scale_hooks(self) -> None:
        for site, per_layer in self.scale_sources.items():
            for layer, source in per_layer.items():
                if source.module is None:
                    pre_hook(self.blocks[layer], self._record_hook(site, layer, read=_no_norm))
                else:
                    source.module.register_forward_hook(self._record_hook(site, layer, read=self._factor_reader(source)))

    def _factor_reader(self, source: ScaleSource):
        """read(args, output) of a norm module's forward hook: its factor, (batch, pos[, head])."""
        def read(args, output):
            factor = norm_factor(args[0], source.kind, source.eps)
            if source.layout == "heads_first":
                factor = factor.transpose(1, 2)
            elif source.layout == "projection":
                factor = factor.unsqueeze(-1).expand(*factor.shape, source.heads)
            elif factor.dim() == 1:  # OPT flattens the stream to (batch * pos, d_model) before its MLP's norm
                factor = factor.view(active(self).held["resid_pre"].shape[:-1])
            if source.heads is not None and (factor.dim() != 3 or factor.shape[2] != source.heads):
                raise UnsupportedModelError(
                    f"the {self.family} model's norm {type(source.module).__name__} reads an input of shape "
                    f"{tuple(args[0].shape)}, not the {source.heads} heads its description in extract/families.py "
                    "(module orthosphere.extract.families) lays out (Norm.heads_first): correct the description"
                )
            return factor

        return read

    def _record_hook(self, site: str, layer: int, *, read):
        """A hook recording `site` of `layer` from what read returns: read(args, kwargs) for a
        pre-hook (registered with kwargs), read(args, output) for a forward hook."""
        def hook(module, args, *rest):
            trace = active(self)
            if trace is not None and trace.recording is not None and trace.recording.wants(site, layer):
                trace.recording.record(site, layer, read(args, *rest))

        return hook


def relative_bias_matrix(relative: dict, layer: int, n_pos: int) -> torch.Tensor:
    """(head, query, key) float32 relative position bias of `layer` over n_pos positions, from the
    description's table by key offset (clipped to its ends)."""
    table = torch.tensor(relative["tables"][relative["table_of_layer"][layer]], dtype=torch.float32)
    positions = torch.arange(n_pos)
    offsets = (positions[None, :] - positions[:, None]).clamp(-relative["max_offset"], relative["max_offset"])
    return table[:, offsets + relative["max_offset"]]


def first_input(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def first_output(args, output):
    """A module's main output: the first of a tuple (or of a list: OpenAI GPT's blocks return one)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _no_norm(args, kwargs):
    """NaN per token: the factor of a norm that is not there (layer 0 of a Post-Norm model without an embedding norm)."""
    x = first_input(args, kwargs)
    return torch.full(x.shape[:-1], float("nan"), device=x.device)


def pre_hook(module: nn.Module, hook) -> None:
    module.register_forward_pre_hook(hook, with_kwargs=True)


def dtype_name(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")

