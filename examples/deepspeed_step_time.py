"""Time a DeepSpeed ZeRO-3 training step of a tiny Llama, patched with
``swiglu_cupy.patch`` against unpatched, on CPU ranks (gloo).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 examples/deepspeed_step_time.py

Both engines live in the same ranks at once and their steps are interleaved
(plain, patched, then patched, plain, ...), so load from other processes
falls on both alike. A step is forward, ``engine.backward`` and
``engine.step``, timed from a barrier to a barrier (the slower rank's time).
Besides the patched/plain ratio per round it prints the ratio of the plain
steps of neighbouring rounds with each other (an A/A comparison): how far
two runs of the *same* step disagree on this machine, the noise floor
against which the patched/plain ratio is judged.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def _config(args) -> dict:
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_model_persistence_threshold": 0},
            "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10 ** 9}


def _engine(args, patched: bool):
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    import swiglu_cupy as sc

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=args.vocab, pad_token_id=0,
        eos_token_id=1, bos_token_id=1))
    if patched:
        sc.patch(model)  # before initialize: each MLP a ZeRO-3 leaf, runs whole fused
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                      config=_config(args))
    return engine


def _timed_step(engine, ids) -> float:
    dist.barrier()
    start = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    dist.barrier()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False  # gloo, no C++ op built
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    engines = {"plain": _engine(args, False), "patched": _engine(args, True)}
    gen = torch.Generator().manual_seed(100 + rank)
    times = {name: [] for name in engines}
    for i in range(args.warmup + args.rounds):
        ids = torch.randint(2, args.vocab, (args.batch, args.seq), generator=gen)
        order = ("plain", "patched") if i % 2 == 0 else ("patched", "plain")
        for name in order:
            t = _timed_step(engines[name], ids)
            if i >= args.warmup:
                times[name].append(t)
    if rank == 0:
        plain, patched = times["plain"], times["patched"]
        ratios = [b / a for a, b in zip(plain, patched)]
        null = [b / a for a, b in zip(plain[::2], plain[1::2])]  # plain vs plain, neighbouring rounds

        def spread(xs):
            q = statistics.quantiles(xs, n=4)
            return f"median {statistics.median(xs):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"
        print(f"config: {vars(args)} world {dist.get_world_size()} torch {torch.__version__} "
              f"deepspeed {deepspeed.__version__}")
        for name, xs in times.items():
            ms = [1e3 * x for x in xs]
            q = statistics.quantiles(ms, n=4)
            print(f"{name:8s} step ms: median {statistics.median(ms):.2f} quartiles {q[0]:.2f}-{q[2]:.2f} "
                  f"min {min(ms):.2f} max {max(ms):.2f} (n={len(ms)})")
        print(f"patched/plain per round: {spread(ratios)}")
        print(f"plain/plain (A/A noise): {spread(null)}")
    for engine in engines.values():
        engine.destroy()


if __name__ == "__main__":
    main()
