"""Build small transformers models from a config, offline (no hub download)."""

from __future__ import annotations

import os
from typing import Any

from ..jsonfile import read_json

# tiny-* presets are sized so a forward+backward of a few thousand tokens takes tens of ms on 2 CPU
# cores; llama-350m is for a GPU.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=8192,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    # A real Llama shape (~375M parameters, TinyLlama/OpenLLaMA-style widths) for GPU profiles.
    "llama-350m": dict(
        model_type="llama",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    # an encoder-decoder (T5 v1.0: relu feed-forward, tied embeddings) for the (input, target) pair
    # runtime; "feed_forward_proj": "gated-gelu" with tie_word_embeddings false is T5 v1.1's variant
    "tiny-t5": dict(
        model_type="t5",
        d_model=64,
        d_kv=16,
        d_ff=256,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        vocab_size=8192,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    ),
    "tiny-gpt2": dict(
        model_type="gpt2",
        n_embd=128,
        n_layer=4,
        n_head=4,
        vocab_size=8192,
        n_positions=8192,
        bos_token_id=0,
        eos_token_id=0,
    ),
}


def load_model_config(spec: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    """A preset name, a path to a HF ``config.json``, or a dict; always has ``model_type``."""
    if isinstance(spec, dict):
        cfg = dict(spec)
    elif str(spec) in PRESETS:
        cfg = dict(PRESETS[str(spec)])
    elif os.path.exists(spec):
        cfg = read_json(spec, "model config")
        if not isinstance(cfg, dict):
            raise ValueError(f"model config {spec}: expected a JSON object (a transformers config.json)")
    else:
        raise ValueError(f"model {spec!r}: not a preset ({', '.join(PRESETS)}) and no such config file")
    if "model_type" not in cfg:
        raise ValueError(f"model config {spec!r} has no 'model_type' (e.g. 'llama' or 'gpt2')")
    return cfg


def hf_config(cfg: dict[str, Any], num_layers: int | None = None):
    """The transformers config of a config dict (``model_type`` and overrides), for training: no
    key/value cache; ``num_layers`` overrides the depth."""
    from transformers import AutoConfig

    cfg = dict(cfg)
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if num_layers is not None:
        hf_cfg.num_hidden_layers = num_layers
    hf_cfg.use_cache = False
    return hf_cfg


def build_causal_lm(cfg: dict[str, Any], num_layers: int | None = None, attn_implementation: str | None = None):
    """A randomly initialised ``AutoModelForCausalLM`` in fp32 from a config dict.

    ``num_layers`` overrides the depth (the profiler builds two depths to separate per-layer cost).
    ``attn_implementation`` defaults to the plugin's per-document kernel, which keeps packed
    documents isolated with a cost of sum(s_i^2).
    """
    from transformers import AutoModelForCausalLM

    from .varlen_attention import register

    hf_cfg = hf_config(cfg, num_layers)
    model_type = hf_cfg.model_type
    if hf_cfg.is_encoder_decoder:
        raise ValueError(
            f"{model_type} is an encoder-decoder: build it with build_seq2seq_lm and train it on (input, target) "
            "pairs; the causal-LM paths (profiler, pipelines, Megatron) do not take it"
        )
    if attn_implementation is None:
        model_class = AutoModelForCausalLM._model_mapping[type(hf_cfg)]
        if not getattr(model_class, "_supports_attention_backend", False):
            # such classes hard-code their attention; the registered name would fail deep inside
            # transformers (a KeyError), or packed documents would attend across each other
            raise ValueError(
                f"{model_type} ({model_class.__name__}) does not route attention through transformers' "
                "AttentionInterface (_supports_attention_backend is false), so the plugin's per-document kernel "
                "(dyn_varlen) cannot run it; build it with attn_implementation='sdpa' and plan padded rows "
                "(microbatching.layout 'padded'), or train a family that supports attention backends"
            )
    hf_cfg._attn_implementation = attn_implementation or register()
    return AutoModelForCausalLM.from_config(hf_cfg)


def is_encoder_decoder(model: Any) -> bool:
    """Whether a model is an encoder-decoder (T5 and kin): it trains on (input, target) pairs."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def build_seq2seq_lm(cfg: dict[str, Any]):
    """A randomly initialised ``AutoModelForSeq2SeqLM`` (T5 and kin) in fp32 from a config dict:
    it takes micro-batches of (input, target) pairs (``dyn_plugin.runtime.collate_pairs``) and
    runs transformers' own attention (T5 does not route attention through its backends)."""
    from transformers import AutoModelForSeq2SeqLM

    hf_cfg = hf_config(cfg)
    if not hf_cfg.is_encoder_decoder:
        raise ValueError(f"{hf_cfg.model_type} is not an encoder-decoder; build it with build_causal_lm")
    return AutoModelForSeq2SeqLM.from_config(hf_cfg)
