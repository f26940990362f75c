"""Train a small stack of SwiGLU blocks with FSDP2 and activation checkpointing.

    torchrun --nproc_per_node=2 examples/fsdp_train.py            # CPU: gloo
    torchrun --nproc_per_node=8 examples/fsdp_train.py --bf16     # GPUs: nccl

Every block is sharded with ``fully_shard`` and so is the root (the final
norms), and each block runs under non-reentrant
``torch.utils.checkpoint``: its activations are recomputed in backward. With
CUDA the ranks use nccl and one GPU each, otherwise gloo on the CPU. Rank 0
prints the device, the backend, and the loss of every step (averaged over
ranks). The task is a regression onto a fixed random "teacher" stack, so the
loss goes down.
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

import swiglu_cupy as sc
from swiglu_cupy import cuda_kernels_available


class Model(nn.Module):
    """Pre-norm residual SwiGLU blocks, then a final norm.

    (No nn.Linear head on the root: on a 3-D input nn.Linear returns a view,
    and FSDP2 warns about a wrapped module returning a view. SwiGLU's output
    is never a view.)"""

    def __init__(self, dim, hidden, n_blocks):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(n_blocks))
        self.blocks = nn.ModuleList(sc.SwiGLU(dim, hidden) for _ in range(n_blocks))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x):
        for norm, block in zip(self.norms, self.blocks):
            # Call the module (never .forward) so FSDP2's hooks run, also in
            # the recompute during backward.
            x = x + checkpoint(block, norm(x), use_reentrant=False)
        return self.final_norm(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=172)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true",
                        help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    args = parser.parse_args()

    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --nproc_per_node=2 examples/fsdp_train.py")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
        dist.init_process_group(backend, device_id=device, timeout=datetime.timedelta(minutes=2))
    else:
        device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=2))

    torch.manual_seed(0)  # same initial weights on every rank
    teacher = Model(args.dim, args.hidden, 2).to(device).requires_grad_(False)
    model = Model(args.dim, args.hidden, args.blocks).to(device)
    kw = {}
    if args.bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)  # the root: the norms
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    if rank == 0:
        path = ("CUDA kernels (CuPy)" if device.type == "cuda" and cuda_kernels_available()
                else "torch implementation of the primitives")
        n_params = sum(p.numel() for p in model.parameters())
        print(f"swiglu-cupy {sc.__version__}: {world} rank(s), backend {backend}, device "
              f"{device.type}, elementwise path: {path}, {n_params} parameters, "
              f"FSDP2{' bf16' if args.bf16 else ''} + non-reentrant checkpointing", flush=True)

    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for step in range(args.steps):
        x = torch.randn(args.batch, args.seq, args.dim, generator=data).to(device)
        with torch.no_grad():
            target = teacher(x)
        loss = (model(x).float() - target).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step:3d}  loss {avg.item() / world:.5f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
