"""On a GPU: the flash varlen path of dyn_varlen attention against its per-document SDPA loop,
forward and gradients, bf16, packed and padded rows. Exits non-zero past the tolerance."""

import sys

import torch

from dyn_plugin.models import varlen_attention as va


def attend(q, k, v, pos, flash: bool):
    saved = va.varlen_attn
    if not flash:
        va.varlen_attn = None  # the per-document loop
    try:
        module = torch.nn.Module().train()
        return va.varlen_attention(module, q, k, v, None, scaling=q.shape[-1] ** -0.5, position_ids=pos)[0]
    finally:
        va.varlen_attn = saved


def main() -> int:
    torch.manual_seed(0)
    worst = 0.0
    for lens, rows in (([700, 31, 1500, 9, 809], 1), ([512], 3)):
        s = sum(lens)
        pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).cuda()
        q, k, v = (
            torch.randn(rows, 16, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        outs = []
        for flash in (True, False):
            for t in (q, k, v):
                t.grad = None
            out = attend(q, k, v, pos if rows == 1 else None, flash)
            out.float().square().sum().backward()
            outs.append([out.detach().float()] + [t.grad.float() for t in (q, k, v)])
        for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
            err = float((a - b).abs().max() / b.abs().max())
            worst = max(worst, err)
            print(f"rows={rows} docs={len(lens)} {name}: max error {err:.4f} of the largest value")
    print(f"flash varlen vs per-document loop: worst relative error {worst:.4f}")
    return 0 if worst < 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
