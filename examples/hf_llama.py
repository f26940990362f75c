"""A small Hugging Face Llama (random weights, built from a config) trained for a
few steps with and without swiglu_cupy's fused MLPs: speed, memory, losses.

    pip install -e ".[hf]"            # plus [cuda12] or [cuda13] on a GPU
    python examples/hf_llama.py [--steps 10] [--checkpointing] [--cpu] [--order before]

Runs on CUDA when available (bfloat16), else on the CPU (float32, a smaller
model). Nothing is downloaded.
"""
import argparse
import copy
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import swiglu_cupy as sc
from swiglu_cupy import cuda_kernels_available
from swiglu_cupy.hf import SwiGLUMLP, apply_to, patch_model, unapply


def build(device: str) -> LlamaForCausalLM:
    if device == "cuda":
        dims = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4)
    else:
        dims = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2)
    config = LlamaConfig(vocab_size=4096, max_position_embeddings=1024, use_cache=False, **dims)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def train(model, batches, checkpointing: bool):
    """Returns (losses, median ms per step after the first, peak CUDA memory or None)."""
    device = batches[0].device
    if checkpointing:  # renamed activation_checkpointing_enable in newer transformers
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for ids in batches:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())  # .item() synchronizes
        times.append(time.perf_counter() - start)
    # The first step compiles kernels and allocates the optimizer state; the
    # median of the others is robust to a busy machine.
    ms = 1000 * statistics.median(times[1:] or times)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return losses, ms, peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even if CUDA is there")
    parser.add_argument("--order", choices=["after", "before"], default="after",
                        help="patch the built model (after) or the Llama classes before building it (before)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    path = ("CUDA kernels (CuPy)" if device == "cuda" and cuda_kernels_available()
            else f"torch implementation on {device}")
    unpatched = build(device)
    if args.order == "after":
        patched = copy.deepcopy(unpatched)
        n = patch_model(patched, strict=True)
    else:
        apply_to("llama")  # LlamaMLP is now the fused subclass: the model is built fused
        try:
            patched = build(device)  # same seed: same weights
        finally:
            unapply("llama")
        n = sum(isinstance(m, SwiGLUMLP) for m in patched.modules())
    batch, seq = (8, 512) if device == "cuda" else (4, 128)
    # Learnable synthetic data: each row repeats a random 16-token phrase.
    gen = torch.Generator().manual_seed(0)
    vocab = unpatched.config.vocab_size
    batches = [torch.randint(0, vocab, (batch, 16), generator=gen).repeat(1, seq // 16).to(device)
               for _ in range(args.steps)]
    print(f"swiglu-cupy {sc.__version__}, transformers Llama with {n} MLPs patched ({args.order} "
          f"building); device {device}, "
          f"dtype {unpatched.dtype}, batch {batch}x{seq}, elementwise path: {path}")

    results = {}
    for name, model in (("unpatched", unpatched), ("patched", patched)):
        results[name] = train(model, batches, args.checkpointing)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, (losses, ms, peak) in results.items():
        mem = f"{peak / 2**20:8.1f} MiB peak" if peak is not None else "memory not measured on CPU"
        print(f"{name:>9}: {ms:8.1f} ms/step, {mem}, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    diff = max(abs(a - b) for a, b in zip(results["patched"][0], results["unpatched"][0]))
    print(f"max loss difference over {args.steps} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
