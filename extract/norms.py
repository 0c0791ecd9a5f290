"""The model description's norms: one entry per norm (where it acts, its module, type, scope, eps,
gain) and the summary (norm_placement, norm_type, qk_norm, v_norm, parallel); see store/SCHEMA.md."""
from __future__ import annotations

import torch
from torch import nn

from orthosphere.store.schema import NORM_SITES

from .families import OUTSIDE_BLOCKS, UnsupportedModelError

MAIN_NORM_SITES = ("attn_input", "resid_mid", "attn_output")
"""Norms acting on the residual stream around attention; the first present names the norm type."""


def norm_type(module: nn.Module) -> str:
    """ "rms" or "layer" from the module's class (every family's norms are one of the two)."""
    modules = [module, *module.modules()]
    if any("rms" in type(m).__name__.lower() for m in modules):
        return "rms"
    if any(isinstance(m, nn.LayerNorm) or "layernorm" in type(m).__name__.lower() for m in modules):
        return "layer"
    raise UnsupportedModelError(f"norm module {type(module).__name__} is neither a LayerNorm nor an RMSNorm")


def norm_leaf(module: nn.Module) -> nn.Module:
    """The module that holds the norm's gain or eps (StableLM's per-head norm wraps one LayerNorm per head)."""
    return next((m for m in module.modules() if hasattr(m, "weight") or hasattr(m, "eps")), module)


def norm_eps(module: nn.Module) -> float:
    """The norm's epsilon (1e-5, PyTorch's LayerNorm default, where the module names none)."""
    leaf = norm_leaf(module)
    return float(next((getattr(leaf, name) for name in ("eps", "variance_epsilon") if hasattr(leaf, name)), 1e-5))


def norm_factor(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """The factor s a norm of `kind` ("layer" or "rms") multiplies its centred input by, over the last dim:
    1 / sqrt(mean((x - m)^2) + eps), m the mean (LayerNorm) or 0 (RMSNorm); float32 at least."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if kind == "layer":
        x = x - x.mean(dim=-1, keepdim=True)
    return torch.rsqrt(x.pow(2).mean(dim=-1) + eps)


def described_norms(model: nn.Module, block: nn.Module, norms, gain: str, kind: str | None = None) -> dict:
    """``norms``: one entry per norm: site, module path (``{layer}`` for the block's index), type
    (`kind`, else from the module's class), scope, eps, how its gain enters ("weight", "1 + weight"
    or "none"), whether it has a bias and, only where true, that it acts after rotary embedding (q and k norms);
    ``norm_type`` and ``norm_eps`` of the main norm (the first
    of MAIN_NORM_SITES present, else the QK-norm), None without norms."""
    entries = []
    block_path = next(name for name, module in model.named_modules() if module is block)
    for norm in norms:
        inside = norm.site not in OUTSIDE_BLOCKS
        module = (block if inside else model).get_submodule(norm.module)
        leaf = norm_leaf(module)
        eps = norm_eps(module)
        has_gain = isinstance(getattr(leaf, "weight", None), torch.Tensor)
        prefix = block_path.rsplit(".", 1)[0] + ".{layer}." if inside else ""
        entries.append({
            "site": norm.site, "module": prefix + norm.module, "type": kind or norm_type(module), "scope": norm.scope,
            "eps": float(eps), "gain": gain if has_gain else "none",
            "bias": isinstance(getattr(leaf, "bias", None), torch.Tensor),
        } | ({"after_rotary": True} if norm.after_rotary else {}))
    ranked = sorted(entries, key=lambda entry: (MAIN_NORM_SITES + ("q",) + NORM_SITES).index(entry["site"]))
    main = ranked[0] if ranked else {"type": None, "eps": None}
    return {"norms": entries, "norm_type": main["type"], "norm_eps": main["eps"]}


def norm_summary(norms, placement: str | None = None, parallel: bool = False) -> dict:
    """norm_placement (pre, post, sandwich, output, none; the arithmetic family's own names kept),
    norm_type of the main norm, qk_norm and v_norm (their scope, or None) and parallel."""
    sites = {norm.site: norm for norm in norms}
    if placement is None:
        if "resid_mid" in sites:
            placement = "post"
        elif "attn_input" in sites:
            placement = "sandwich" if "attn_output" in sites else "pre"
        else:
            placement = "output" if "attn_output" in sites else "none"
    return {
        "norm_placement": placement,
        "qk_norm": sites["q"].scope if "q" in sites else None,
        "v_norm": sites["v"].scope if "v" in sites else None,
        "parallel": parallel,
    }
