"""Tiny random-weights models of every supported transformers family, built from their configs.

2 layers, d_model 32, 4 query heads (2 key/value heads where the family has grouped-query
attention), a sliding window of 4 positions where the family has one (so that the test
sequences, up to 12 tokens, are longer than the window), soft-capping at 20 for Gemma 2 (logits
reach it, so it matters, without flattening them), T5's relative distances bucketed up to 6 (so
that the sequences reach past the last bucket), and attention sharp in every layer (most queries
put nearly all their attention on one key), which is where a wrong score term shows. No downloads.
"""
from __future__ import annotations

import torch

from tests.test_extract_models import VOCAB

D_MODEL, N_LAYERS, N_HEADS, N_KV_HEADS, D_FF, WINDOW = 32, 2, 4, 2, 64, 4
T5_DISTANCE = 6
MODERNBERT_HALF_WINDOW = 2
"""ModernBERT's local layers see keys up to this far on either side (local_attention = twice it)."""
ULTRABERT_HALF_WINDOW = 2
"""UltraBERT's sliding layers see keys up to this far on either side (its sliding_window)."""
SHARPEN = 5.0
"""q and k maps drawn with standard deviation SHARPEN / sqrt(d_model), QK-norm gains multiplied by it:
logits of order 10 and more."""
SHARPER = {"roberta-prelayernorm": 8.0}
"""Families whose attention needs sharper q and k maps to be sharp in every layer (RoBERTa-PreLayerNorm:
median largest weight 0.83-0.91 over seeds at SHARPEN, 0.99 at 8)."""
RELATIVE_BIAS_STD = 3.0
"""MPNet's relative position bias drawn with this standard deviation (its init's 0.02 would hide it)."""
SINK_STD = 3.0
"""GPT-OSS's sink logits drawn with this standard deviation: of the order of the smaller logits."""
DBRX_NO_CLIP = 1e4
"""DBRX's clip_qkv in the tiny config: its attention needs a value (None fails in transformers), this one
far beyond any |q|, |k|, |v| (the maps stay linear)."""
NANOCHAT_HEAD_DIM = 64
"""NanoChat's q and k are normed without a gain, so its logits are at most sqrt(d_head): 8 at this width, with
W_K tied to W_Q (each token's own key scores highest), make its attention sharp."""
EMBEDDING_STD = 1.0
"""Token and position embeddings drawn with this standard deviation (transformers' default is 0.02):
the tokens then differ by more than the biases every position shares, so that the residual stream
of later layers still tells positions apart and their attention is sharp too."""


def _llama_sizes(**extra):
    return dict(hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
                num_key_value_heads=N_KV_HEADS, max_position_embeddings=64, **extra)


def _bert_sizes(max_position_embeddings=64, **extra):
    return dict(hidden_size=D_MODEL, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS, intermediate_size=D_FF,
                max_position_embeddings=max_position_embeddings, **extra)


TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4)
"""The vision tower of a multimodal family's tiny model (text alone never reaches it)."""
MULTIMODAL_TOKENS = dict(boi_token_index=len(VOCAB), eoi_token_index=len(VOCAB) + 1, image_token_index=len(VOCAB) + 2)
"""Its image tokens: three more ids after the test tokenizer's words (which text alone never gives)."""
QWEN_VL_TOKENS = dict(vision_start_token_id=len(VOCAB), video_token_id=len(VOCAB) + 1, image_token_id=len(VOCAB) + 2)
"""The same ids under the Qwen VL configs' names."""
MROPE = dict(rope_type="default", rope_theta=1e4, mrope_section=[1, 1, 2])
"""Qwen VL's multimodal rotary embedding at d_head 8: time, height and width sections of the 4 frequencies."""


def _t5_sizes():
    """T5's encoder with relative distances bucketed up to T5_DISTANCE, beyond which (the test
    sequences reach 11) every key shares its side's last bucket."""
    return dict(d_model=D_MODEL, d_kv=D_MODEL // N_HEADS, num_heads=N_HEADS, num_layers=N_LAYERS, d_ff=D_FF,
                relative_attention_num_buckets=8, relative_attention_max_distance=T5_DISTANCE)


def family_configs() -> dict:
    """model_type -> (config class name, config keywords, the class to build: the language-model one, or
    the encoder without a head for T5)."""
    return {
        "gpt2": ("GPT2Config", dict(n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_inner=D_FF, n_positions=64,
                                    scale_attn_by_inverse_layer_idx=True), "GPT2LMHeadModel"),
        "llama": ("LlamaConfig", _llama_sizes(attention_bias=True), "LlamaForCausalLM"),
        "mistral": ("MistralConfig", _llama_sizes(sliding_window=WINDOW), "MistralForCausalLM"),
        "mixtral": ("MixtralConfig", _llama_sizes(sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1),
                    "MixtralForCausalLM"),
        "qwen2": ("Qwen2Config", _llama_sizes(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                  "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", _llama_sizes(head_dim=8), "Qwen3ForCausalLM"),
        "olmo": ("OlmoConfig", _llama_sizes(), "OlmoForCausalLM"),
        "olmo2": ("Olmo2Config", _llama_sizes(), "Olmo2ForCausalLM"),
        "gemma": ("GemmaConfig", _llama_sizes(head_dim=8), "GemmaForCausalLM"),
        "gemma2": ("Gemma2Config", _llama_sizes(head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=20.0,
                                                query_pre_attn_scalar=16), "Gemma2ForCausalLM"),
        "gemma3_text": ("Gemma3TextConfig", _llama_sizes(head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                                         sliding_window_pattern=2), "Gemma3ForCausalLM"),
        "phi": ("PhiConfig", dict(hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=N_LAYERS,
                                  num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, max_position_embeddings=64,
                                  partial_rotary_factor=0.5, qk_layernorm=True), "PhiForCausalLM"),
        "phi3": ("Phi3Config", _llama_sizes(sliding_window=WINDOW), "Phi3ForCausalLM"),
        "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=N_LAYERS,
                                           num_attention_heads=N_HEADS, max_position_embeddings=64, rotary_pct=0.5),
                     "GPTNeoXForCausalLM"),
        "gptj": ("GPTJConfig", dict(n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_inner=D_FF, rotary_dim=4,
                                    n_positions=64), "GPTJForCausalLM"),
        "stablelm": ("StableLmConfig", _llama_sizes(partial_rotary_factor=0.5, qk_layernorm=True, use_qkv_bias=True),
                     "StableLmForCausalLM"),
        "starcoder2": ("Starcoder2Config", _llama_sizes(sliding_window=WINDOW), "Starcoder2ForCausalLM"),
        "granite": ("GraniteConfig", _llama_sizes(attention_multiplier=0.3, residual_multiplier=0.5),
                    "GraniteForCausalLM"),
        "opt": ("OPTConfig", dict(hidden_size=D_MODEL, ffn_dim=D_FF, num_hidden_layers=N_LAYERS,
                                  num_attention_heads=N_HEADS, max_position_embeddings=64, word_embed_proj_dim=D_MODEL),
                "OPTForCausalLM"),
        "bert": ("BertConfig", dict(hidden_size=D_MODEL, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
                                    intermediate_size=D_FF, max_position_embeddings=64), "BertForMaskedLM"),
        "roberta": ("RobertaConfig", dict(hidden_size=D_MODEL, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
                                          intermediate_size=D_FF, max_position_embeddings=70), "RobertaForMaskedLM"),
        "distilbert": ("DistilBertConfig", dict(dim=D_MODEL, n_layers=N_LAYERS, n_heads=N_HEADS, hidden_dim=D_FF,
                                                max_position_embeddings=64), "DistilBertForMaskedLM"),
        "bloom": ("BloomConfig", dict(hidden_size=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS), "BloomForCausalLM"),
        "falcon": ("FalconConfig", dict(hidden_size=D_MODEL, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
                                        num_kv_heads=N_KV_HEADS, new_decoder_architecture=True, bias=True,
                                        max_position_embeddings=64), "FalconForCausalLM"),
        "qwen2_moe": ("Qwen2MoeConfig", _llama_sizes(moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                     num_experts=4, num_experts_per_tok=2), "Qwen2MoeForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", _llama_sizes(head_dim=8, moe_intermediate_size=16, num_experts=4,
                                                     num_experts_per_tok=2), "Qwen3MoeForCausalLM"),
        "olmoe": ("OlmoeConfig", _llama_sizes(num_experts=4, num_experts_per_tok=2), "OlmoeForCausalLM"),
        "granitemoe": ("GraniteMoeConfig", _llama_sizes(num_local_experts=4, num_experts_per_tok=2,
                                                        attention_multiplier=0.3, residual_multiplier=0.5),
                       "GraniteMoeForCausalLM"),
        "helium": ("HeliumConfig", _llama_sizes(head_dim=8), "HeliumForCausalLM"),
        "arcee": ("ArceeConfig", _llama_sizes(), "ArceeForCausalLM"),
        "ministral": ("MinistralConfig", _llama_sizes(head_dim=8, sliding_window=WINDOW), "MinistralForCausalLM"),
        "seed_oss": ("SeedOssConfig", _llama_sizes(head_dim=8, attention_bias=True), "SeedOssForCausalLM"),
        "smollm3": ("SmolLM3Config", _llama_sizes(no_rope_layers=[1, 0]), "SmolLM3ForCausalLM"),
        "olmo3": ("Olmo3Config", _llama_sizes(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]), "Olmo3ForCausalLM"),
        "exaone4": ("Exaone4Config", _llama_sizes(head_dim=8, sliding_window=WINDOW, sliding_window_pattern=2),
                    "Exaone4ForCausalLM"),
        "apertus": ("ApertusConfig", _llama_sizes(head_dim=8), "ApertusForCausalLM"),
        "glm4": ("Glm4Config", _llama_sizes(head_dim=8), "Glm4ForCausalLM"),
        "nemotron": ("NemotronConfig", _llama_sizes(head_dim=8, partial_rotary_factor=0.5), "NemotronForCausalLM"),
        "cohere": ("CohereConfig", _llama_sizes(use_qk_norm=False), "CohereForCausalLM"),
        "cohere2": ("Cohere2Config", _llama_sizes(head_dim=8, sliding_window=WINDOW, sliding_window_pattern=2),
                    "Cohere2ForCausalLM"),
        "xlm-roberta": ("XLMRobertaConfig", _bert_sizes(max_position_embeddings=70), "XLMRobertaForMaskedLM"),
        "camembert": ("CamembertConfig", _bert_sizes(max_position_embeddings=70), "CamembertForMaskedLM"),
        "electra": ("ElectraConfig", _bert_sizes(embedding_size=D_MODEL), "ElectraForMaskedLM"),
        "gpt_oss": ("GptOssConfig", _llama_sizes(head_dim=8, sliding_window=WINDOW, num_local_experts=4,
                                                 num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"]),
                    "GptOssForCausalLM"),
        "mpnet": ("MPNetConfig", _bert_sizes(max_position_embeddings=70), "MPNetForMaskedLM"),
        "modernbert": ("ModernBertConfig", _bert_sizes(local_attention=2 * MODERNBERT_HALF_WINDOW,
                                                       global_attn_every_n_layers=2, cls_token_id=1, sep_token_id=2),
                       "ModernBertForMaskedLM"),
        "glm": ("GlmConfig", _llama_sizes(head_dim=8, attention_bias=True), "GlmForCausalLM"),
        "ernie4_5": ("Ernie4_5Config", _llama_sizes(head_dim=8, use_bias=True), "Ernie4_5ForCausalLM"),
        "ernie4_5_moe": ("Ernie4_5_MoeConfig", _llama_sizes(moe_intermediate_size=16, moe_num_experts=4, moe_k=2,
                                                           moe_layer_start_index=1), "Ernie4_5_MoeForCausalLM"),
        "jais2": ("Jais2Config", _llama_sizes(), "Jais2ForCausalLM"),
        "vaultgemma": ("VaultGemmaConfig", _llama_sizes(head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                                        attn_logit_softcapping=20.0,
                                                        layer_types=["sliding_attention", "full_attention"]),
                       "VaultGemmaForCausalLM"),
        "dots1": ("Dots1Config", _llama_sizes(head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                              n_shared_experts=1, first_k_dense_replace=1), "Dots1ForCausalLM"),
        "glm4_moe": ("Glm4MoeConfig", _llama_sizes(head_dim=8, moe_intermediate_size=16, n_routed_experts=4,
                                                   num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                                   use_qk_norm=True), "Glm4MoeForCausalLM"),
        "flex_olmo": ("FlexOlmoConfig", _llama_sizes(num_experts=4, num_experts_per_tok=2), "FlexOlmoForCausalLM"),
        "ernie": ("ErnieConfig", _bert_sizes(), "ErnieForMaskedLM"),
        "data2vec-text": ("Data2VecTextConfig", _bert_sizes(max_position_embeddings=70), "Data2VecTextForMaskedLM"),
        "roberta-prelayernorm": ("RobertaPreLayerNormConfig", _bert_sizes(max_position_embeddings=70),
                                 "RobertaPreLayerNormForMaskedLM"),
        "xlm-roberta-xl": ("XLMRobertaXLConfig", _bert_sizes(max_position_embeddings=70), "XLMRobertaXLForMaskedLM"),
        "gpt_bigcode": ("GPTBigCodeConfig", dict(n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_inner=D_FF,
                                                 n_positions=64, multi_query=False), "GPTBigCodeForCausalLM"),
        "ministral3": ("Ministral3Config", _llama_sizes(head_dim=8, sliding_window=WINDOW), "Ministral3ForCausalLM"),
        "esm": ("EsmConfig", _bert_sizes(position_embedding_type="rotary", emb_layer_norm_before=False, token_dropout=False,
                                         mask_token_id=3), "EsmForMaskedLM"),
        "solar_open": ("SolarOpenConfig", _llama_sizes(head_dim=8, moe_intermediate_size=16, n_routed_experts=4,
                                                       num_experts_per_tok=2, n_shared_experts=1), "SolarOpenForCausalLM"),
        "mellum": ("MellumConfig", _llama_sizes(head_dim=8, sliding_window=WINDOW, moe_intermediate_size=16, num_experts=4,
                                                num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                                                mlp_layer_types=["dense", "sparse"]), "MellumForCausalLM"),
        "cohere2_moe": ("Cohere2MoeConfig", _llama_sizes(head_dim=8, sliding_window=WINDOW, num_experts=4, num_experts_per_tok=2,
                                                         layer_types=["sliding_attention", "full_attention"]),
                        "Cohere2MoeForCausalLM"),
        "persimmon": ("PersimmonConfig", dict(hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=N_LAYERS,
                                              num_attention_heads=N_HEADS, max_position_embeddings=64, qk_layernorm=True),
                      "PersimmonForCausalLM"),
        "biogpt": ("BioGptConfig", _bert_sizes(), "BioGptForCausalLM"),
        "gpt_neo": ("GPTNeoConfig", dict(hidden_size=D_MODEL, num_layers=N_LAYERS, num_heads=N_HEADS, intermediate_size=D_FF,
                                         max_position_embeddings=64, attention_types=[[["global", "local"], 1]],
                                         window_size=WINDOW), "GPTNeoForCausalLM"),
        "phimoe": ("PhimoeConfig", _llama_sizes(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
                   "PhimoeForCausalLM"),
        "cwm": ("CwmConfig", _llama_sizes(head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
                "CwmForCausalLM"),
        "mpt": ("MptConfig", dict(d_model=D_MODEL, n_heads=N_HEADS, n_layers=N_LAYERS, expansion_ratio=2, max_seq_len=64),
                "MptForCausalLM"),
        "codegen": ("CodeGenConfig", dict(n_embd=D_MODEL, n_layer=N_LAYERS, n_head=2 * N_HEADS, n_inner=D_FF, n_positions=64,
                                          rotary_dim=2), "CodeGenForCausalLM"),  # two heads in each of its 4 shards
        "modernbert-decoder": ("ModernBertDecoderConfig", _bert_sizes(local_attention=2 * WINDOW,
                                                                      layer_types=["sliding_attention", "full_attention"]),
                               "ModernBertDecoderForCausalLM"),
        "minimax_m2": ("MiniMaxM2Config", _llama_sizes(head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                            partial_rotary_factor=0.5)),
                       "MiniMaxM2ForCausalLM"),
        "internlm3": ("InternLM3Config", _llama_sizes(head_dim=8, qkv_bias=True, bias=True), "LlamaForCausalLM"),
        "exaone": ("ExaoneConfig", _llama_sizes(), "LlamaForCausalLM"),
        "dbrx": ("DbrxConfig", dict(d_model=D_MODEL, n_heads=N_HEADS, n_layers=N_LAYERS, max_seq_len=64,
                                    attn_config=dict(kv_n_heads=N_KV_HEADS, rope_theta=10000.0, clip_qkv=DBRX_NO_CLIP),
                                    ffn_config=dict(ffn_hidden_size=D_FF // 4, moe_num_experts=4, moe_top_k=2)),
                 "DbrxForCausalLM"),
        "megatron-bert": ("MegatronBertConfig", _bert_sizes(), "MegatronBertForMaskedLM"),
        "rembert": ("RemBertConfig", _bert_sizes(input_embedding_size=16, output_embedding_size=24), "RemBertForMaskedLM"),
        "nomic_bert": ("NomicBertConfig", _bert_sizes(), "NomicBertForMaskedLM"),
        "gte": ("GteConfig", _bert_sizes(), "GteForMaskedLM"),
        "jina_embeddings_v3": ("JinaEmbeddingsV3Config", _bert_sizes(), "JinaEmbeddingsV3ForMaskedLM"),
        "eurobert": ("EuroBertConfig", _llama_sizes(), "EuroBertForMaskedLM"),
        "ultrabert": ("UltrabertConfig", _llama_sizes(sliding_window=ULTRABERT_HALF_WINDOW,
                                                      layer_types=["sliding_attention", "full_attention"]),
                      "UltrabertForMaskedLM"),
        "bert-generation": ("BertGenerationConfig", _bert_sizes(), "BertGenerationEncoder"),
        "esmc": ("EsmcConfig", _llama_sizes() | dict(num_key_value_heads=N_HEADS), "EsmcForMaskedLM"),  # no grouped heads
        "xglm": ("XGLMConfig", dict(d_model=D_MODEL, num_layers=N_LAYERS, attention_heads=N_HEADS, ffn_dim=D_FF,
                                    max_position_embeddings=64), "XGLMForCausalLM"),
        "openai-gpt": ("OpenAIGPTConfig", dict(n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_positions=64),
                       "OpenAIGPTLMHeadModel"),
        "ctrl": ("CTRLConfig", dict(n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, dff=D_FF, n_positions=64), "CTRLLMHeadModel"),
        "nanochat": ("NanoChatConfig", _llama_sizes(head_dim=NANOCHAT_HEAD_DIM) | dict(num_key_value_heads=N_HEADS),
                     "NanoChatForCausalLM"),
        "hunyuan_v1_dense": ("HunYuanDenseV1Config", _llama_sizes(head_dim=8), "HunYuanDenseV1ForCausalLM"),
        "hunyuan_v1_moe": ("HunYuanMoEV1Config", _llama_sizes(head_dim=8, num_experts=4, moe_topk=2), "HunYuanMoEV1ForCausalLM"),
        "iquestcoder": ("IQuestCoderConfig", _llama_sizes(head_dim=8), "LlamaForCausalLM"),
        "apertus1p5_text": ("Apertus1p5TextConfig", _llama_sizes(head_dim=8), "Apertus1p5TextForCausalLM"),
        "gemma3": ("Gemma3Config", dict(text_config=_llama_sizes(head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                                                 sliding_window_pattern=2),
                                        vision_config=TINY_VISION, mm_tokens_per_image=4, **MULTIMODAL_TOKENS),
                   "Gemma3ForConditionalGeneration"),
        "mistral3": ("Mistral3Config", dict(text_config=_llama_sizes(head_dim=8, sliding_window=WINDOW), vision_config=TINY_VISION
                                            | dict(head_dim=8), image_token_index=MULTIMODAL_TOKENS["image_token_index"]),
                     "Mistral3ForConditionalGeneration"),
        "llava": ("LlavaConfig", dict(text_config=_llama_sizes(attention_bias=True) | dict(model_type="llama"),
                                      vision_config=TINY_VISION | dict(model_type="clip_vision_model"),
                                      image_token_index=MULTIMODAL_TOKENS["image_token_index"]),
                  "LlavaForConditionalGeneration"),
        "qwen2_vl": ("Qwen2VLConfig", dict(text_config=_llama_sizes(rope_parameters=MROPE), vision_config=dict(
            depth=1, embed_dim=16, hidden_size=D_MODEL, num_heads=2, patch_size=4), **QWEN_VL_TOKENS),
                     "Qwen2VLForConditionalGeneration"),
        "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(text_config=_llama_sizes(rope_parameters=MROPE), vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=D_MODEL, patch_size=4, window_size=8,
            fullatt_block_indexes=[0]), **QWEN_VL_TOKENS), "Qwen2_5_VLForConditionalGeneration"),
        "qwen3_vl": ("Qwen3VLConfig", dict(text_config=_llama_sizes(head_dim=8, rope_parameters=MROPE | dict(mrope_interleaved=True)),
                                           vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                              out_hidden_size=D_MODEL, patch_size=4, deepstack_visual_indexes=[0],
                                                              num_position_embeddings=16), **QWEN_VL_TOKENS),
                     "Qwen3VLForConditionalGeneration"),
        "t5": ("T5Config", _t5_sizes(), "T5EncoderModel"),
        "mt5": ("MT5Config", _t5_sizes(), "MT5EncoderModel"),
        "umt5": ("UMT5Config", _t5_sizes(), "UMT5EncoderModel"),
    }


FAMILIES = tuple(family_configs())


def tiny_config(model_type: str, **overrides):
    """The family's tiny config; `overrides` replace or add config values (e.g. OLMo's clip_qkv)."""
    import transformers

    config_class, options, _ = family_configs()[model_type]
    ids = dict(vocab_size=len(VOCAB), pad_token_id=0, bos_token_id=4, eos_token_id=4)
    options = options | overrides
    if "text_config" in options:  # a multimodal family: the language model takes the ids
        ids |= dict(vocab_size=len(VOCAB) + len(MULTIMODAL_TOKENS), tie_word_embeddings=False)
        options, ids = options | {"text_config": options["text_config"] | ids}, {}
    return getattr(transformers, config_class)(**options, **ids, tie_word_embeddings=False)


SHARPENED = ("Wqkv", "q_proj", "k_proj", "query.", "key.", "q_lin", "k_lin", "c_attn", "query_key_value", "qkv_proj",
             "q_norm", "k_norm", "q_layernorm", "k_layernorm", "SelfAttention.q.", "SelfAttention.k.", "attn.q.",
             "attn.k.", "Wq.", "Wk.", "query_layernorm", "key_layernorm")


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A tiny random model of the family in eval mode, with a spread of biases and norm gains (so no
    map is trivially zero or one), embeddings of EMBEDDING_STD and q/k maps of SHARPEN (sharp
    attention in every layer)."""
    import transformers

    torch.manual_seed(seed)
    sharpen = SHARPER.get(model_type, SHARPEN)
    model = getattr(transformers, family_configs()[model_type][2])(tiny_config(model_type, **overrides)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, EMBEDDING_STD)
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                parameter.add_(0.1 * torch.randn_like(parameter))
            if any(part in name for part in SHARPENED) and name.endswith("weight"):
                if "norm" in name and model_type.startswith("gemma"):  # gain 1 + weight
                    parameter.add_(sharpen - 1.0)
                elif "norm" in name:
                    parameter.mul_(sharpen)
                else:
                    parameter.normal_(0.0, sharpen / D_MODEL**0.5)
            if name.endswith("encoder.relative_attention_bias.weight") and model_type == "mpnet":
                parameter.normal_(0.0, RELATIVE_BIAS_STD)  # MPNet's bias, of the order of the logits
            if name.endswith("self_attn.sinks"):  # GPT-OSS: sinks that take a share of the softmax where logits are small
                parameter.normal_(0.0, SINK_STD)
            if "SelfAttention.q." in name:  # T5 scores with 1 and folds 1/sqrt(d_head) into W_Q, as its init does
                parameter.mul_(model.config.d_kv**-0.5)
            if model_type == "nanochat" and name.endswith("self_attn.k_proj.weight"):  # see NANOCHAT_HEAD_DIM
                parameter.copy_(model.get_parameter(name.replace("k_proj", "q_proj")))
            if name.endswith("embedding_hidden_mapping_in.weight"):  # RemBERT's projection of the embeddings: unit gain
                parameter.normal_(0.0, parameter.shape[1] ** -0.5)  # (its init's 0.02 would shrink the stream)
    return model
