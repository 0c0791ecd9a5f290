"""The arithmetic transformer: placements, exact hooks, head weights, save/load, bad input."""

import json
import math

import numpy as np
import pytest
import torch

from orthosphere.extract import tasks
from orthosphere.extract.model import NORM_PLACEMENTS, ArithmeticTransformer, ConfigError, ModelConfig, load_model, save_model
from tests.reference import attention_atol, attention_float64


def make_model(placement="pre", norm_type="layer", seed=0, **sizes):
    torch.manual_seed(seed)
    values = dict(n_layers=2, d_model=24, n_heads=3, d_ff=40, norm_placement=placement,
                  norm_type=norm_type) | sizes
    model = ArithmeticTransformer(ModelConfig(**values))
    with torch.no_grad():  # move every gain and bias off its initial value
        for name, parameter in model.named_parameters():
            if "weight" in name and parameter.dim() == 1 or "norms" in name or "bias" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model.eval()


def example_tokens(n=5):
    return torch.from_numpy(tasks.generate("test", n, seed=0).tokens).long()


def capture(model, tokens, layer=0):
    """Run the model and record every hook of one block."""
    block = model.blocks[layer]
    seen, handles = {}, []
    sites = {f"resid_{n}": getattr(block, f"hook_resid_{n}") for n in ("pre", "mid", "post")}
    sites |= {n: getattr(block.attn, f"hook_{n}") for n in ("attn_in", "q", "k", "v", "pattern", "z")}
    for name, module in sites.items():
        handles.append(module.register_forward_hook(
            lambda _m, _i, output, name=name: seen.__setitem__(name, output.detach().clone())))
    logits = model(tokens)
    for handle in handles:
        handle.remove()
    return logits, seen


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
@pytest.mark.parametrize("norm_type", ["layer", "rms"])
def test_pattern_is_the_softmax_of_the_hooked_q_and_k(placement, norm_type):
    model = make_model(placement, norm_type)
    _, seen = capture(model, example_tokens(), layer=1)
    scale = model.blocks[1].attn.scale
    assert scale == pytest.approx(1 / 8 ** 0.5)
    length = seen["q"].shape[1]
    valid = np.ones(seen["q"].shape[:2], bool)
    expected, largest = attention_float64(seen["q"].numpy(), seen["k"].numpy(), valid, attn_scale=scale, causal=True)
    np.testing.assert_allclose(seen["pattern"].numpy(), expected, rtol=0, atol=attention_atol(largest))
    z = np.einsum("bhqk,bkhd->bqhd", seen["pattern"].double().numpy(), seen["v"].double().numpy())
    np.testing.assert_allclose(seen["z"].numpy(), z, rtol=0, atol=1e-5 * max(1.0, np.abs(seen["v"].numpy()).max()))
    assert seen["q"].shape == (5, length, 3, 8) and seen["pattern"].shape == (5, 3, length, length)


@pytest.mark.parametrize("placement", NORM_PLACEMENTS)
def test_head_weights_rebuild_q_k_v_and_the_attention_output(placement):
    model = make_model(placement)
    _, seen = capture(model, example_tokens())
    attn = model.blocks[0].attn
    weights = attn.head_weights()
    assert weights["w_q"].shape == (3, 24, 8) and weights["w_o"].shape == (3, 8, 24)
    assert weights["b_q"].shape == (3, 8) and weights["b_o"].shape == (24,)
    for name in "qkv":
        projected = torch.einsum("bpm,hmd->bphd", seen["attn_in"], weights[f"w_{name}"]) + weights[f"b_{name}"]
        if placement == "qkv":
            projected = attn.head_norms[name](projected)
        torch.testing.assert_close(projected, seen[name], rtol=0, atol=1e-5)
    output = torch.einsum("bphd,hdm->bpm", seen["z"], weights["w_o"]) + weights["b_o"]
    if placement == "post":
        expected = model.blocks[0].norm_attn(seen["resid_pre"] + output)
    else:
        expected = seen["resid_pre"] + output
    torch.testing.assert_close(expected, seen["resid_mid"], rtol=0, atol=1e-5)


def test_heads_may_span_more_dimensions_than_the_residual_stream():
    """The paper's 12 heads of 64 in d_model 512: d_head set on its own."""
    config = ModelConfig(n_layers=1, d_model=24, n_heads=3, d_head=12, d_ff=40, norm_placement="qkv")
    model = ArithmeticTransformer(config).eval()
    _, seen = capture(model, example_tokens())
    assert seen["q"].shape[-2:] == (3, 12) and model.blocks[0].attn.head_weights()["w_q"].shape == (3, 24, 12)
    expected, largest = attention_float64(seen["q"].numpy(), seen["k"].numpy(), np.ones(seen["q"].shape[:2], bool),
                                          attn_scale=12 ** -0.5, causal=True)
    np.testing.assert_allclose(seen["pattern"].numpy(), expected, rtol=0, atol=attention_atol(largest))


@pytest.mark.parametrize("placement, reads_normalised", [
    ("pre", True), ("none", False), ("qkv", False), ("post", False)])
def test_attn_in_is_what_the_projections_read(placement, reads_normalised):
    model = make_model(placement, norm_type="rms")
    _, seen = capture(model, example_tokens())
    block = model.blocks[0]
    expected = block.norm_attn(seen["resid_pre"]) if reads_normalised else seen["resid_pre"]
    torch.testing.assert_close(seen["attn_in"], expected, rtol=0, atol=0)


def test_qkv_norm_puts_every_head_vector_on_its_sphere():
    model = make_model("qkv", norm_type="rms")
    _, seen = capture(model, example_tokens())
    norms = model.blocks[0].attn.head_norms
    for name in "qkv":
        unit_gain = seen[name] / norms[name].weight  # undo the per-head gain
        torch.testing.assert_close(unit_gain.norm(dim=-1),
                                   torch.full(unit_gain.shape[:-1], 8 ** 0.5), rtol=1e-3, atol=0)
    layer_model = make_model("qkv", norm_type="layer")
    _, seen = capture(layer_model, example_tokens())
    centred = seen["k"] / layer_model.blocks[0].attn.head_norms["k"].weight
    torch.testing.assert_close(centred.mean(-1), torch.zeros(centred.shape[:-1]), rtol=0, atol=1e-5)


def test_post_norm_writes_a_normalised_stream():
    model = make_model("post", norm_type="rms")
    _, seen = capture(model, example_tokens())
    gain = model.blocks[0].norm_ff.weight
    rms = (seen["resid_post"] / gain).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=0)


def test_scaling_v_at_its_hook_scales_that_message():
    """Noise (1 + kappa) on v_t of head h adds kappa * a_t * (W_O v_t) to every query's output."""
    model = make_model("qkv")
    tokens = example_tokens(3)
    attn = model.blocks[0].attn
    _, clean = capture(model, tokens)
    head, token, kappa = 1, 4, 0.25

    def scale_v(_module, _inputs, v):
        v = v.clone()
        v[:, token, head] *= 1 + kappa
        return v

    handle = attn.hook_v.register_forward_hook(scale_v)
    _, noisy = capture(model, tokens)
    handle.remove()
    message = clean["v"][:, token, head] @ attn.head_weights()["w_o"][head]  # (batch, d_model)
    expected = kappa * clean["pattern"][:, head, :, token, None] * message[:, None, :]
    torch.testing.assert_close(noisy["resid_mid"] - clean["resid_mid"], expected, rtol=0, atol=1e-5)


def test_outputs_are_causal():
    model = make_model("none")
    tokens = example_tokens(2)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 3) % tasks.PAD_ID
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_position_offsets_move_sinusoidal_positions_only():
    model = make_model("pre")
    tokens = example_tokens(2)
    assert not torch.allclose(model(tokens), model(tokens, torch.tensor([3, 5])))
    torch.testing.assert_close(model(tokens), model(tokens, torch.zeros(2, dtype=torch.long)))
    learned = make_model("pre", positions="learned", max_position_offset=0)
    with pytest.raises(ConfigError, match="learned positions take no position_offset"):
        learned(tokens, torch.tensor([1, 2]))
    with pytest.raises(ConfigError, match="exceeds the learned positions' max_len"):
        learned(torch.zeros(1, 65, dtype=torch.long))


def test_save_and_load_give_the_same_model(tmp_path):
    model = make_model("qkv", norm_type="rms", positions="learned", max_position_offset=0)
    save_model(model, tmp_path / "m", metrics={"final": {"test": {"token_accuracy": 0.5}}})
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json", "metrics.json", "model.safetensors"]
    loaded = load_model(tmp_path / "m")
    assert not loaded.training and loaded.config == model.config
    tokens = example_tokens()
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)
    described = loaded.describe()
    assert json.loads(json.dumps(described)) == described
    assert described | {"n_parameters": 0} == {
        "family": "arithmetic", "norm_placement": "qkv", "norm_type": "rms", "n_layers": 2,
        "d_model": 24, "n_heads": 3, "n_kv_heads": 3, "d_head": 8, "d_ff": 40,
        "vocab_size": 17, "attn_scale": 1 / math.sqrt(8), "causal": True, "positions": "learned",
        "max_len": 64, "n_parameters": 0}
    assert described["n_parameters"] == sum(p.numel() for p in model.parameters())


def test_loading_bad_directories_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        load_model(tmp_path)
    save_model(make_model("pre"), tmp_path / "a")
    save_model(make_model("pre", d_ff=48), tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").replace(tmp_path / "a" / "model.safetensors")
    with pytest.raises(ConfigError, match="does not match config.json"):
        load_model(tmp_path / "a")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    (tmp_path / "b" / "config.json").write_text(json.dumps(config | {"family": "gpt2"}))
    with pytest.raises(ConfigError, match="family 'gpt2'"):
        load_model(tmp_path / "b")


@pytest.mark.parametrize("change, message", [
    ({"norm_placement": "sandwich"}, r"\[model\] norm_placement = 'sandwich': expected one of \['none', 'pre', 'post', 'qkv'\]"),
    ({"norm_type": "batch"}, "norm_type = 'batch': expected one of"),
    ({"d_model": 25}, "d_model = 25 is not divisible by n_heads = 3"),
    ({"d_head": 0}, "d_head = 0: expected a positive integer"),
    ({"positions": "rotary"}, "positions = 'rotary': expected one of"),
    ({"positions": "learned"}, "learned positions take no random offset"),
    ({"n_layers": 0}, "n_layers = 0"),
    ({"dropout": 0.1}, "unknown model keys \\['dropout'\\]"),
])
def test_bad_model_configs_are_config_errors(change, message):
    values = dict(n_layers=2, d_model=24, n_heads=3, d_ff=40, norm_placement="pre") | change
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_table(values, "model")


def test_missing_model_keys_are_a_config_error():
    with pytest.raises(ConfigError, match="incomplete"):
        ModelConfig.from_table({"n_layers": 2, "d_model": 24}, "model")
