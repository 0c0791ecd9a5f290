"""The arithmetic transformers: decoder-only, identical except where the norm sits.

Norm placements (per attention head; see the science notes):

- ``none``: q, k, v read the raw residual stream;
- ``pre``: q, k, v read N(residual) (Pre-Norm);
- ``qkv``: q, k, v read the raw residual; N acts per head on q, k and v after their
  projections (QKV-Norm);
- ``post``: the residual is normalised after each update (the original transformer).

The feed-forward block is Pre-Norm in every placement but ``post``, and every placement but
``post`` normalises the stream before the unembedding. N is LayerNorm or RMSNorm with a gain
and no bias, N(z) = sqrt(d) * gain * z / |z| (after removing the mean for LayerNorm).

Hook points (``HookPoint`` modules, used with ``register_forward_hook``; a hook that returns
a tensor replaces the value):

- ``blocks[l].hook_resid_pre`` / ``hook_resid_mid`` / ``hook_resid_post`` (batch, pos,
  d_model): the stream a block reads, the stream between attention and feed-forward (what
  the feed-forward residual adds to; after the norm in ``post``), the stream it writes;
- ``blocks[l].attn.hook_attn_in`` (batch, pos, d_model): what W_Q, W_K, W_V read;
- ``hook_q``, ``hook_k``, ``hook_v`` (batch, pos, head, d_head): as they enter the score
  and the weighted sum (after the per-head norm in ``qkv``);
- ``hook_pattern`` (batch, head, qpos, kpos): the softmax;
- ``hook_z`` (batch, pos, head, d_head): sum_t pattern_t v_t, before W_O.

Noise on messages: the message of token t in head h is m_t = W_O[h] v_t (the bias b_O is
added once per position, outside the sum), so scaling v_t of head h by (1 + kappa) at
``hook_v`` scales the message by exactly (1 + kappa). Norm noise on q and k goes through
``hook_q`` and ``hook_k``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from orthosphere.errors import ConfigError
from orthosphere.params import (
    NON_NEGATIVE_INTEGER,
    POSITIVE_INTEGER,
    POSITIVE_NUMBER,
    REQUIRED,
    Config,
    OneOf,
    parameter,
)

NORM_PLACEMENTS = ("none", "pre", "post", "qkv")
NORM_TYPES = ("layer", "rms")
POSITIONS = ("sinusoidal", "learned")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
METRICS_FILE = "metrics.json"


@dataclass(frozen=True)
class ModelConfig(Config):
    """Sizes and choices of an arithmetic transformer; checked on construction."""

    n_layers: int = parameter(REQUIRED, POSITIVE_INTEGER, help="blocks")
    d_model: int = parameter(REQUIRED, POSITIVE_INTEGER, help="width of the residual stream")
    n_heads: int = parameter(REQUIRED, POSITIVE_INTEGER, help="attention heads per block")
    d_ff: int = parameter(REQUIRED, POSITIVE_INTEGER, help="width of the feed-forward layer")
    norm_placement: str = parameter(REQUIRED, OneOf(NORM_PLACEMENTS), help="where the norm sits")
    norm_type: str = parameter("layer", OneOf(NORM_TYPES), help="LayerNorm or RMSNorm")
    d_head: int | None = parameter(None, POSITIVE_INTEGER, None, help="head width (None: d_model / n_heads)")
    vocab_size: int = parameter(17, POSITIVE_INTEGER, help="tokens")
    max_len: int = parameter(64, POSITIVE_INTEGER, help="longest sequence (learned positions)")
    positions: str = parameter("sinusoidal", OneOf(POSITIONS), help="position embedding")
    max_position_offset: int = parameter(64, NON_NEGATIVE_INTEGER, help="largest random offset of the positions")
    norm_eps: float = parameter(1e-5, POSITIVE_NUMBER, help="epsilon of the norms")

    def check(self) -> None:
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ConfigError(f"d_model = {self.d_model} is not divisible by n_heads = "
                                  f"{self.n_heads}; choose sizes with d_model = n_heads * d_head, "
                                  f"or set d_head (heads then span n_heads * d_head dimensions)")
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.positions == "learned" and self.max_position_offset:
            raise ConfigError("learned positions take no random offset; set "
                              "max_position_offset = 0 or use sinusoidal positions")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.d_head)


class HookPoint(nn.Identity):
    """A named site: register a forward hook here to read or replace the value."""


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dimension with a gain of ``shape`` and no bias."""

    def __init__(self, config: ModelConfig, shape: tuple[int, ...]):
        super().__init__()
        self.norm_type = config.norm_type
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_type == "layer":
            x = x - x.mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head attention with explicit scores, so every hook is exact."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.d_head = config.n_heads, config.d_head
        self.scale = config.attn_scale
        width = config.n_heads * config.d_head
        self.q_proj = nn.Linear(config.d_model, width)
        self.k_proj = nn.Linear(config.d_model, width)
        self.v_proj = nn.Linear(config.d_model, width)
        self.o_proj = nn.Linear(width, config.d_model)
        self.head_norms = None
        if config.norm_placement == "qkv":
            shape = (config.n_heads, config.d_head)
            self.head_norms = nn.ModuleDict({name: Norm(config, shape) for name in "qkv"})
        for name in ("attn_in", "q", "k", "v", "pattern", "z"):
            setattr(self, f"hook_{name}", HookPoint())

    def _heads(self, x: torch.Tensor, name: str) -> torch.Tensor:
        projection = getattr(self, f"{name}_proj")(x)
        heads = projection.view(*x.shape[:2], self.n_heads, self.d_head)
        if self.head_norms is not None:
            heads = self.head_norms[name](heads)
        return getattr(self, f"hook_{name}")(heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_attn_in(x)
        q, k, v = (self._heads(x, name) for name in "qkv")
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        length = x.shape[1]
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        pattern = self.hook_pattern(scores.softmax(dim=-1))
        z = self.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return self.o_proj(z.reshape(*z.shape[:2], -1))

    def head_weights(self) -> dict[str, torch.Tensor]:
        """Per-head weights: q_h = attn_in @ w_q[h] + b_q[h] (before any per-head norm),
        likewise k and v; the head's output is z_h @ w_o[h], plus b_o once per position. float32, and
        views of the parameters where the layout allows: copy before changing them."""
        heads, d_head = self.n_heads, self.d_head
        weights = {}
        for name in "qkv":
            linear = getattr(self, f"{name}_proj")
            weights[f"w_{name}"] = linear.weight.detach().T.reshape(-1, heads, d_head).permute(1, 0, 2)
            weights[f"b_{name}"] = linear.bias.detach().reshape(heads, d_head)
        weights["w_o"] = self.o_proj.weight.detach().T.reshape(heads, d_head, -1)
        weights["b_o"] = self.o_proj.bias.detach()
        return {name: value.float() for name, value in weights.items()}


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff)
        self.down = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """One transformer layer; ``norm_attn`` exists in ``pre`` and ``post``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.placement = config.norm_placement
        self.norm_attn = Norm(config, (config.d_model,)) if self.placement in ("pre", "post") else None
        self.norm_ff = Norm(config, (config.d_model,))
        self.attn = Attention(config)
        self.ff = FeedForward(config)
        for name in ("resid_pre", "resid_mid", "resid_post"):
            setattr(self, f"hook_{name}", HookPoint())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        if self.placement == "post":
            x = self.hook_resid_mid(self.norm_attn(x + self.attn(x)))
            return self.hook_resid_post(self.norm_ff(x + self.ff(x)))
        attn_in = self.norm_attn(x) if self.placement == "pre" else x
        x = self.hook_resid_mid(x + self.attn(attn_in))
        return self.hook_resid_post(x + self.ff(self.norm_ff(x)))


def sinusoidal_positions(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """The original transformer's sinusoids at (possibly offset) integer positions."""
    frequencies = torch.exp(torch.arange(0, d_model, 2, device=positions.device)
                            * (-math.log(10000.0) / d_model))
    angles = positions.unsqueeze(-1).float() * frequencies
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)[..., :d_model]


class ArithmeticTransformer(nn.Module):
    """Decoder-only transformer; ``forward(tokens) -> logits`` (batch, pos, vocab)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embed = (nn.Embedding(config.max_len, config.d_model)
                               if config.positions == "learned" else None)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm_final = Norm(config, (config.d_model,)) if config.norm_placement != "post" else None
        self.unembed = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self):
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.o_proj.weight, std=residual_std)
            nn.init.normal_(block.ff.down.weight, std=residual_std)
        if self.position_embed is not None:
            nn.init.normal_(self.position_embed.weight, std=0.02 * math.sqrt(self.config.d_model))

    def forward(self, tokens: torch.Tensor, position_offset: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every position. ``position_offset`` (batch,) shifts the sinusoidal
        positions of each sequence (training uses random offsets; evaluation none)."""
        length = tokens.shape[1]
        if self.position_embed is not None and length > self.config.max_len:
            raise ConfigError(f"sequence length {length} exceeds the learned positions' "
                              f"max_len {self.config.max_len}; use shorter sequences")
        positions = torch.arange(length, device=tokens.device).expand(tokens.shape[0], -1)
        if self.position_embed is not None:
            if position_offset is not None:
                raise ConfigError("learned positions take no position_offset; pass None")
            x = self.embed(tokens) + self.position_embed(positions)
        else:
            if position_offset is not None:
                positions = positions + position_offset.to(tokens.device).unsqueeze(1)
            x = self.embed(tokens) + sinusoidal_positions(positions, self.config.d_model).to(self.embed.weight.dtype)
        for block in self.blocks:
            x = block(x)
        if self.norm_final is not None:
            x = self.norm_final(x)
        return self.unembed(x)

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def describe(self) -> dict:
        """JSON-able description for a store's ``model`` attribute."""
        c = self.config
        return {"family": "arithmetic", "norm_placement": c.norm_placement,
                "norm_type": c.norm_type, "n_layers": c.n_layers, "d_model": c.d_model,
                "n_heads": c.n_heads, "n_kv_heads": c.n_heads, "d_head": c.d_head,
                "d_ff": c.d_ff, "vocab_size": c.vocab_size, "attn_scale": c.attn_scale,
                "causal": True, "positions": c.positions, "max_len": c.max_len,
                "n_parameters": self.n_parameters()}


def save_model(model: ArithmeticTransformer, directory, metrics: dict | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` and, if given, ``metrics.json``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"family": "arithmetic", **model.config.to_dict()}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    if metrics is not None:
        (directory / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
    return directory


def read_config(directory) -> ModelConfig:
    """The ModelConfig saved in a model directory."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: expected a model directory holding "
                          f"{CONFIG_FILE} and {WEIGHTS_FILE} (written by save_model)")
    values = json.loads(path.read_text())
    family = values.pop("family", None)
    if family != "arithmetic":
        raise ConfigError(f"{path} describes family {family!r}, not 'arithmetic'")
    return ModelConfig.from_table(values, "model")


def load_model(directory, device: str | torch.device = "cpu") -> ArithmeticTransformer:
    """Load a saved model in eval mode (safetensors only; nothing is unpickled)."""
    from safetensors.torch import load_file

    config = read_config(directory)
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise ConfigError(f"{path} not found: expected the weights beside {CONFIG_FILE}")
    model = ArithmeticTransformer(config)
    try:
        model.load_state_dict(load_file(str(path)))
    except RuntimeError as error:
        raise ConfigError(f"{path} does not match {CONFIG_FILE}: {error}") from None
    return model.to(device).eval()
