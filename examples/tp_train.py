"""Train a small stack of SwiGLU blocks with tensor parallel x FSDP2 (2-D).

    torchrun --nproc_per_node=4 examples/tp_train.py              # CPU: gloo, dp=2 x tp=2
    torchrun --nproc_per_node=8 examples/tp_train.py --tp 4       # GPUs: nccl, dp=2 x tp=4

The ranks form a (dp, tp) mesh. Every block is split over "tp" with
``SwiGLUTensorParallel`` (each rank holds the gate and up rows of its slice
of the hidden units, and the matching columns of w3), then sharded over "dp"
with FSDP2 (``fully_shard`` with ``fsdp_shard_placement``); the root (the
norms) is sharded over "dp". The tp ranks of one dp group read the same
batch. Rank 0 prints the setup and the loss of every step (averaged over dp
groups); the task is a regression onto a fixed random "teacher" stack, so
the loss goes down. At the end the model is saved with
``torch.distributed.checkpoint`` (``--save DIR``) in the canonical layout of
an unparallelized model.
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import swiglu_cupy as sc
from swiglu_cupy import cuda_kernels_available
from swiglu_cupy.parallel import SwiGLUTensorParallel, fsdp_shard_placement


class Model(nn.Module):
    """Pre-norm residual SwiGLU blocks, then a final norm."""

    def __init__(self, dim, hidden, n_blocks):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(n_blocks))
        self.blocks = nn.ModuleList(sc.SwiGLU(dim, hidden) for _ in range(n_blocks))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x):
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        return self.final_norm(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (divides the world size)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=172)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per dp group")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save", default=None, help="directory for a DCP checkpoint at the end")
    args = parser.parse_args()

    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --nproc_per_node=4 examples/tp_train.py")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % args.tp:
        parser.error(f"--tp {args.tp} must divide the number of ranks {world}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
        dist.init_process_group(backend, device_id=device, timeout=datetime.timedelta(minutes=2))
    else:
        device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=2))
    dp = world // args.tp
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # same initial weights on every rank
    teacher = Model(args.dim, args.hidden, 2).to(device).requires_grad_(False)
    model = Model(args.dim, args.hidden, args.blocks).to(device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], SwiGLUTensorParallel())  # raises if tp does not divide H
        # without shard_placement_fn, the first forward raises: FSDP2's default
        # dim-0 split of the packed w12 would make full_tensor() permuted
        fully_shard(block, mesh=mesh["dp"], shard_placement_fn=fsdp_shard_placement)
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    if rank == 0:
        path = ("CUDA kernels (CuPy)" if device.type == "cuda" and cuda_kernels_available()
                else "torch implementation of the primitives")
        local = model.blocks[0].w12.weight.to_local().shape
        print(f"swiglu-cupy {sc.__version__}: {world} ranks = dp {dp} x tp {args.tp}, backend {backend}, "
              f"elementwise path: {path}; block 0 w12 local shard {tuple(local)} of "
              f"{(2 * args.hidden, args.dim)}", flush=True)

    data = torch.Generator().manual_seed(1000 + mesh["dp"].get_local_rank())  # one batch per dp group
    for step in range(args.steps):
        x = torch.randn(args.batch, args.seq, args.dim, generator=data).to(device)
        with torch.no_grad():
            target = teacher(x)
        loss = (model(x).float() - target).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)  # every tp rank of a dp group holds the same loss
        if rank == 0:
            print(f"step {step:3d}  loss {avg.item() / world:.5f}", flush=True)

    if args.save:
        dcp.save(model.state_dict(), checkpoint_id=args.save)
        if rank == 0:
            print(f"saved a DCP checkpoint to {args.save} (canonical layout, e.g. blocks.0.w12.weight "
                  f"{(2 * args.hidden, args.dim)})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
