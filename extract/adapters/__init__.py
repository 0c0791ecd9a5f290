"""Adapters: read and edit what a model's attention layers compute, for every supported family.

One interface over the project's arithmetic transformers and the transformers families of
``families.py``, used by extraction and by the replay's online noise check::

    adapter = adapter_for(model)
    adapter.describe()                  # the store's `model` attribute (sizes, score terms, norms)
    adapter.head_weights(layer)         # w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o (float32, store layout)
    logits = adapter.forward(tokens, valid)   # (batch, pos, vocab), None without a head; valid marks real tokens
    with adapter.capture(sites, layers, dtype=torch.float16) as recording:
        logits = adapter.forward(tokens, valid)
        activations = recording.take()  # site -> CPU tensor (batch, layer, pos, ...) as in the store
    with adapter.edit_qkv(fn):          # fn(layer, q, k, v) -> (q, k, v)
        logits = adapter.forward(tokens, valid)

Sites of block (layer) l, each (batch, pos, ...):

- ``resid_pre``: the stream the block reads; ``resid_post``: the stream it writes, so
  ``resid_post[l] == resid_pre[l + 1]``.
- ``resid_mid``: the stream after the attention update, which the feed-forward residual adds
  to: resid_pre plus the attention output in Pre-Norm families (after its norm in sandwich and
  output-norm families); LayerNorm(resid_pre + attention output) in Post-Norm ones (BERT,
  arithmetic ``post``); in parallel families (GPT-J, Phi, GPT-NeoX), whose MLP reads resid_pre
  too, resid_pre plus the attention output.
- ``attn_in``: what W_Q, W_K and W_V read: the Pre-Norm's output, or the block input.
- ``q`` (head, d_head), ``k`` and ``v`` (kv_head, d_head): as they enter the score and the
  weighted sum -- after rotary embedding, any QK-norm and OLMo's ``clip_qkv`` clamp (recorded in
  the description), before grouped-query heads are repeated -- so softmax of the score
  (``orthosphere.analyze.attention``: q . k times the layer's scale, soft-capped, plus ALiBi or
  T5's relative position bias, over the keys the causal, padding and sliding-window masks allow) is the model's own
  attention; head h reads kv_head h // (n_heads // n_kv_heads).
- ``pattern`` (head, qpos, kpos): that softmax, as the model computed it.
- ``norm_scale``: the factor s = 1 / sqrt(mean((x - m)^2) + eps) of the norm whose output is
  ``attn_in`` (the Pre-Norm; in Post-Norm models the previous block's norm on the residual, at
  layer 0 the embedding norm, NaN without one); ``q_norm_scale`` (head) and ``k_norm_scale``
  (kv_head): that of the QK-norm on each head. Read by a hook on the norm module from its own
  input, in float32 at least; a model without the norm does not provide the site.

``edit_qkv`` hands ``fn`` q (batch, pos, head, d_head) and k, v (batch, pos, kv_head, d_head)
of every layer as they enter the score; what it returns is used instead (and is what a
simultaneous capture records). Scaling v of a token scales its message W_O v exactly.

Hooks are installed once per model and hold no state: what a capture records and how an edit
changes q, k, v live in the trace of the forward pass (``trace.py``), so concurrent captures
on one model in different threads stay apart.

The modules: ``base.py`` (``Adapter``, the base class: what every model's adapter shares),
``arithmetic.py`` (``ArithmeticAdapter``: the project's arithmetic transformers), ``huggingface.py``
(``HuggingFaceAdapter``: the transformers families) and ``factory.py`` (``adapter_for``: the adapter
of a loaded model).
"""
from .base import Adapter
from .factory import adapter_for

__all__ = ["Adapter", "adapter_for"]
