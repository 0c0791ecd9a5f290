"""Where a store's model puts its norms, read from the model description (store/SCHEMA.md).

``model_norms`` lists the norms (site, type, scope, ...); stores written before the description
listed them hold only ``norm_placement`` and ``norm_type``, from which the arithmetic family's
placements (and plain Pre- and Post-Norm models) are derived. ``normalised_by`` says which norm
produced a stored site, so that an analysis can tell a norm the model imposes (a Pre-Norm's
output, a QK-normed query) from one it learned.
"""
from __future__ import annotations

PLACEMENT_NORMS = {
    "pre": ("attn_input", "mlp_input", "final"),
    "post": ("resid_mid", "resid_post"),
    "qkv": ("q", "k", "v", "mlp_input", "final"),
    "none": ("mlp_input", "final"),
}
"""The norms of a model that only states its placement (stores without a `norms` entry)."""
HEAD_SITES = ("q", "k", "v")
SCOPE_WORDS = {"d_model": "over d_model", "head": "per head", "projection": "over the whole projection"}


def model_norms(model: dict) -> list[dict]:
    """The model's norms, one dict each with at least site, type and scope."""
    if "norms" in model:
        return [dict(norm) for norm in model["norms"]]
    kind = model.get("norm_type")
    return [{"site": site, "type": kind, "scope": "head" if site in HEAD_SITES else "d_model"}
            for site in PLACEMENT_NORMS.get(model.get("norm_placement"), ())]


def normalised_by(model: dict, site: str) -> str:
    """The norm whose output the stored `site` is, in words ("" when none): attn_in is the Pre-Norm's
    output, q, k, v the QK/V-norm's (rotary embedding keeps norms), resid_mid and resid_post the
    Post-Norm's, resid_pre the previous block's Post-Norm output (layer 0: the embedding norm's)."""
    norms = {norm["site"]: norm for norm in model_norms(model)}
    source = {"attn_in": "attn_input", "q": "q", "k": "k", "v": "v", "resid_mid": "resid_mid",
              "resid_post": "resid_post", "resid_pre": "resid_post"}.get(site)
    if source not in norms:
        return ""
    words = f"{norms[source].get('type')} norm {SCOPE_WORDS.get(norms[source].get('scope'), '')}".strip()
    if site != "resid_pre":
        return words
    layer_zero = "the embedding norm" if "embedding" in norms else "no norm"
    return f"{words} of the previous block (layer 0: {layer_zero})"


def describe_norms(model: dict) -> str:
    """One line for people: the placement, QK/V-norms, parallel blocks and every norm's site."""
    norms = model_norms(model)
    parts = [f"{model.get('norm_placement', '?')}-norm"]
    parts += [f"{site.upper()}-norm {SCOPE_WORDS.get(model[key], model[key])}"
              for site, key in (("qk", "qk_norm"), ("v", "v_norm")) if model.get(key)]
    if model.get("parallel"):
        parts.append("parallel attention and MLP")
    sites = ", ".join(f"{norm['site']} ({norm.get('type')})" for norm in norms)
    return "; ".join(parts) + (f"; norms at {sites}" if sites else "; no norms")
