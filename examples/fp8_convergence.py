"""Does saving x12 in 8 bits change training? A tiny Llama (transformers'
LlamaForCausalLM, 2 layers) learns a fixed synthetic corpus under bf16
autocast on the CPU, patched with swiglu_cupy's default (x12 saved in bf16)
and with ``saved_x12="fp8"``, three seeds each; prints the final losses and
draws the loss curves.

    python examples/fp8_convergence.py [--steps 150] [--out fp8_convergence.png]

``tests/test_fp8_convergence.py`` runs ``compare()`` and checks the 8-bit runs
end within the spread of the default's seeds.
"""
from __future__ import annotations

import argparse

import torch

import swiglu_cupy as sc

VOCAB, SEQ, BATCH, SUCCESSORS = 256, 64, 8, 4
SEEDS = (0, 1, 2)
STEPS = 150
TAIL = 10  # the final loss: the mean of the last TAIL steps (one step's loss is noisy)


def corpus(n_sequences: int = 1024) -> torch.Tensor:
    """A fixed corpus [n, SEQ]: walks of an order-1 Markov chain in which each
    token has SUCCESSORS equally likely successors (entropy log 4 ~ 1.39 nats,
    against log 256 ~ 5.55 for a uniform guess). The same for every run."""
    gen = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, VOCAB, (VOCAB, SUCCESSORS), generator=gen)
    tokens = torch.empty(n_sequences, SEQ, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n_sequences,), generator=gen)
    for t in range(1, SEQ):
        pick = torch.randint(0, SUCCESSORS, (n_sequences,), generator=gen)
        tokens[:, t] = successors[tokens[:, t - 1], pick]
    return tokens


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         hidden_act="silu", tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def train(saved_x12, seed: int, steps: int = STEPS) -> list[float]:
    """Loss per step of one run: the seed sets the initial weights; the batches
    come in the same order in every run."""
    model = tiny_llama(seed)
    report = sc.patch(model, saved_x12=saved_x12)
    assert len(report.fused) == model.config.num_hidden_layers, str(report)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data = corpus()
    losses = []
    for step in range(steps):
        rows = torch.arange(step * BATCH, (step + 1) * BATCH) % data.shape[0]
        batch = data[rows]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def final_loss(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / TAIL


def compare(steps: int = STEPS, seeds=SEEDS) -> dict:
    """{mode: {seed: losses}} for the default (None) and "fp8"."""
    torch.set_num_threads(1)  # repeatable timings and no oversubscription on small machines
    return {mode: {seed: train(saved_x12, seed, steps) for seed in seeds}
            for mode, saved_x12 in (("default", None), ("fp8", "fp8"))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", default="fp8_convergence.png", help="the plot (needs matplotlib)")
    args = parser.parse_args()
    runs = compare(args.steps)
    for mode, by_seed in runs.items():
        finals = ", ".join(f"seed {s}: {final_loss(l):.4f}" for s, l in by_seed.items())
        print(f"{mode:8s} final loss (mean of the last {TAIL} steps) {finals}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not importable")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, style in (("default", "-"), ("fp8", "--")):
        for seed, losses in runs[mode].items():
            ax.plot(losses, style, lw=1, label=f"{mode} seed {seed}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title("tiny Llama, bf16 autocast: x12 saved in bf16 (default) vs fp8 e4m3")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
