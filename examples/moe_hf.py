"""Tiny Hugging Face MoE models (Mixtral, GPT-OSS; random weights from a
config) with their experts switched to swiglu_cupy's fused op, trained a few
steps with gradient checkpointing next to an unpatched copy (HF's grouped_mm
experts): losses, logits parity and the bytes the experts save for backward.

    pip install -e ".[hf]"            # plus [cuda12] or [cuda13] on a GPU
    python examples/moe_hf.py [--steps 5]

Runs on the CPU in float32 (nothing is downloaded).
"""
import argparse
import copy

import torch

from swiglu_cupy.bench.moe import family_memory, tiny_model
from swiglu_cupy.hf_experts import experts_plan, patch_experts


def train(model, batches):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, 97, (4, 32), generator=gen) for _ in range(args.steps)]
    for family in ("mixtral", "gpt_oss"):
        reference = tiny_model(family)
        fused = copy.deepcopy(reference)
        n = patch_experts(fused)   # hf.patch_model(model) does this too
        plans = {str(experts_plan(m).activation) for m in fused.modules() if "_swiglu_cupy_plan" in m.__dict__}
        with torch.no_grad():
            ids = batches[0]
            rel = ((fused(ids).logits - reference(ids).logits).norm() / reference(ids).logits.norm()).item()
        ref_losses, fused_losses = train(reference, batches), train(fused, batches)
        mem = family_memory(family)
        print(f"{family}: {n} experts modules fused ({', '.join(sorted(plans))}); logits vs HF grouped_mm: "
              f"relative error {rel:.1e}")
        print(f"  losses HF grouped_mm: {' '.join(f'{x:.4f}' for x in ref_losses)}")
        print(f"  losses swiglu_cupy:   {' '.join(f'{x:.4f}' for x in fused_losses)}")
        print(f"  saved for backward in one experts call ({mem['routed_rows']} routed rows): ours {mem['swiglu_cupy']} "
              f"bytes, HF grouped_mm {mem['grouped_mm']} bytes ({mem['swiglu_cupy'] / mem['grouped_mm']:.2f}x)")


if __name__ == "__main__":
    main()
