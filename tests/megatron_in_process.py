"""megatron-core in this process, on gloo with one rank, for tests that build its modules directly:
the patches a test needs applied (and reverted after), model parallelism of one, and the tiny GPT
(RMSNorm, GQA 4 heads / 2 groups, SwiGLU, RoPE) built from megatron-core's local layer spec."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_patches.cpu import cpu_patches
from megatron_patches.registry import Patch, Registry
from ranks import free_port

VOCAB = 100


@contextlib.contextmanager
def in_process(patches: list[Patch] = ()) -> Iterator[None]:
    """megatron-core initialised on one gloo rank, the CPU patches and ``patches`` applied."""
    # imported before the patch so that the patch rebinds, and its revert restores, their from-imported
    # names (a module first imported while a patch is on keeps the patched object after the revert)
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.models.gpt.gpt_model  # noqa: F401

    registry = Registry()
    for patch in [*cpu_patches(), *patches]:
        registry.register(patch)
    registry.apply()
    initialized_here = not dist.is_initialized()
    if initialized_here:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if initialized_here:
            dist.destroy_process_group()
        registry.revert()


def config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt(core_attention: type | None = None):
    """The tiny GPT (RMSNorm, GQA 4 heads / 2 groups, SwiGLU, RoPE); its spec is built after the patch."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if core_attention is not None:
        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = core_attention
    torch.manual_seed(0)
    return GPTModel(
        config=config(),
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
    )
