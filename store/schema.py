"""Schema version 1: which arrays a store holds, their dims and dtypes (see SCHEMA.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .bfloat16 import is_bfloat16
from .errors import StoreError

SCHEMA_VERSION = 1

ACTIVATION_DTYPES = ("float16", "bfloat16", "float32")
"""float16 holds |x| <= 65504 only; bfloat16 (Zarr extension data type, see bfloat16.py) has
float32's range with 8 bits of precision: the bits of a model run in bfloat16."""

# Model description keys that fix the sizes of the arrays.
MODEL_SIZE_KEYS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_head")

# What the model description (root attribute `model`) holds beyond the sizes; SCHEMA.md documents each.
MODEL_KEYS = MODEL_SIZE_KEYS + (
    "family", "architecture", "source", "format", "weights_sha256", "dtype", "d_ff", "vocab_size", "activation",
    "n_parameters", "positions", "attn_scale", "causal", "score", "norm_placement", "norm_type", "norm_eps",
    "qk_norm", "v_norm", "parallel", "norms", "rope_parameters", "output_multiplier", "max_len", "lm_head",
)
# model["score"]: per layer, what turns q . k into the model's score (lists of n_layers entries).
SCORE_KEYS = ("scale", "sliding_window", "softcap", "alibi_slopes")
OPTIONAL_SCORE_KEYS = ("relative_bias", "sink_logits")
"""Score terms only some families have: T5's learned relative position bias (RELATIVE_BIAS_KEYS), GPT-OSS's sink logits."""
RELATIVE_BIAS_KEYS = ("max_offset", "tables", "table_of_layer")
# model["norms"]: one entry per norm of the model.
NORM_KEYS = ("site", "module", "type", "scope", "eps", "gain", "bias", "after_rotary")
NORM_SITES = ("embedding", "attn_input", "q", "k", "v", "attn_output", "resid_mid", "mlp_input", "mlp_output",
              "resid_post", "final")
NORM_SCOPES = ("d_model", "head", "projection")
NORM_PLACEMENTS = ("pre", "post", "sandwich", "output", "none", "qkv")


@dataclass(frozen=True)
class Variable:
    """One array of the schema: its dims and dtype ("activation" means the store's dtype)."""

    dims: tuple[str, ...]
    dtype: str


# Always present, one value per token.
TOKEN_VARIABLES = {
    "tokens": Variable(("sample", "pos"), "int32"),
    "valid": Variable(("sample", "pos"), "bool"),
    "pred": Variable(("sample", "pos"), "int32"),
    "target": Variable(("sample", "pos"), "int32"),
    "scored": Variable(("sample", "pos"), "bool"),
}

# Selectable activation sites.
SITE_VARIABLES = {
    "resid_pre": Variable(("sample", "layer", "pos", "d_model"), "activation"),
    "resid_mid": Variable(("sample", "layer", "pos", "d_model"), "activation"),
    "resid_post": Variable(("sample", "layer", "pos", "d_model"), "activation"),
    "attn_in": Variable(("sample", "layer", "pos", "d_model"), "activation"),
    "norm_scale": Variable(("sample", "layer", "pos"), "activation"),
    "q": Variable(("sample", "layer", "pos", "head", "d_head"), "activation"),
    "k": Variable(("sample", "layer", "pos", "kv_head", "d_head"), "activation"),
    "v": Variable(("sample", "layer", "pos", "kv_head", "d_head"), "activation"),
    "q_norm_scale": Variable(("sample", "layer", "pos", "head"), "activation"),
    "k_norm_scale": Variable(("sample", "layer", "pos", "kv_head"), "activation"),
    "pattern": Variable(("sample", "layer", "head", "qpos", "kpos"), "activation"),
    "z": Variable(("sample", "layer", "pos", "head", "d_head"), "activation"),
    "attn_out": Variable(("sample", "layer", "pos", "d_model"), "activation"),
    "mlp_in": Variable(("sample", "layer", "pos", "d_model"), "activation"),
    "mlp_norm_scale": Variable(("sample", "layer", "pos"), "activation"),
    "mlp_out": Variable(("sample", "layer", "pos", "d_model"), "activation"),
}
SITES = tuple(SITE_VARIABLES)
OPT_IN_SITES = ("pattern", "z", "attn_out", "mlp_in", "mlp_norm_scale", "mlp_out")
"""Sites stored only when asked for: the attention pattern, and the block's outputs and MLP input."""
DEFAULT_SITES = tuple(site for site in SITES if site not in OPT_IN_SITES)
"""An extraction's default: every site but OPT_IN_SITES, less those its model has no norm for."""
NORM_SCALE_SITES = ("norm_scale", "q_norm_scale", "k_norm_scale", "mlp_norm_scale")
"""The norm factors of attn_in, q, k and mlp_in (see SCHEMA.md): only a model with that norm provides one."""

# Per site, the TransformerLens hook holding the same tensor, and the one of a model with rotary
# positions where that differs ("none": TransformerLens has no equivalent); SCHEMA.md's table says
# how each relates. Each site's array carries its hook as the attribute `transformer_lens`.
TRANSFORMER_LENS = {
    "resid_pre": ("blocks.{layer}.hook_resid_pre", None),
    "resid_mid": ("blocks.{layer}.hook_resid_mid", None),
    "resid_post": ("blocks.{layer}.hook_resid_post", None),
    "attn_in": ("blocks.{layer}.ln1.hook_normalized", None),
    "norm_scale": ("1 / blocks.{layer}.ln1.hook_scale", None),
    "q": ("blocks.{layer}.attn.hook_q", "blocks.{layer}.attn.hook_rot_q"),
    "k": ("blocks.{layer}.attn.hook_k", "blocks.{layer}.attn.hook_rot_k"),
    "v": ("blocks.{layer}.attn.hook_v", None),
    "q_norm_scale": ("none", None),
    "k_norm_scale": ("none", None),
    "pattern": ("blocks.{layer}.attn.hook_pattern", None),
    "z": ("blocks.{layer}.attn.hook_z", None),
    "attn_out": ("blocks.{layer}.hook_attn_out", None),
    "mlp_in": ("blocks.{layer}.ln2.hook_normalized", None),
    "mlp_norm_scale": ("1 / blocks.{layer}.ln2.hook_scale", None),
    "mlp_out": ("blocks.{layer}.hook_mlp_out", None),
}


def transformer_lens_hook(site: str, model: dict) -> str:
    """The TransformerLens hook of `site` for the described model ({layer} for the block index)."""
    plain, rotary = TRANSFORMER_LENS[site]
    return rotary if rotary and model.get("positions") == "rotary" else plain


# Per-layer attention maps, float32, written once per store (q_h = attn_in @ w_q[h] + b_q[h]).
WEIGHT_VARIABLES = {
    "w_q": Variable(("layer", "head", "d_model", "d_head"), "float32"),
    "w_k": Variable(("layer", "kv_head", "d_model", "d_head"), "float32"),
    "w_v": Variable(("layer", "kv_head", "d_model", "d_head"), "float32"),
    "w_o": Variable(("layer", "head", "d_head", "d_model"), "float32"),
    "b_q": Variable(("layer", "head", "d_head"), "float32"),
    "b_k": Variable(("layer", "kv_head", "d_head"), "float32"),
    "b_v": Variable(("layer", "kv_head", "d_head"), "float32"),
    "b_o": Variable(("layer", "d_model"), "float32"),
}

PER_SAMPLE_DIMS = ("sample", "pos")
# Dims with an integer coordinate array of their own.
DIM_NAMES = ("sample", "pos", "layer", "head", "kv_head")


def layer_indices(layers, error=StoreError) -> list[int]:
    """`layers` as a list of integers (a single index may stand alone); anything else is an `error`."""
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        layers = [layers]
    if isinstance(layers, str) or not hasattr(layers, "__iter__"):
        raise error(f"layers={layers!r}: expected a list of layer indices")
    bad = [layer for layer in layers if isinstance(layer, bool) or not isinstance(layer, (int, np.integer))]
    if bad:
        raise error(f"layers: {bad[0]!r} is not a layer index: expected integers")
    return [int(layer) for layer in layers]


def chosen_layers(layers, available, refusal, error=StoreError) -> list[int]:
    """Layer indices chosen from `available`, sorted and unique (every available one when None; a
    single index may stand alone); a value that is not an integer, or none, or one not available is
    an `error` whose message `refusal(missing)` gives (the one check of layers of every stage)."""
    if layers is None:
        return [int(layer) for layer in available]
    chosen, held = sorted(set(layer_indices(layers, error))), {int(layer) for layer in available}
    if not chosen:
        raise error(f"layers={list(layers)!r}: expected at least one layer index (or None for every layer)")
    missing = [layer for layer in chosen if layer not in held]
    if missing:
        raise error(refusal(missing))
    return chosen


def model_layers(layers, n_layers: int, error=StoreError) -> list[int]:
    """Layer indices of a model of n_layers, sorted and unique; each must exist in the model."""
    return chosen_layers(layers, range(n_layers), lambda outside: (
        f"layer(s) {outside} out of range: the model has {n_layers} layers, expected indices 0..{n_layers - 1}"), error)


def check_sites(sites) -> tuple[str, ...]:
    """The sites in schema order; an unknown name is an error that lists the known ones."""
    sites = tuple(sites)
    unknown = [s for s in sites if s not in SITE_VARIABLES]
    if unknown:
        raise StoreError(
            f"unknown site(s) {unknown}: expected any of {list(SITES)}; "
            f"pick sites from that list (the default is all but {list(OPT_IN_SITES)})"
        )
    if not sites:
        raise StoreError("no sites given: expected at least one of " f"{list(SITES)}")
    return tuple(s for s in SITES if s in sites)


def check_dtype(dtype) -> str:
    """The activation dtype's name: float16, bfloat16 or float32."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in ACTIVATION_DTYPES:
        raise StoreError(
            f"dtype {dtype!r} is not supported for activations: expected one of {list(ACTIVATION_DTYPES)}"
        )
    return name


def check_model(model: dict) -> dict:
    """The model description, checked for the size keys that the arrays need."""
    missing = [key for key in MODEL_SIZE_KEYS if key not in model]
    if missing:
        raise StoreError(
            f"model description lacks {missing}: expected integer entries {list(MODEL_SIZE_KEYS)}"
        )
    for key in MODEL_SIZE_KEYS:
        value = model[key]
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise StoreError(f"model description {key}={value!r}: expected a positive integer")
    if model["n_heads"] % model["n_kv_heads"]:
        raise StoreError(
            f"model description n_heads={model['n_heads']} is not a multiple of "
            f"n_kv_heads={model['n_kv_heads']}: grouped-query attention needs whole groups"
        )
    if "score" in model:
        check_score(model["score"], model["n_layers"], model["n_heads"])
    return dict(model)


def check_score(score, n_layers: int, n_heads: int) -> None:
    """The score terms: a dict of SCORE_KEYS, each a list of one entry per layer (alibi_slopes may be
    None, else per layer a list of one slope per head) and, optionally, relative_bias and sink_logits."""
    if not isinstance(score, dict) or not set(SCORE_KEYS) <= set(score) <= set(SCORE_KEYS + OPTIONAL_SCORE_KEYS):
        raise StoreError(f"model description score={score!r}: expected a dict with keys {list(SCORE_KEYS)} "
                         f"(and optionally {list(OPTIONAL_SCORE_KEYS)})")
    for key in SCORE_KEYS:
        terms = score[key]
        if key == "alibi_slopes" and terms is None:
            continue
        if not isinstance(terms, list) or len(terms) != n_layers:
            raise StoreError(f"model description score.{key}={terms!r}: expected a list of one entry per layer "
                             f"({n_layers})")
    if score["alibi_slopes"] is not None and any(len(slopes) != n_heads for slopes in score["alibi_slopes"]):
        raise StoreError(f"model description score.alibi_slopes: expected {n_heads} slopes (one per head) per layer")
    if score.get("relative_bias") is not None:
        check_relative_bias(score["relative_bias"], n_layers, n_heads)
    if score.get("sink_logits") is not None:
        check_sink_logits(score["sink_logits"], n_layers, n_heads)


def check_sink_logits(sinks, n_layers: int, n_heads: int) -> None:
    """score.sink_logits: per layer, one finite sink logit per head."""
    try:
        values = np.asarray(sinks, dtype=float)
    except (TypeError, ValueError):
        values = None
    if values is None or values.shape != (n_layers, n_heads) or not np.isfinite(values).all():
        raise StoreError(f"model description score.sink_logits={str(sinks)[:80]}: expected per layer ({n_layers}) "
                         f"one finite sink logit per head ({n_heads}), as store/SCHEMA.md describes (re-extract the store)")


def check_relative_bias(relative, n_layers: int, n_heads: int) -> None:
    """score.relative_bias: max_offset D, tables (each n_heads rows of 2D + 1 biases, by key offset
    -D..D) and, per layer, the index of its table."""
    problem = _relative_bias_problem(relative, n_layers, n_heads)
    if problem:
        raise StoreError(f"model description score.relative_bias: {problem}; expected a dict of "
                         f"{list(RELATIVE_BIAS_KEYS)} as store/SCHEMA.md describes (re-extract the store)")


def _relative_bias_problem(relative, n_layers: int, n_heads: int) -> str | None:
    if not isinstance(relative, dict) or sorted(relative) != sorted(RELATIVE_BIAS_KEYS):
        return f"{str(relative)[:80]} has other keys"
    reach = relative["max_offset"]
    if not isinstance(reach, int) or isinstance(reach, bool) or reach < 1:
        return f"max_offset={reach!r} is not a positive integer"
    try:
        tables = np.asarray(relative["tables"], dtype=float)
    except (TypeError, ValueError):
        return "tables is not an array of numbers"
    if tables.ndim != 3 or tables.shape[1:] != (n_heads, 2 * reach + 1):
        return (f"tables have shape {tables.shape}, expected (tables, {n_heads} heads, {2 * reach + 1} offsets "
                "= 2 max_offset + 1)")
    if not np.isfinite(tables).all():
        return "tables hold biases that are not finite"
    of_layer = relative["table_of_layer"]
    if (not isinstance(of_layer, list) or len(of_layer) != n_layers
            or not all(isinstance(i, int) and 0 <= i < len(tables) for i in of_layer)):
        return f"table_of_layer={of_layer!r} is not one index of the {len(tables)} table(s) per layer ({n_layers})"
    return None


def dim_sizes(model: dict, n_samples: int, n_pos: int, n_layers_stored: int) -> dict[str, int]:
    """The length of every dim of the schema for one store."""
    return {
        "sample": n_samples,
        "pos": n_pos,
        "qpos": n_pos,
        "kpos": n_pos,
        "layer": n_layers_stored,
        "head": model["n_heads"],
        "kv_head": model["n_kv_heads"],
        "d_model": model["d_model"],
        "d_head": model["d_head"],
    }


def variables_for(sites, with_weights: bool, pred: bool = True) -> dict[str, Variable]:
    """Every array that a store with these sites holds (labels aside): ``pred`` only where `pred`
    (``holds_pred``)."""
    variables = {name: var for name, var in TOKEN_VARIABLES.items() if pred or name != "pred"}
    variables.update({site: SITE_VARIABLES[site] for site in sites})
    if with_weights:
        variables.update(WEIGHT_VARIABLES)
    return variables


def holds_pred(attrs: dict) -> bool:
    """Whether a store holds ``pred``: its model has a language-model head (model description
    ``lm_head``) and its job kept the predictions (root attribute ``pred``; stores written before it
    existed kept them)."""
    return bool(attrs.get("pred", True)) and bool((attrs.get("model") or {}).get("lm_head", True))


def resolved_dtype(variable: Variable, activation_dtype: str) -> str:
    return activation_dtype if variable.dtype == "activation" else variable.dtype


def item_size(variable: Variable, activation_dtype: str) -> int:
    """Bytes a value of the variable takes (bfloat16's 2 without importing its numpy type)."""
    dtype = resolved_dtype(variable, activation_dtype)
    return 2 if is_bfloat16(dtype) else np.dtype(dtype).itemsize


def bytes_per_sample(variables: dict, sizes: dict, activation_dtype: str) -> int:
    """Bytes one sample takes in the per-sample variables (those whose first dim is sample)."""
    return sum(
        math.prod(sizes[d] for d in var.dims[1:]) * item_size(var, activation_dtype)
        for var in variables.values() if var.dims[0] == "sample"
    )


LABEL_DTYPES = ("str", "int16", "int32", "int64")


def label_missing_value(dtype: str):
    """The value a label holds where it does not apply: "" for strings, the type's minimum for
    integers (so -1 and every other small integer stay real values, e.g. a borrow of -1)."""
    return "" if dtype == "str" else int(np.iinfo(dtype).min)


def check_labels(labels: dict) -> dict[str, str]:
    """Label name -> storage dtype: "str" (variable-length) or int16/int32/int64 (missing value: see
    ``label_missing_value``)."""
    labels = dict(labels)
    for name, dtype in labels.items():
        if dtype not in LABEL_DTYPES:
            raise StoreError(
                f"label {name!r} has dtype {dtype!r}: expected one of {list(LABEL_DTYPES)}; "
                "encode other labels as integer codes"
            )
        if name in TOKEN_VARIABLES or name in SITE_VARIABLES or name in WEIGHT_VARIABLES:
            raise StoreError(f"label name {name!r} clashes with a variable of the schema; rename it")
    return labels
