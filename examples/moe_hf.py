"""Tiny Hugging Face MoE models (Mixtral, GPT-OSS; random weights from a
config) with their experts switched to swiglu_cupy's fused op, trained a few
steps with gradient checkpointing next to an unpatched copy (HF's grouped_mm
experts): losses, logits parity and the bytes the experts save for backward.

    pip install -e ".[hf]"            # plus [cuda12] or [cuda13] on a GPU
    python examples/moe_hf.py [--steps 5]

Runs on the CPU in float32 (nothing is downloaded). Uses only public API:
``swiglu_cupy.hf_experts`` and transformers / torch.
"""
import argparse
import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from swiglu_cupy.hf_experts import experts_plan, is_hf_experts, patch_experts

# Tiny sizes (hidden 64, 4 experts, top-2). The clamp limit of GPT-OSS is
# small so that the tiny activations actually cross it.
COMMON = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=97, pad_token_id=0, eos_token_id=1, bos_token_id=1)
FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                    swiglu_limit=0.1),
}


def tiny_model(family: str, seed: int = 0):
    config = AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.set_experts_implementation("grouped_mm")   # the reference: HF's own grouped_mm experts
    return model


def experts_modules(model):
    return [m for m in model.modules() if is_hf_experts(m)]


def experts_call_inputs(model, ids):
    """What the first experts module receives in a forward of ``ids``:
    (hidden_states, top_k_index, top_k_weights)."""
    seen = []
    handle = experts_modules(model)[0].register_forward_hook(
        lambda module, args, out: seen.append(tuple(a.detach() for a in args)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen[0]


def saved_bytes(module, hidden, top_k_index, top_k_weights) -> int:
    """Bytes autograd saves for backward in one call of ``module``, each
    storage counted once, the module's parameters left out (they are saved by
    reference, not as activations)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    h = hidden.clone().requires_grad_(True)
    w = top_k_weights.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(h, top_k_index, w)
    return sum(storages.values())


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
    batches = [torch.randint(2, COMMON["vocab_size"], (4, 32), generator=gen) for _ in range(args.steps)]
    for family in FAMILIES:
        reference = tiny_model(family)
        fused = copy.deepcopy(reference)
        n = patch_experts(fused)   # hf.patch_model(model) and swiglu_cupy.patch(model) do this too
        plans = {str(experts_plan(m).activation) for m in experts_modules(fused)}

        ids = batches[0]
        with torch.no_grad():
            ref_logits = reference(ids).logits
            rel = ((fused(ids).logits - ref_logits).norm() / ref_logits.norm()).item()

        # Saved bytes: the same routed inputs into the first experts module of each model.
        inputs = experts_call_inputs(reference, torch.randint(2, COMMON["vocab_size"], (1, 64), generator=gen))
        ours = saved_bytes(experts_modules(fused)[0], *inputs)
        theirs = saved_bytes(experts_modules(reference)[0], *inputs)

        ref_losses, fused_losses = train(reference, batches), train(fused, batches)
        print(f"{family}: {n} experts modules fused ({', '.join(sorted(plans))}); logits vs HF grouped_mm: "
              f"relative error {rel:.1e}")
        print(f"  losses HF grouped_mm: {' '.join(f'{x:.4f}' for x in ref_losses)}")
        print(f"  losses swiglu_cupy:   {' '.join(f'{x:.4f}' for x in fused_losses)}")
        print(f"  saved for backward in one experts call ({inputs[1].numel()} routed rows): ours {ours} "
              f"bytes, HF grouped_mm {theirs} bytes ({ours / theirs:.2f}x)")


if __name__ == "__main__":
    main()
