"""The training demo (``make demo``'s main job): a small Llama trained with DeepSpeed on 2 CPU
ranks with padded, token-budget, packed and plugin batching side by side.

    torchrun --nproc_per_node=2 examples/deepspeed_llama/train.py --profile out/profile.json --out out/train

The code lives in deepspeed_ext/compare.py, so ``dynplugin bench train`` runs the same thing.
"""
from deepspeed_ext.compare import main

if __name__ == "__main__":
    main()
