"""The main module of a process spawned from a Megatron-LM run where triton is missing.

``multiprocessing``'s spawn start method runs the parent's main script in the child, as
``__mp_main__``, before anything else (functions pickled by reference to ``__main__`` resolve
there). ``pretrain_gpt.py`` imports ``megatron.training``, which imports a megatron-core module that
needs triton at import time; the CPU shims (``megatron_patches.cpu``) make spawned children import
this module instead: it puts the same stand-in in place, then runs the script as spawn would have.
"""

import os
import runpy

from megatron_patches.cpu import SPAWN_MAIN, stub_triton_kernels

stub_triton_kernels()
globals().update(runpy.run_path(os.environ[SPAWN_MAIN], run_name="__mp_main__"))
