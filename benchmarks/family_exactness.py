"""Exactness per family: how far the attention recomputed from captured q, k and the described score
terms is from transformers' own eager attention.

For every supported transformers family, the tiny random-weights model of the tests
(tests/tiny_families.py: 2 layers, d_model 32, sharp attention, sliding windows of 4 positions,
ModernBERT's two-sided window of 2 either side, Gemma 2's soft-cap of 20, Bloom's ALiBi, T5's and
MPNet's relative position bias, GPT-OSS's sink logits) is captured over a padded batch of uneven lengths
(16 sequences of up to 24 tokens, so windows are much shorter than the sequences), and the eager
pattern of the same weights (loaded with attn_implementation="eager") is compared, on valid queries,
with the float64 softmax of the captured q, k and the score terms of the model description, and with
the float32 orthosphere function (``orthosphere.analyze.attention_from_qk``). Also printed: the
largest |logit|, the median over valid queries of the largest attention weight (sharpness), and how
far the captured attn_out and mlp_out are from the residual differences they add up to
(resid_mid - resid_pre, resid_post - resid_mid, in float64 from the captured streams, relative to the
largest |resid|; "post" where a Post-Norm's norm lies between).

Usage: python benchmarks/family_exactness.py [--samples 16] [--length 24]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny models

from orthosphere.analyze.attention import ScoreTerms, attention_from_qk  # noqa: E402
from orthosphere.extract.adapters import adapter_for  # noqa: E402
from tests.reference import attention_float64  # noqa: E402
from tests.tiny_families import FAMILIES, family_configs, tiny_model  # noqa: E402


def measure(model_type: str, tokens: torch.Tensor, valid: torch.Tensor) -> dict:
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        tiny_model(model_type).save_pretrained(folder)
        eager = getattr(transformers, family_configs()[model_type][2]).from_pretrained(
            folder, attn_implementation="eager").eval()
        adapter = adapter_for(getattr(transformers, family_configs()[model_type][2]).from_pretrained(folder).eval())
    sites = ["resid_pre", "resid_mid", "resid_post", "q", "k", "attn_out", "mlp_out"]
    with torch.no_grad(), adapter.capture(sites) as recording:
        adapter.forward(tokens, valid)
        captured = recording.take()
        pattern = torch.stack(eager(input_ids=tokens, attention_mask=valid.long(), output_attentions=True).attentions, 1)
    description, valid_np = adapter.describe(), valid.numpy()
    queries = valid_np[:, None, :, None]
    worst64 = worst32 = largest = 0.0
    sharpness = []
    for layer in range(description["n_layers"]):
        terms = ScoreTerms.of_layer(description, layer)
        q, k = captured["q"][:, layer].numpy(), captured["k"][:, layer].numpy()
        reference, logit = attention_float64(q, k, valid_np, attn_scale=terms.scale, causal=terms.causal,
                                             sliding_window=terms.sliding_window, softcap=terms.softcap,
                                             alibi_slopes=terms.alibi_slopes, relative_bias=terms.relative_bias,
                                             sink_logits=terms.sink_logits)
        eager_layer = pattern[:, layer].double().numpy()
        worst64 = max(worst64, float(np.abs(np.where(queries, eager_layer - reference, 0)).max()))
        ours = attention_from_qk(q, k, valid_np, terms)
        worst32 = max(worst32, float(np.abs(np.where(queries, eager_layer - ours, 0)).max()))
        largest = max(largest, logit)
        sharpness.append(float(np.median(reference.max(axis=-1).transpose(0, 2, 1)[valid_np])))
    score = description["score"]
    terms = [name for name, values in (("window", score["sliding_window"]), ("softcap", score["softcap"]))
             if any(v is not None for v in values)] + (["alibi"] if score["alibi_slopes"] else []) \
        + (["relative"] if score.get("relative_bias") else []) + (["sinks"] if score.get("sink_logits") else [])
    return {"family": model_type, "float64": worst64, "float32": worst32, "logit": largest,
            "sharp": min(sharpness), "terms": ",".join(terms) or "-", "placement": description["norm_placement"],
            "outputs": residual_differences(captured, valid_np, description)}


def residual_differences(captured: dict, valid: np.ndarray, description: dict) -> str:
    """The largest |attn_out - (resid_mid - resid_pre)| and |mlp_out - (resid_post - resid_mid)| over valid
    tokens and layers, relative to the largest |resid|; "post" for Post-Norm models."""
    if description["norm_placement"] == "post":
        return "post"
    pre, mid, post, attn_out, mlp_out = (captured[name].double().numpy().swapaxes(0, 1)[:, valid]
                                         for name in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"))
    scale = max(np.abs(pre).max(), np.abs(mid).max(), np.abs(post).max())
    worst = max(np.abs(attn_out - (mid - pre)).max(), np.abs(mlp_out - (post - mid)).max())
    return f"{worst / scale:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 21, (args.samples, args.length), generator=generator)
    lengths = torch.randint(args.length // 3, args.length + 1, (args.samples,), generator=generator)
    lengths[0] = args.length
    valid = torch.arange(args.length)[None, :] < lengths[:, None]
    tokens[~valid] = 0
    print(f"{args.samples} sequences of {int(lengths.min())}-{args.length} tokens (right-padded)")
    print("| family | placement | score terms | max abs diff, float64 softmax of stored q, k | "
          "max abs diff, float32 orthosphere function | largest logit | sharpness (min over layers) | "
          "attn_out, mlp_out vs residual differences (relative) |")
    print("|---|---|---|---|---|---|---|---|")
    for model_type in FAMILIES:
        row = measure(model_type, tokens, valid)
        print(f"| {row['family']} | {row['placement']} | {row['terms']} | {row['float64']:.1e} | {row['float32']:.1e} | "
              f"{row['logit']:.1f} | {row['sharp']:.3f} | {row['outputs']} |")


if __name__ == "__main__":
    main()
