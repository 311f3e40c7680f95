"""T5 on packed (input, target) pairs: several whole pairs per row, trained exactly as each pair alone.

A packed micro-batch (``runtime.collate_pairs.collate_pairs``, layout "packed") holds, per row, the inputs
of its pairs back to back in one encoder row and their targets, in the same order, in one decoder
row; ``input_segments`` / ``target_segments`` name each token's pair (its place in the row, -1 on
padding). What makes a row compute what its pairs compute alone:

- encoder self-attention within each input, decoder causal self-attention within each target,
  cross-attention from each target to its own input only (additive block masks, 4-D, which
  transformers' mask builders pass through as they are);
- the decoder's inputs shifted right per target: the decoder start token at each target's first
  position, where the shift of the whole row (``_shift_right``) would put the previous target's last
  token;
- T5's relative position bias is ``compute_bias(q, k)`` over positions in the row: it depends on
  ``key position - query position`` only, which a pair's tokens keep when the pair is moved along
  the row, and every pair of tokens from different pairs is masked off; cross-attention has no
  position bias (zeros). So every attention weight that is not masked sees the bias it sees alone;
- labels -100 on padding, and the loss is the model's own mean over every label not -100: the mean
  over all target tokens of the micro-batch, as for padded pairs.

transformers' ``T5ForConditionalGeneration.forward`` passes one ``attention_mask`` to the encoder and
to the cross-attention, so the encoder is run here with its own mask, and everything after it (the
decoder, the ``scale_decoder_outputs`` rescaling of tied embeddings, the LM head, the loss) by that
same forward with ``encoder_outputs`` given: the code that runs the pairs alone, with the output
rescaled (T5) or not (T5 v1.1's config; transformers 5 keeps its head tied either way) alike. The encoder runs inside the model's call (a forward pre-hook held for that
call only), so the host's wrapper sees one forward as for any micro-batch: DeepSpeed's engine
fetches ZeRO-3 partitions in its module hooks and hooks its backward prologue on the output.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# relative position biases (T5's family): a pair's attention is the same anywhere in a row
PACKABLE_MODEL_TYPES = ("t5", "mt5")
MASKED_ATTENTION = ("eager", "sdpa")  # those that add a float 4-D mask to the scores


def check_packable(model: torch.nn.Module) -> None:
    """Refuse a model whose pairs would not compute the same packed: positions that are not
    relative, or an attention kernel that takes no additive 4-D mask."""
    cfg = model.config
    if cfg.model_type not in PACKABLE_MODEL_TYPES:
        raise ValueError(
            f"{cfg.model_type} cannot train on packed pairs: only T5's relative position bias leaves a pair's "
            f"attention unchanged along a row (model types {', '.join(PACKABLE_MODEL_TYPES)}); train it on padded pairs"
        )
    if cfg._attn_implementation not in MASKED_ATTENTION:
        raise ValueError(
            f"attn_implementation {cfg._attn_implementation!r} cannot train on packed pairs: the per-pair block masks "
            f"are additive 4-D masks, which {' and '.join(MASKED_ATTENTION)} take; build the model with one of them"
        )
    if cfg.decoder_start_token_id is None or cfg.pad_token_id is None:
        raise ValueError(
            f"{cfg.model_type}'s config needs decoder_start_token_id and pad_token_id to shift each target right"
        )


def pair_forward(call: Callable[..., Any], model: torch.nn.Module) -> Callable[..., Any]:
    """A host's forward for an encoder-decoder: ``call(**batch)`` (the host's wrapper around
    ``model``: DeepSpeed's engine, or the model) for padded pairs, and ``packed_pair_forward``
    through the same ``call`` for a packed micro-batch (it carries ``input_segments``)."""

    def forward(**batch: Any) -> Any:
        if "input_segments" in batch:
            return packed_pair_forward(call, model, **batch)
        return call(**batch)

    return forward


def packed_pair_forward(
    call: Callable[..., Any],
    model: torch.nn.Module,
    *,
    packed_input_ids: torch.Tensor,
    input_segments: torch.Tensor,
    labels: torch.Tensor,
    target_segments: torch.Tensor,
    **kwargs: Any,
) -> Any:
    """The model's output (``.loss``: the mean over every target token) on a packed micro-batch:
    [rows, Se] input ids and segments, [rows, Sd] labels and segments. ``call`` runs ``model`` (its
    wrapper, or the model itself); ``kwargs`` go to the model's forward (e.g. ``use_cache``)."""
    check_packable(model)
    if packed_input_ids.shape != input_segments.shape or labels.shape != target_segments.shape:
        raise ValueError(
            f"packed pairs: input ids {tuple(packed_input_ids.shape)} and input segments {tuple(input_segments.shape)}, "
            f"labels {tuple(labels.shape)} and target segments {tuple(target_segments.shape)} must match"
        )
    dtype = model.dtype
    same_input = input_segments[:, :, None] == input_segments[:, None, :]
    same_target = target_segments[:, :, None] == target_segments[:, None, :]
    causal = torch.ones(labels.shape[1], labels.shape[1], dtype=torch.bool, device=labels.device).tril()
    encoder_mask = _additive(same_input, dtype)
    decoder_mask = _additive(same_target & causal, dtype)
    # padding targets (segment -1) see the input's padding, or nothing: their outputs are never scored
    # nor attended by a real token, and a row masked whole softmaxes to finite values
    cross_mask = _additive(target_segments[:, :, None] == input_segments[:, None, :], dtype)

    def encode(module: torch.nn.Module, args: tuple, inputs: dict) -> tuple[tuple, dict]:
        encoded = module.encoder(input_ids=packed_input_ids, attention_mask=encoder_mask)
        return args, {**inputs, "encoder_outputs": encoded}

    handle = model.register_forward_pre_hook(encode, with_kwargs=True)
    try:
        return call(
            attention_mask=cross_mask,  # the forward passes it to the cross-attention only: the encoder has run
            decoder_input_ids=shift_targets(labels, target_segments, model.config),
            decoder_attention_mask=decoder_mask,
            labels=labels,
            **kwargs,
        )
    finally:
        handle.remove()


def shift_targets(labels: torch.Tensor, target_segments: torch.Tensor, config: Any) -> torch.Tensor:
    """The decoder's inputs: ``_shift_right`` of each target on its own (the decoder start token at
    its first position, then its tokens but the last; -100 read as the pad id)."""
    starts = torch.ones_like(target_segments, dtype=torch.bool)
    starts[:, 1:] = target_segments[:, 1:] != target_segments[:, :-1]
    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted = shifted.masked_fill(starts, config.decoder_start_token_id)
    return shifted.masked_fill(shifted == -100, config.pad_token_id)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 1, q, k] scores to add: 0 where allowed, the dtype's minimum elsewhere (as transformers'
    own float masks: finite, so a query with no key allowed gets no NaN)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
