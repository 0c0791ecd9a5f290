"""Model families as data: where a transformers family keeps what extraction reads.

One ``Family`` per transformers ``model_type``: the language-model class to load (and, for
encoders, the class without a task head, loaded when a checkpoint has none), where the blocks,
the attention module, the q/k/v and output projections and the norms are (paths of submodules,
relative to a block unless said otherwise), where ``resid_mid`` is read, and what the score adds
beyond q . k (a per-layer scale, a sliding window, soft-capping, ALiBi, T5's learned relative
position bias, GPT-OSS's sink logits). The generic machinery of ``adapters/`` reads nothing else, so a new family is a
few lines here.

A field may be a function of the model's transformers config where a family's layout depends
on it (OPT's ``do_layer_norm_before``, GPT-NeoX's ``use_parallel_residual``).

Routes (how q, k, v are reached as they enter the score):

- ``interface``: the family calls transformers' attention interface, which hands the
  registered function "orthosphere" q, k, v after projection, rotary embedding and any
  QK-norm (``interface.py``);
- ``projection``: the family computes attention itself without the interface (Bloom, Falcon, MPNet),
  so q, k, v are the projections' outputs (a fused one split by its layout), with rotary embedding
  applied by the family's own function to the cos and sin the attention module receives (Falcon),
  and the pattern is the attention module's second output (eager attention; asked for where the
  module returns it only on request, MPNet).

Families whose score no term describes are refused with the reason (``REFUSED``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from orthosphere.errors import ConfigError, UnsupportedModelError  # noqa: F401
from orthosphere.store.schema import NORM_SCOPES, NORM_SITES

ROUTES = ("interface", "projection")
LAYOUTS = ("separate", "concat", "grouped", "codegen")
OUTSIDE_BLOCKS = ("embedding", "final")
"""Norm sites whose module path is relative to the model, not to a block."""
CODEGEN_SHARDS = 4
"""The model-parallel shards CodeGen's fused projection interleaves (its attention's ``mp_num``)."""


@dataclass(frozen=True)
class Norm:
    """One norm of a block (or of the model, for OUTSIDE_BLOCKS sites): where it acts (NORM_SITES:
    the embeddings, what the attention reads, q, k, v, the attention output before the residual add,
    the residual after it (Post-Norm), likewise around the MLP, before the unembedding), its module,
    and whether it normalises the d_model-wide stream, each head or the whole projection."""

    site: str
    module: str
    scope: str = "d_model"
    heads_first: bool = False
    """A per-head norm whose input is (batch, head, pos, d_head) (Gemma 3, Phi, StableLM), not (batch, pos, head, d_head)."""
    after_rotary: bool = False
    """A q or k norm applied after rotary embedding (HunYuan), not before."""

    def __post_init__(self):
        if self.site not in NORM_SITES or self.scope not in NORM_SCOPES:
            raise ValueError(f"norm {self}: expected a site of {list(NORM_SITES)} and a scope of {list(NORM_SCOPES)}")


@dataclass(frozen=True)
class Projections:
    """Submodules of a block holding W_Q, W_K, W_V (one fused module when the layout is not
    "separate") and W_O. ``layout``: ``separate`` (one module each), ``concat`` (one module,
    [all q | all k | all v] along its output) or ``grouped`` (one module, [q of the group's
    heads | k | v] for each key/value group in turn: [q_h | k_h | v_h] per head when every head
    has its own key and value, [all q | k | v] with one key/value head) or ``codegen`` (one module in
    CODEGEN_SHARDS model-parallel shards, each [q | v | k] of its consecutive heads: CodeGen's)."""

    q: str
    k: str
    v: str
    o: str
    layout: str = "separate"


@dataclass(frozen=True)
class Family:
    """What extraction needs to know about a transformers family (see the module docstring)."""

    model_type: str
    lm_class: str | None
    """The class with the language-model head, whose arg-max is ``pred`` (None: read without a head)."""
    blocks: str
    attention: str
    projections: Projections
    mid: str | Callable
    """Where resid_mid is read: "input:PATH" or "output:PATH" of a submodule of the block, or
    "parallel" (attention and MLP both read resid_pre: resid_mid = resid_pre + attention output)."""
    norms: tuple[Norm, ...] | Callable
    causal: bool = True
    positions: str = "rotary"
    route: str = "interface"
    output_multiplier: str | Callable | None = None
    """Config attribute that scales the attention output before the residual add (Granite), or a function
    of the config giving that factor (ESM C's 1 / sqrt(n_layers / 36))."""
    query_scale_of: Callable | None = None
    """(attention module) -> the factor the module multiplies q by right after the projection, where it
    does so and scores with 1.0 (OPT: its ``scaling``; ESM: 1/sqrt(d_head), before rotary embedding): the
    stored q and w_q carry the scale, the score's scale is 1."""
    norm_gain: str = "weight"
    """How the norms' gain enters: "weight", or "1 + weight" (Gemma)."""
    alibi_slopes: Callable | None = None
    """(config, n_heads) -> per-head ALiBi slopes added as slope * key position to the score."""
    rotary: str | None = None
    """On the projection route: the family's function applying rotary embedding, (q, k, cos, sin) ->
    (q, k) on (batch, head, pos, d_head), with cos and sin the attention's position_embeddings."""
    refuse: Callable | None = None
    """(config) -> a message naming what is unsupported, or None."""
    d_ff_keys: tuple[str, ...] = ("intermediate_size",)
    activation_keys: tuple[str, ...] = ("hidden_act",)
    extra_config: tuple[str, ...] = ()
    """Config attributes copied into the model description when present (this and the two above: names, or
    dotted paths through sub-configs, DBRX's "attn_config.clip_qkv", described under their last part)."""
    base_class: str | None = None
    """The class without a task head (encoders), loaded when a checkpoint lacks the head's tensors
    (its stores hold no ``pred``); paths then lose the head class's base-model prefix."""
    relative_bias: Callable | None = None
    """(model, attention modules) -> the learned relative position bias of each layer's score (T5, MPNet),
    in the form of ``_t5_relative_bias``'s."""
    scale_of: Callable | None = None
    """(attention module) -> its scale, where the module's ``scaling`` (``inv_norm_factor`` on the
    projection route: Bloom's, Falcon's) does not hold it."""
    sinks: str | None = None
    """The attention module's parameter of learned per-head sink logits that the softmax's denominator
    adds (GPT-OSS's ``sinks``), recorded as the score term ``sink_logits``."""
    sliding_window: Callable | None = None
    """(attention module) -> the window its layer attends with, where the module's ``sliding_window``
    attribute is not it (EXAONE 4 keeps the config's window on its global layers too)."""
    window_in_mask: bool = False
    """The sliding window is applied by the model's mask and not passed to the attention call (Phi-MoE):
    it is described from the config, and the call's window (None) is not checked against it."""
    norm_kind: str | None = None
    """The norms' type where their class does not say it ("rms": T5's LayerNorm without centring)."""
    mlp: str | None = None
    """The block's submodule whose output is the MLP's contribution to the residual (before any
    ``mlp_output`` norm), for the site ``mlp_out``; None: the block's ``mlp`` where it has one."""

    def __post_init__(self):
        if self.route not in ROUTES or self.projections.layout not in LAYOUTS:
            raise ValueError(f"family {self.model_type}: route {self.route!r} and layout {self.projections.layout!r}, "
                             f"expected one of {list(ROUTES)} and of {list(LAYOUTS)}")

    def resolved(self, config) -> Family:
        """This family with every field that depends on the config evaluated for `config`."""
        mid = self.mid(config) if callable(self.mid) else self.mid
        norms = self.norms(config) if callable(self.norms) else self.norms
        return replace(self, mid=mid, norms=tuple(norms))

    def without_head(self, prefix: str) -> Family:
        """This family read from its base model: every path outside the blocks without `prefix`."""
        def strip(path: str) -> str:
            return path.removeprefix(f"{prefix}.")

        norms = tuple(replace(n, module=strip(n.module)) if n.site in OUTSIDE_BLOCKS else n for n in self.norms)
        return replace(self, blocks=strip(self.blocks), norms=norms)

    @property
    def parallel(self) -> bool:
        return self.mid == "parallel"


def split_heads_rows(layout: str, n_heads: int, n_kv_heads: int, d_head: int) -> dict[str, np.ndarray]:
    """Rows of the projection output(s) holding each head's q, k, v: (head, d_head) index arrays.
    For ``separate`` the rows index each projection's own output."""
    within = np.arange(d_head)
    if layout == "separate":
        return {name: np.arange(heads)[:, None] * d_head + within
                for name, heads in (("q", n_heads), ("k", n_kv_heads), ("v", n_kv_heads))}
    if layout == "concat":
        q_size, kv_size = n_heads * d_head, n_kv_heads * d_head
        return {"q": np.arange(n_heads)[:, None] * d_head + within,
                "k": q_size + np.arange(n_kv_heads)[:, None] * d_head + within,
                "v": q_size + kv_size + np.arange(n_kv_heads)[:, None] * d_head + within}
    if layout == "grouped":
        group = n_heads // n_kv_heads
        start = np.arange(n_kv_heads)[:, None] * (group + 2) * d_head  # each group's first row
        heads = np.arange(n_heads)
        return {"q": start[heads // group] + (heads % group)[:, None] * d_head + within,
                "k": start + group * d_head + within, "v": start + (group + 1) * d_head + within}
    if layout == "codegen":
        per_shard = n_heads // CODEGEN_SHARDS
        heads = np.arange(n_heads)
        start = (heads // per_shard)[:, None] * 3 * per_shard * d_head + (heads % per_shard)[:, None] * d_head + within
        return {"q": start, "v": start + per_shard * d_head, "k": start + 2 * per_shard * d_head}
    raise ValueError(f"unknown projection layout {layout!r}: expected one of {list(LAYOUTS)}")


# --- the families ------------------------------------------------------------------------------

LLAMA_NORMS = (Norm("attn_input", "input_layernorm"), Norm("mlp_input", "post_attention_layernorm"),
               Norm("final", "model.norm"))
LLAMA_PROJECTIONS = Projections("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
SANDWICH_NORMS = (Norm("attn_input", "input_layernorm"), Norm("attn_output", "post_attention_layernorm"),
                  Norm("mlp_input", "pre_feedforward_layernorm"), Norm("mlp_output", "post_feedforward_layernorm"),
                  Norm("final", "model.norm"))
BERT_PROJECTIONS = Projections("attention.self.query", "attention.self.key", "attention.self.value",
                               "attention.output.dense")
def _bert_norms(prefix: str) -> tuple[Norm, ...]:
    return (Norm("embedding", f"{prefix}.embeddings.LayerNorm"), Norm("resid_mid", "attention.output.LayerNorm"),
            Norm("resid_post", "output.LayerNorm"))


OUTPUT_NORMS_QK_PROJECTION = (Norm("attn_output", "post_attention_layernorm"),
                              Norm("mlp_output", "post_feedforward_layernorm"), Norm("q", "self_attn.q_norm", "projection"),
                              Norm("k", "self_attn.k_norm", "projection"), Norm("final", "model.norm"))
"""OLMo 2's norms: on the attention and MLP outputs, and on the whole q and k projections."""
COHERE_NORMS = (Norm("attn_input", "input_layernorm"), Norm("mlp_input", "input_layernorm"), Norm("final", "model.norm"))


def _bert_like(model_type: str, lm_class: str, prefix: str, base_class: str, name: str, norms=None) -> Family:
    """A BERT-shaped encoder: learned positions, bidirectional; Post-Norm LayerNorms unless `norms` says
    otherwise (``_pre_norm``)."""
    return Family(model_type, lm_class, f"{prefix}.encoder.layer", "attention.self", BERT_PROJECTIONS,
                  mid="output:attention", norms=norms or _bert_norms(prefix), causal=False, positions="learned",
                  mlp="output.dense", refuse=_refuse_decoder_encoder(name), base_class=base_class)


def _pre_norm(attn_norm: str, mlp_norm: str, final: str, embedding: str | None = None) -> tuple[Norm, ...]:
    """A BERT-shaped encoder's Pre-Norm LayerNorms (RoBERTa-PreLayerNorm, XLM-RoBERTa-XL, ESM): one before
    the self-attention and one before the MLP inside the block, a final one after the last block."""
    return ((Norm("embedding", embedding),) if embedding else ()) + (
        Norm("attn_input", attn_norm), Norm("mlp_input", mlp_norm), Norm("final", final))


def _refuse_esm(config):
    if config.position_embedding_type != "rotary":
        return (f"ESM with position_embedding_type={config.position_embedding_type!r} (ESM-1b's learned positions): "
                "expected ESM-2's 'rotary'")
    if getattr(config, "emb_layer_norm_before", False):
        return "ESM with emb_layer_norm_before=True (ESM-1b's embedding norm): expected ESM-2's False"
    return _refuse_decoder_encoder("ESM")(config)


def _electra_norms(config):
    """BERT's norms; without the embedding norm where a projection to hidden_size follows it (the
    first layer then reads the projection, no norm's output)."""
    norms = _bert_norms("electra")
    return norms if config.embedding_size == config.hidden_size else norms[1:]


def _refuse_if(flag: str, reason: str) -> Callable:
    """A family's refusal: `reason` where the config sets `flag`, else None."""
    def refuse(config):
        return reason if getattr(config, flag, False) else None

    return refuse


def _refuse_cross_attention(name: str) -> Callable:
    return _refuse_if("add_cross_attention", f"{name} with cross-attention (add_cross_attention=True): expected a "
                                             f"decoder-only {name}")


def _bert_scale(attention) -> float:
    """1/sqrt(d_head) of a BERT-shaped attention: the score's scale where it computes its own softmax (projection
    route: MPNet, Megatron-BERT, RemBERT), ESM's factor on q."""
    return attention.attention_head_size**-0.5


def _rotary_post_norm(model_type: str, lm_class: str, prefix: str, base_class: str) -> Family:
    """A Post-Norm encoder with rotary positions and Llama's projection names (Nomic BERT, GTE, Jina v3): its
    ``post_attention_layernorm`` normalises the residual after the attention's add, ``post_mlp_layernorm``
    after the MLP's."""
    return Family(model_type, lm_class, f"{prefix}.layers", "self_attn", LLAMA_PROJECTIONS,
                  mid="output:post_attention_layernorm", causal=False, base_class=base_class,
                  norms=(Norm("embedding", f"{prefix}.embeddings.LayerNorm"), Norm("resid_mid", "post_attention_layernorm"),
                         Norm("resid_post", "post_mlp_layernorm")))


def _llama_like(model_type: str, lm_class: str, **options) -> Family:
    """A Llama-shaped family: model.layers[l].self_attn with q/k/v/o_proj, Pre-Norm."""
    options = {"projections": LLAMA_PROJECTIONS, "mid": "input:post_attention_layernorm", "norms": LLAMA_NORMS,
               **options}
    return Family(model_type, lm_class, "model.layers", "self_attn", **options)


def _with_qk_norm(norms, q: str, k: str, scope: str, heads_first: bool = False, after_rotary: bool = False):
    return tuple(norms) + (Norm("q", q, scope, heads_first, after_rotary), Norm("k", k, scope, heads_first, after_rotary))


APERTUS_NORMS = _with_qk_norm((Norm("attn_input", "attention_layernorm"), Norm("mlp_input", "feedforward_layernorm"),
                               Norm("final", "model.norm")), "self_attn.q_norm", "self_attn.k_norm", "head", heads_first=True)
"""Apertus's (1 and 1.5): Pre-Norm under other names, QK-norm per head."""
HUNYUAN_NORMS = _with_qk_norm(LLAMA_NORMS, "self_attn.query_layernorm", "self_attn.key_layernorm", "head", heads_first=True,
                              after_rotary=True)
"""HunYuan's (dense and MoE): Llama's, and a QK-norm per head after rotary embedding."""


def _refuse_decoder_encoder(name: str) -> Callable:
    return _refuse_if("is_decoder", f"{name} configured as a decoder (is_decoder=True): expected the bidirectional encoder")


def _refuse_bidirectional(name: str) -> Callable:
    return _refuse_if("use_bidirectional_attention", f"{name} with use_bidirectional_attention=True (its sliding windows "
                                                     "are two-sided): expected the causal model")


def _refuse_bloom(config):
    if config.apply_residual_connection_post_layernorm:
        return ("Bloom with apply_residual_connection_post_layernorm=True adds the attention output to the "
                "normalised stream, so the residual stream is not one stream: expected the default False")
    return None


def _bloom_slopes(config, n_heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return [float(s) for s in _get_alibi_slopes(n_heads, device="cpu")]


def _mpt_slopes(config, n_heads):
    """MPT's ALiBi slopes (``build_mpt_alibi_tensor``: its bias is slope * (key position - last position),
    which the softmax sees as slope * key position)."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias = build_mpt_alibi_tensor(n_heads, 2, config.attn_config.alibi_bias_max)  # (head, 1, 2): slope * [-1, 0]
    return [float(-value) for value in bias[:, 0, 0]]


def _refuse_mpt(config):
    if config.attn_config.clip_qkv:
        return (f"MPT with clip_qkv={config.attn_config.clip_qkv} clamps q, k and v after its fused projection, "
                "whose output is what orthosphere reads on this family's route: expected clip_qkv=None")
    return None


def _refuse_codegen(config):
    if config.n_head % CODEGEN_SHARDS:
        return (f"CodeGen with {config.n_head} heads: its fused projection splits into {CODEGEN_SHARDS} shards of whole "
                f"heads, so expected a multiple of {CODEGEN_SHARDS}")
    return None


def _refuse_falcon(config):
    if config.alibi:
        return ("Falcon with alibi=True computes its ALiBi bias in bfloat16 (slope times position rounded to 8 "
                "bits), which per-head slopes cannot reproduce exactly")
    if config.new_decoder_architecture and not config.parallel_attn:
        return "Falcon with new_decoder_architecture=True and parallel_attn=False: transformers cannot run it either"
    return None


def _t5_relative_bias(model, attentions) -> dict:
    """Each layer's learned relative position bias as a table by key offset j - i from -D to D (D
    past the last distance bucket, so the table's ends hold for every farther key): computed with
    the module's own ``compute_bias``; a layer without its own bias reuses the last one (T5 passes
    layer 0's on). Refused when the bias is not constant beyond D."""
    max_offset = int(attentions[0].relative_attention_max_distance) + 1
    tables, table_of_layer = [], []
    for attention in attentions:
        if attention.has_relative_attention_bias:
            tables.append(_bias_by_offset(lambda n, module=attention: module.compute_bias(n, n), type(attention).__name__,
                                          max_offset))
        if not tables:
            raise UnsupportedModelError("T5-style model whose first layer has no relative position bias")
        table_of_layer.append(len(tables) - 1)
    return {"max_offset": max_offset, "tables": [table.tolist() for table in tables], "table_of_layer": table_of_layer}


MPNET_MAX_DISTANCE = 128
"""The distance past which MPNet's relative position buckets (``relative_position_bucket``'s default) stop changing."""


def _mpnet_relative_bias(model, attentions) -> dict:
    """MPNet's relative position bias, computed once by its encoder and shared by every layer, as
    one table by key offset (see ``_t5_relative_bias``)."""
    import torch

    encoder = model.base_model.encoder
    max_offset = MPNET_MAX_DISTANCE + 1

    def bias(n_pos):
        return encoder.compute_position_bias(torch.zeros(1, n_pos, 1, device=encoder.relative_attention_bias.weight.device))

    table = _bias_by_offset(bias, "MPNet's encoder", max_offset)
    return {"max_offset": max_offset, "tables": [table.tolist()], "table_of_layer": [0] * len(attentions)}


def _bias_by_offset(bias_of, name: str, max_offset: int) -> np.ndarray:
    """(head, 2 * max_offset + 1) float32 bias of key offsets -max_offset..max_offset, from
    ``bias_of(n_pos)`` (1, head, n_pos, n_pos), checked to stay at its ends for offsets up to twice as far."""
    import torch

    far = 2 * max_offset
    with torch.no_grad():
        row = bias_of(2 * far + 1)[0, :, far, :].float().cpu().numpy()
    inner = row[:, far - max_offset: far + max_offset + 1]
    if not (np.all(row[:, : far - max_offset] == inner[:, :1]) and np.all(row[:, far + max_offset:] == inner[:, -1:])):
        raise UnsupportedModelError(f"relative position bias of {name} changes beyond key offset {max_offset}: "
                                    "expected buckets that are constant past their largest distance")
    return inner


def _refuse_t5_decoder(config):
    if getattr(config, "is_decoder", False):
        return "T5-style model configured as a decoder (is_decoder=True): only the bidirectional encoder is read"
    return None


def _t5_encoder(model_type: str, encoder_class: str) -> Family:
    """T5, mT5 and UMT5 read as their encoder (``*EncoderModel``, no language-model head: the
    decoder is not read): RMS norms before attention and MLP, scale 1, relative position bias."""
    return Family(model_type, None, "encoder.block", "layer.0.SelfAttention",
                  Projections("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
                              "layer.0.SelfAttention.o"),
                  mid="output:layer.0", causal=False, positions="relative", base_class=encoder_class,
                  mlp="layer.1.DenseReluDense",
                  norms=(Norm("attn_input", "layer.0.layer_norm"), Norm("mlp_input", "layer.1.layer_norm"),
                         Norm("final", "encoder.final_layer_norm")),
                  norm_kind="rms", relative_bias=_t5_relative_bias, refuse=_refuse_t5_decoder,
                  d_ff_keys=("d_ff",), activation_keys=("dense_act_fn", "feed_forward_proj"))


def _falcon_mid(config):
    return "parallel" if config.new_decoder_architecture or config.parallel_attn else "input:post_attention_layernorm"


def _falcon_norms(config):
    final = Norm("final", "transformer.ln_f")
    if config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2:
        return Norm("attn_input", "ln_attn"), Norm("mlp_input", "ln_mlp"), final
    if _falcon_mid(config) == "parallel":
        return Norm("attn_input", "input_layernorm"), Norm("mlp_input", "input_layernorm"), final
    return Norm("attn_input", "input_layernorm"), Norm("mlp_input", "post_attention_layernorm"), final


def _opt_norms(config):
    if config.do_layer_norm_before:
        norms = (Norm("attn_input", "self_attn_layer_norm"), Norm("mlp_input", "final_layer_norm"))
        final = () if getattr(config, "_remove_final_layer_norm", False) else (Norm("final", "model.decoder.final_layer_norm"),)
        return norms + final
    return Norm("resid_mid", "self_attn_layer_norm"), Norm("resid_post", "final_layer_norm")


def _opt_mid(config):
    return "input:final_layer_norm" if config.do_layer_norm_before else "output:self_attn_layer_norm"


def _parallel_residual_mid(config):
    """GPT-NeoX and StableLM: parallel blocks when use_parallel_residual."""
    return "parallel" if config.use_parallel_residual else "input:post_attention_layernorm"


def _stablelm_norms(config):
    norms = [Norm("attn_input", "input_layernorm"), Norm("final", "model.norm")]
    if not config.use_parallel_residual:
        norms.append(Norm("mlp_input", "post_attention_layernorm"))
    if config.qk_layernorm:
        norms += [Norm("q", "self_attn.q_layernorm", "head", heads_first=True),
                  Norm("k", "self_attn.k_layernorm", "head", heads_first=True)]
    return norms


def _phi_norms(config):
    norms = [Norm("attn_input", "input_layernorm"), Norm("mlp_input", "input_layernorm"),
             Norm("final", "model.final_layernorm")]
    if config.qk_layernorm:
        norms += [Norm("q", "self_attn.q_layernorm", "head", heads_first=True),
                  Norm("k", "self_attn.k_layernorm", "head", heads_first=True)]
    return norms


def _glm4_moe_norms(config):
    if config.use_qk_norm:
        return _with_qk_norm(LLAMA_NORMS, "self_attn.q_norm", "self_attn.k_norm", "head", heads_first=True)
    return LLAMA_NORMS


def _persimmon_norms(config):
    norms = (Norm("attn_input", "input_layernorm"), Norm("mlp_input", "post_attention_layernorm"),
             Norm("final", "model.final_layernorm"))
    return _with_qk_norm(norms, "self_attn.q_layernorm", "self_attn.k_layernorm", "head") if config.qk_layernorm else norms


FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    Family("gpt2", "GPT2LMHeadModel", "transformer.h", "attn",
           Projections("attn.c_attn", "attn.c_attn", "attn.c_attn", "attn.c_proj", layout="concat"),
           mid="input:ln_2", positions="learned", refuse=_refuse_cross_attention("GPT-2"),
           norms=(Norm("attn_input", "ln_1"), Norm("mlp_input", "ln_2"), Norm("final", "transformer.ln_f")),
           d_ff_keys=("n_inner",), activation_keys=("activation_function",),
           extra_config=("scale_attn_by_inverse_layer_idx",)),
    _llama_like("llama", "LlamaForCausalLM"),
    _llama_like("mistral", "MistralForCausalLM"),
    _llama_like("mixtral", "MixtralForCausalLM"),
    _llama_like("qwen2", "Qwen2ForCausalLM"),
    _llama_like("qwen3", "Qwen3ForCausalLM", norms=_with_qk_norm(LLAMA_NORMS, "self_attn.q_norm", "self_attn.k_norm", "head")),
    _llama_like("olmo", "OlmoForCausalLM", extra_config=("clip_qkv",)),
    _llama_like("olmo2", "Olmo2ForCausalLM", mid="input:mlp", norms=OUTPUT_NORMS_QK_PROJECTION),
    _llama_like("gemma", "GemmaForCausalLM", norm_gain="1 + weight", refuse=_refuse_bidirectional("Gemma")),
    _llama_like("gemma2", "Gemma2ForCausalLM", mid="input:pre_feedforward_layernorm", norms=SANDWICH_NORMS,
                norm_gain="1 + weight", refuse=_refuse_bidirectional("Gemma 2")),
    _llama_like("gemma3_text", "Gemma3ForCausalLM", mid="input:pre_feedforward_layernorm",
                norms=_with_qk_norm(SANDWICH_NORMS, "self_attn.q_norm", "self_attn.k_norm", "head", heads_first=True),
                norm_gain="1 + weight", refuse=_refuse_bidirectional("Gemma 3")),
    _llama_like("granite", "GraniteForCausalLM", output_multiplier="residual_multiplier",
                extra_config=("attention_multiplier", "residual_multiplier")),
    _llama_like("starcoder2", "Starcoder2ForCausalLM"),
    _llama_like("stablelm", "StableLmForCausalLM", mid=_parallel_residual_mid, norms=_stablelm_norms),
    Family("phi", "PhiForCausalLM", "model.layers", "self_attn",
           Projections("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense"),
           mid="parallel", norms=_phi_norms),
    _llama_like("phi3", "Phi3ForCausalLM",
                projections=Projections("self_attn.qkv_proj", "self_attn.qkv_proj", "self_attn.qkv_proj",
                                        "self_attn.o_proj", layout="concat")),
    Family("gpt_neox", "GPTNeoXForCausalLM", "gpt_neox.layers", "attention",
           Projections("attention.query_key_value", "attention.query_key_value", "attention.query_key_value",
                       "attention.dense", layout="grouped"),
           mid=_parallel_residual_mid, norms=(Norm("attn_input", "input_layernorm"), Norm("mlp_input", "post_attention_layernorm"),
                                 Norm("final", "gpt_neox.final_layer_norm"))),
    Family("gptj", "GPTJForCausalLM", "transformer.h", "attn",
           Projections("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"),
           mid="parallel", norms=(Norm("attn_input", "ln_1"), Norm("mlp_input", "ln_1"), Norm("final", "transformer.ln_f")),
           d_ff_keys=("n_inner",), activation_keys=("activation_function",)),
    Family("opt", "OPTForCausalLM", "model.decoder.layers", "self_attn",
           Projections("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"),
           mid=_opt_mid, norms=_opt_norms, positions="learned", query_scale_of=lambda attention: attention.scaling,
           d_ff_keys=("ffn_dim",), mlp="fc2",
           activation_keys=("activation_function",)),
    _bert_like("bert", "BertForMaskedLM", "bert", "BertModel", "BERT"),
    _bert_like("roberta", "RobertaForMaskedLM", "roberta", "RobertaModel", "RoBERTa"),
    Family("distilbert", "DistilBertForMaskedLM", "distilbert.transformer.layer", "attention",
           Projections("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin"),
           mid="output:sa_layer_norm", causal=False, positions="learned", mlp="ffn",
           norms=(Norm("embedding", "distilbert.embeddings.LayerNorm"), Norm("resid_mid", "sa_layer_norm"),
                  Norm("resid_post", "output_layer_norm")),
           d_ff_keys=("hidden_dim",), activation_keys=("activation",), base_class="DistilBertModel"),
    Family("falcon", "FalconForCausalLM", "transformer.h", "self_attention",
           Projections("self_attention.query_key_value", "self_attention.query_key_value",
                       "self_attention.query_key_value", "self_attention.dense", layout="grouped"),
           mid=_falcon_mid, norms=_falcon_norms, route="projection", refuse=_refuse_falcon, d_ff_keys=("ffn_hidden_size",),
           rotary="transformers.models.falcon.modeling_falcon.apply_rotary_pos_emb",
           extra_config=("new_decoder_architecture", "multi_query", "parallel_attn")),
    Family("bloom", "BloomForCausalLM", "transformer.h", "self_attention",
           Projections("self_attention.query_key_value", "self_attention.query_key_value",
                       "self_attention.query_key_value", "self_attention.dense", layout="grouped"),
           mid="output:self_attention", route="projection", positions="alibi", alibi_slopes=_bloom_slopes,
           refuse=_refuse_bloom, d_ff_keys=(), mlp="mlp.dense_4h_to_h",
           norms=(Norm("embedding", "transformer.word_embeddings_layernorm"), Norm("attn_input", "input_layernorm"),
                  Norm("mlp_input", "post_attention_layernorm"), Norm("final", "transformer.ln_f"))),
    _llama_like("qwen2_moe", "Qwen2MoeForCausalLM"),
    _llama_like("qwen3_moe", "Qwen3MoeForCausalLM",
                norms=_with_qk_norm(LLAMA_NORMS, "self_attn.q_norm", "self_attn.k_norm", "head")),
    _llama_like("olmoe", "OlmoeForCausalLM", extra_config=("clip_qkv",),
                norms=_with_qk_norm(LLAMA_NORMS, "self_attn.q_norm", "self_attn.k_norm", "projection")),
    _llama_like("granitemoe", "GraniteMoeForCausalLM", output_multiplier="residual_multiplier", mlp="block_sparse_moe",
                extra_config=("attention_multiplier", "residual_multiplier")),
    _llama_like("helium", "HeliumForCausalLM"),
    _llama_like("arcee", "ArceeForCausalLM"),
    _llama_like("ministral", "MinistralForCausalLM"),
    _llama_like("seed_oss", "SeedOssForCausalLM"),
    _llama_like("smollm3", "SmolLM3ForCausalLM", extra_config=("no_rope_layers",)),
    _llama_like("olmo3", "Olmo3ForCausalLM", mid="input:mlp", norms=OUTPUT_NORMS_QK_PROJECTION),
    _llama_like("exaone4", "Exaone4ForCausalLM", mid="input:mlp",
                norms=(Norm("attn_output", "post_attention_layernorm"), Norm("mlp_output", "post_feedforward_layernorm"),
                       Norm("q", "self_attn.q_norm", "head", heads_first=True),
                       Norm("k", "self_attn.k_norm", "head", heads_first=True), Norm("final", "model.norm")),
                sliding_window=lambda attention: attention.sliding_window if attention.is_sliding else None),
    _llama_like("apertus", "ApertusForCausalLM", mid="input:feedforward_layernorm", norms=APERTUS_NORMS),
    _llama_like("glm4", "Glm4ForCausalLM", mid="input:post_attention_layernorm",
                norms=(Norm("attn_input", "input_layernorm"), Norm("attn_output", "post_self_attn_layernorm"),
                       Norm("mlp_input", "post_attention_layernorm"), Norm("mlp_output", "post_mlp_layernorm"),
                       Norm("final", "model.norm"))),
    _llama_like("nemotron", "NemotronForCausalLM", norm_gain="1 + weight"),
    _llama_like("cohere", "CohereForCausalLM", mid="parallel", norms=COHERE_NORMS, extra_config=("logit_scale",)),
    _llama_like("cohere2", "Cohere2ForCausalLM", mid="parallel", norms=COHERE_NORMS, extra_config=("logit_scale",)),
    _bert_like("xlm-roberta", "XLMRobertaForMaskedLM", "roberta", "XLMRobertaModel", "XLM-RoBERTa"),
    _bert_like("camembert", "CamembertForMaskedLM", "roberta", "CamembertModel", "CamemBERT"),
    replace(_bert_like("electra", "ElectraForMaskedLM", "electra", "ElectraModel", "ELECTRA"), norms=_electra_norms),
    _llama_like("gpt_oss", "GptOssForCausalLM", sinks="sinks"),
    Family("mpnet", "MPNetForMaskedLM", "mpnet.encoder.layer", "attention.attn",
           Projections("attention.attn.q", "attention.attn.k", "attention.attn.v", "attention.attn.o"),
           mid="output:attention", causal=False, positions="relative", route="projection", base_class="MPNetModel",
           mlp="output.dense",
           norms=(Norm("embedding", "mpnet.embeddings.LayerNorm"), Norm("resid_mid", "attention.LayerNorm"),
                  Norm("resid_post", "output.LayerNorm")),
           relative_bias=_mpnet_relative_bias, scale_of=_bert_scale),
    Family("modernbert", "ModernBertForMaskedLM", "model.layers", "attn",
           Projections("attn.Wqkv", "attn.Wqkv", "attn.Wqkv", "attn.Wo", layout="concat"),
           mid="input:mlp_norm", causal=False, base_class="ModernBertModel",
           norms=(Norm("embedding", "model.embeddings.norm"), Norm("attn_input", "attn_norm"),
                  Norm("mlp_input", "mlp_norm"), Norm("final", "model.final_norm")),
           scale_of=lambda attention: attention.head_dim**-0.5,
           extra_config=("global_attn_every_n_layers", "local_attention")),
    _llama_like("glm", "GlmForCausalLM"),
    _llama_like("ernie4_5", "Ernie4_5ForCausalLM"),
    _llama_like("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    _llama_like("jais2", "Jais2ForCausalLM"),
    _llama_like("vaultgemma", "VaultGemmaForCausalLM", mid="input:pre_feedforward_layernorm", norm_gain="1 + weight",
                norms=(Norm("attn_input", "input_layernorm"), Norm("mlp_input", "pre_feedforward_layernorm"),
                       Norm("final", "model.norm"))),
    _llama_like("dots1", "Dots1ForCausalLM", norms=_with_qk_norm(LLAMA_NORMS, "self_attn.q_norm", "self_attn.k_norm", "head")),
    _llama_like("glm4_moe", "Glm4MoeForCausalLM", norms=_glm4_moe_norms),
    _llama_like("flex_olmo", "FlexOlmoForCausalLM", mid="input:mlp", norms=OUTPUT_NORMS_QK_PROJECTION),
    _bert_like("ernie", "ErnieForMaskedLM", "ernie", "ErnieModel", "ERNIE"),
    _bert_like("data2vec-text", "Data2VecTextForMaskedLM", "data2vec_text", "Data2VecTextModel", "Data2Vec-Text"),
    _bert_like("roberta-prelayernorm", "RobertaPreLayerNormForMaskedLM", "roberta_prelayernorm", "RobertaPreLayerNormModel",
               "RoBERTa-PreLayerNorm", _pre_norm("attention.LayerNorm", "intermediate.LayerNorm", "roberta_prelayernorm.LayerNorm",
                                                 embedding="roberta_prelayernorm.embeddings.LayerNorm")),
    _bert_like("xlm-roberta-xl", "XLMRobertaXLForMaskedLM", "roberta", "XLMRobertaXLModel", "XLM-RoBERTa-XL",
               _pre_norm("attention.self_attn_layer_norm", "LayerNorm", "roberta.encoder.LayerNorm")),
    Family("gpt_bigcode", "GPTBigCodeForCausalLM", "transformer.h", "attn",
           Projections("attn.c_attn", "attn.c_attn", "attn.c_attn", "attn.c_proj", layout="grouped"),
           mid="input:ln_2", positions="learned", refuse=_refuse_cross_attention("GPTBigCode"),
           norms=(Norm("attn_input", "ln_1"), Norm("mlp_input", "ln_2"), Norm("final", "transformer.ln_f")),
           d_ff_keys=("n_inner",), activation_keys=("activation_function",), extra_config=("multi_query",)),
    _llama_like("ministral3", "Ministral3ForCausalLM"),
    replace(_bert_like("esm", "EsmForMaskedLM", "esm", "EsmModel", "ESM",
                       _pre_norm("attention.LayerNorm", "LayerNorm", "esm.encoder.emb_layer_norm_after")),
            positions="rotary", refuse=_refuse_esm, query_scale_of=_bert_scale),
    _llama_like("solar_open", "SolarOpenForCausalLM"),
    _llama_like("mellum", "MellumForCausalLM", norms=_with_qk_norm(LLAMA_NORMS, "self_attn.q_norm", "self_attn.k_norm", "head")),
    _llama_like("cohere2_moe", "Cohere2MoeForCausalLM", mid="parallel", norms=COHERE_NORMS, extra_config=("logit_scale",)),
    _llama_like("persimmon", "PersimmonForCausalLM",
                projections=Projections("self_attn.query_key_value", "self_attn.query_key_value", "self_attn.query_key_value",
                                        "self_attn.dense", layout="grouped"),
                norms=_persimmon_norms),
    Family("biogpt", "BioGptForCausalLM", "biogpt.layers", "self_attn",
           Projections("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"),
           mid="input:final_layer_norm", positions="learned", mlp="fc2",
           norms=(Norm("attn_input", "self_attn_layer_norm"), Norm("mlp_input", "final_layer_norm"),
                  Norm("final", "biogpt.layer_norm"))),
    Family("gpt_neo", "GPTNeoForCausalLM", "transformer.h", "attn.attention",
           Projections("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj", "attn.attention.out_proj"),
           mid="input:ln_2", positions="learned", route="projection", scale_of=lambda attention: 1.0,
           sliding_window=lambda attention: attention.config.window_size if attention.attention_type == "local" else None,
           norms=(Norm("attn_input", "ln_1"), Norm("mlp_input", "ln_2"), Norm("final", "transformer.ln_f")),
           activation_keys=("activation_function",), extra_config=("attention_types", "window_size")),
    _llama_like("phimoe", "PhimoeForCausalLM", window_in_mask=True,
                sliding_window=lambda attention: attention.config.sliding_window),
    _llama_like("cwm", "CwmForCausalLM"),
    Family("mpt", "MptForCausalLM", "transformer.blocks", "attn",
           Projections("attn.Wqkv", "attn.Wqkv", "attn.Wqkv", "attn.out_proj", layout="concat"),
           mid="input:norm_2", route="projection", positions="alibi", alibi_slopes=_mpt_slopes, refuse=_refuse_mpt,
           scale_of=lambda attention: attention.softmax_scale, mlp="ffn.down_proj", d_ff_keys=("expansion_ratio",),
           activation_keys=(),
           norms=(Norm("attn_input", "norm_1"), Norm("mlp_input", "norm_2"), Norm("final", "transformer.norm_f"))),
    Family("codegen", "CodeGenForCausalLM", "transformer.h", "attn",
           Projections("attn.qkv_proj", "attn.qkv_proj", "attn.qkv_proj", "attn.out_proj", layout="codegen"),
           mid="parallel", norms=(Norm("attn_input", "ln_1"), Norm("mlp_input", "ln_1"), Norm("final", "transformer.ln_f")),
           refuse=_refuse_codegen, d_ff_keys=("n_inner",), activation_keys=("activation_function",)),
    Family("modernbert-decoder", "ModernBertDecoderForCausalLM", "model.layers", "attn",
           Projections("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.Wo"), mid="input:mlp_norm",
           norms=(Norm("embedding", "model.embeddings.norm"), Norm("attn_input", "attn_norm"),
                  Norm("mlp_input", "mlp_norm"), Norm("final", "model.final_norm")),
           activation_keys=("hidden_activation",), extra_config=("local_attention", "layer_types")),
    _llama_like("minimax_m2", "MiniMaxM2ForCausalLM",
                norms=_with_qk_norm(LLAMA_NORMS, "self_attn.q_norm", "self_attn.k_norm", "projection")),
    _llama_like("internlm3", "LlamaForCausalLM"),
    _llama_like("exaone", "LlamaForCausalLM"),
    Family("dbrx", "DbrxForCausalLM", "transformer.blocks", "norm_attn_norm.attn",
           Projections("norm_attn_norm.attn.Wqkv", "norm_attn_norm.attn.Wqkv", "norm_attn_norm.attn.Wqkv",
                       "norm_attn_norm.attn.out_proj", layout="concat"),
           mid="input:norm_attn_norm.norm_2", mlp="ffn", d_ff_keys=("ffn_config.ffn_hidden_size",),
           activation_keys=("ffn_config.ffn_act_fn.name",), extra_config=("attn_config.clip_qkv",),
           norms=(Norm("attn_input", "norm_attn_norm.norm_1"), Norm("mlp_input", "norm_attn_norm.norm_2"),
                  Norm("final", "transformer.norm_f"))),
    replace(_bert_like("megatron-bert", "MegatronBertForMaskedLM", "bert", "MegatronBertModel", "Megatron-BERT",
                       _pre_norm("attention.ln", "ln", "bert.encoder.ln")),
            route="projection", scale_of=_bert_scale),
    replace(_bert_like("rembert", "RemBertForMaskedLM", "rembert", "RemBertModel", "RemBERT",
                       _bert_norms("rembert")[1:]),  # its embedding norm is followed by a projection to hidden_size
            route="projection", scale_of=_bert_scale),
    _rotary_post_norm("nomic_bert", "NomicBertForMaskedLM", "nomic_bert", "NomicBertModel"),
    _rotary_post_norm("gte", "GteForMaskedLM", "gte", "GteModel"),
    _rotary_post_norm("jina_embeddings_v3", "JinaEmbeddingsV3ForMaskedLM", "roberta", "JinaEmbeddingsV3Model"),
    _llama_like("eurobert", "EuroBertForMaskedLM", causal=False, base_class="EuroBertModel"),
    _llama_like("ultrabert", "UltrabertForMaskedLM", causal=False, base_class="UltrabertModel",
                extra_config=("layer_types", "sliding_window")),
    Family("bert-generation", None, "encoder.layer", "attention.self", BERT_PROJECTIONS, mid="output:attention",
           norms=(Norm("embedding", "embeddings.LayerNorm"), Norm("resid_mid", "attention.output.LayerNorm"),
                  Norm("resid_post", "output.LayerNorm")),
           causal=False, positions="learned", mlp="output.dense", base_class="BertGenerationEncoder",
           refuse=_refuse_decoder_encoder("BertGeneration")),
    Family("esmc", "EsmcForMaskedLM", "esmc.layers", "self_attn", LLAMA_PROJECTIONS, mid="input:post_attention_layernorm",
           causal=False, base_class="EsmcModel", output_multiplier=lambda config: (config.num_hidden_layers / 36) ** -0.5,
           norms=_with_qk_norm((Norm("attn_input", "input_layernorm"), Norm("mlp_input", "post_attention_layernorm"),
                                Norm("final", "esmc.norm")), "self_attn.q_norm", "self_attn.k_norm", "projection")),
    Family("xglm", "XGLMForCausalLM", "model.layers", "self_attn",
           Projections("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"),
           mid="input:final_layer_norm", positions="sinusoidal", route="projection", mlp="fc2",
           scale_of=lambda attention: attention.scaling, refuse=_refuse_cross_attention("XGLM"),
           norms=(Norm("attn_input", "self_attn_layer_norm"), Norm("mlp_input", "final_layer_norm"),
                  Norm("final", "model.layer_norm")),
           d_ff_keys=("ffn_dim",), activation_keys=("activation_function",), extra_config=("scale_embedding",)),
    Family("openai-gpt", "OpenAIGPTLMHeadModel", "transformer.h", "attn",
           Projections("attn.c_attn", "attn.c_attn", "attn.c_attn", "attn.c_proj", layout="concat"),
           mid="output:ln_1", positions="learned", route="projection",
           scale_of=lambda attention: (attention.split_size // attention.n_head) ** -0.5,
           norms=(Norm("resid_mid", "ln_1"), Norm("resid_post", "ln_2")), d_ff_keys=(), activation_keys=("afn",)),
    Family("ctrl", "CTRLLMHeadModel", "transformer.h", "multi_head_attention",
           Projections("multi_head_attention.Wq", "multi_head_attention.Wk", "multi_head_attention.Wv",
                       "multi_head_attention.dense"),
           mid="input:layernorm2", positions="sinusoidal", mlp="ffn", d_ff_keys=("dff",), activation_keys=(),
           norms=(Norm("attn_input", "layernorm1"), Norm("mlp_input", "layernorm2"), Norm("final", "transformer.layernorm"))),
    _llama_like("nanochat", "NanoChatForCausalLM",  # one gain-free norm module on the embeddings and before the head
                norms=_with_qk_norm((Norm("embedding", "model.norm"),) + LLAMA_NORMS, "self_attn.q_norm", "self_attn.k_norm",
                                    "head", heads_first=True, after_rotary=True),
                extra_config=("final_logit_softcapping",)),
    _llama_like("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", norms=HUNYUAN_NORMS),
    _llama_like("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", norms=HUNYUAN_NORMS),
    _llama_like("iquestcoder", "LlamaForCausalLM"),
    _llama_like("apertus1p5_text", "Apertus1p5TextForCausalLM", mid="input:feedforward_layernorm", norms=APERTUS_NORMS),
    _t5_encoder("t5", "T5EncoderModel"),
    _t5_encoder("mt5", "MT5EncoderModel"),
    _t5_encoder("umt5", "UMT5EncoderModel"),
)}
"""transformers model_type -> its family. (The project's own arithmetic transformers have their
own hook points and adapter, in adapters/arithmetic.py.)"""


def _multimodal(text: Family, model_type: str, lm_class: str, language_model: str = "model.language_model") -> Family:
    """A multimodal model's family, read on text alone (its vision tower never runs): its language model is
    `text`'s family (whose blocks and norms outside them lie under "model."), under `language_model`. Its
    config checks are the text family's, on the text config, which must be of that family."""
    def moved(path: str) -> str:
        return f"{language_model}.{path.removeprefix('model.')}"

    def refuse(text_config):
        if text_config.model_type != text.model_type:
            return (f"{model_type} whose language model is {text_config.model_type!r}: orthosphere reads {model_type} "
                    f"with a {text.model_type!r} language model")
        return text.refuse(text_config) if text.refuse is not None else None

    norms = tuple(replace(norm, module=moved(norm.module)) if norm.site in OUTSIDE_BLOCKS else norm for norm in text.norms)
    return replace(text, model_type=model_type, lm_class=lm_class, blocks=moved(text.blocks), norms=norms, base_class=None,
                   refuse=refuse)


FAMILIES.update({family.model_type: family for family in (
    _multimodal(FAMILIES["gemma3_text"], "gemma3", "Gemma3ForConditionalGeneration"),
    _multimodal(FAMILIES["mistral"], "mistral3", "Mistral3ForConditionalGeneration"),
    _multimodal(FAMILIES["llama"], "llava", "LlavaForConditionalGeneration"),
    _multimodal(_llama_like("qwen2_vl_text", None), "qwen2_vl", "Qwen2VLForConditionalGeneration"),
    _multimodal(_llama_like("qwen2_5_vl_text", None), "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    _multimodal(replace(FAMILIES["qwen3"], model_type="qwen3_vl_text"), "qwen3_vl", "Qwen3VLForConditionalGeneration"),
)})
"""Multimodal models read on text alone (Gemma 3 from 4B up, Mistral Small 3.1, LLaVA, Qwen2-VL, Qwen2.5-VL,
Qwen3-VL: their multimodal rotary embeddings turn text alone by each token's position, and Qwen3-VL adds its
visual features to early layers only where there is an image)."""

REFUSED: dict[str, str] = {
    "deberta": "DeBERTa's disentangled attention adds content-to-position and position-to-content terms (q . r_k "
               "and r_q . k, with learned relative position embeddings r) to q . k, which no score term describes",
    "deberta-v2": "DeBERTa-v2/v3's disentangled attention adds content-to-position and position-to-content terms "
                  "(q . r_k and r_q . k, with learned relative position embeddings r) to q . k, which no score term "
                  "describes",
    "jetmoe": "JetMoE routes each token to a few of its attention experts (mixture of attention heads), so a head's "
              "q comes from a per-token choice of projections that one weight map per head cannot describe",
    "longformer": "Longformer's attention mixes a sliding window with global tokens, which have their own q, k "
                  "and v projections",
    "big_bird": "BigBird's block-sparse attention attends to random blocks of keys",
    "reformer": "Reformer's LSH attention attends within hash buckets and shares its q and k projection",
    "xlnet": "XLNet's two-stream attention adds relative position and segment terms to q . k",
    "diffllama": "DiffLlama's differential attention subtracts a second softmax over q . k from the first, which the "
                 "score terms of one softmax cannot describe",
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite", "youtu"),
                    "multi-head latent attention computes each head's key from a normed low-rank latent plus a rotary "
                    "part shared by every head, and splits q . k into a rotary and a non-rotary part (its values may "
                    "have another width, v_head_dim against qk_head_dim): no per-head weight map of the residual stream "
                    "gives q and k, and the store's one d_head per head cannot hold them"),
    "longcat_flash": "LongCat-Flash uses multi-head latent attention, and each of its layers holds two attention "
                     "sublayers and a shortcut mixture of experts added at the block's end",
    "doge": "Doge's dynamic mask adds to each score a bias computed from the key's value and keeps only the top keys "
            "beyond a window, which no score term describes",
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"),
                    "its layers are recurrent or state-space layers with no attention to store"),
    **dict.fromkeys(("jamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe",
                     "qwen3_next", "recurrent_gemma", "olmo_hybrid", "kimi_linear", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                     "qwen3_5_moe_text", "minimax"),
                    "it mixes softmax attention layers with state-space, linear-attention, recurrent or convolution "
                    "layers, whose contributions to the residual stream no stored q . k describes"),
    "albert": "ALBERT runs one shared layer module at every depth, so what a module's hooks see cannot be told "
              "apart by layer",
    "mobilebert": "MobileBERT's q and k read a bottleneck projection of the residual stream while v reads the stream "
                  "itself, its NoNorm is an affine map and not a norm, and each block stacks several MLPs",
    "convbert": "ConvBERT concatenates span-based dynamic convolution heads with its softmax heads before the output "
                "projection",
    "squeezebert": "SqueezeBERT computes q, k, v and its MLP with grouped convolutions over channels-first tensors, "
                   "which no per-head weight map of the residual stream's layout holds",
    "ibert": "I-BERT's quantised attention uses an integer approximation of the softmax and requantises q and k",
    "xmod": "X-MOD follows each MLP with a language adapter chosen per token by its language id",
    **dict.fromkeys(("xlm", "flaubert"),
                    "XLM and FlauBERT have no block module: their layers are lists of attention, norm and MLP modules "
                    "whose residual adds happen inline in the model's forward"),
    "funnel": "Funnel Transformer pools the sequence between blocks and adds Transformer-XL relative position and "
              "token-type terms to q . k",
    **dict.fromkeys(("gemma3n", "gemma3n_text"),
                    "Gemma 3n's AltUp keeps several residual streams that learned steps predict and correct, beside a "
                    "low-rank LAuReL branch and per-layer embeddings: there is no one residual stream to store"),
    **dict.fromkeys(("gemma4", "gemma4_text"),
                    "Gemma 4's global layers have another head width (global_head_dim) and number of key-value heads "
                    "than its sliding layers, may take v from the key projection (attention_k_eq_v) or reuse an earlier "
                    "layer's keys and values (num_kv_shared_layers), and add per-layer embeddings to the residual "
                    "stream: the store's one d_head and n_kv_heads per model cannot hold it"),
    **dict.fromkeys(("llama4", "llama4_text"),
                    "Llama 4's rotary layers attend within chunks of attention_chunk_size positions, which no score term "
                    "describes, and its NoPE layers scale each query by a temperature of its position, which no "
                    "weight map holds"),
}
"""model_types whose attention is not a softmax over q . k plus the score terms the store describes, and why."""


ALIASES = {"gpt-sw3": "gpt2"}
"""model_types that are another family's model under another name (GPT-SW3: GPT-2's classes with its own tokenizer)."""


def family_for(model_type) -> Family:
    """The family of a transformers model_type; an unknown one, or one of REFUSED, is an UnsupportedModelError."""
    model_type = ALIASES.get(model_type, model_type)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in REFUSED:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported: {REFUSED[model_type]}; orthosphere "
                                    "reads only models whose attention it can reproduce from the stored q and k")
    raise UnsupportedModelError(unsupported(f"model_type {model_type!r}"))


def unsupported(what: str) -> str:
    """The message for a model outside every family."""
    return (f"{what} is not supported: expected one of the families {supported_families()}; "
            "a new transformers family is a few lines in extract/families.py (module orthosphere.extract.families)")


def supported_families() -> list[str]:
    return ["arithmetic", *FAMILIES]


def check_supported(family: Family, config) -> None:
    """Raise UnsupportedModelError when this configuration of the family cannot be made exact."""
    reason = family.refuse(config) if family.refuse is not None else None
    if reason:
        raise UnsupportedModelError(f"{reason}; orthosphere refuses configurations whose attention it cannot reproduce")

