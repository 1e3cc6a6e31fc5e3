"""Train the tiny Llama of ttftc's quality check (examples/quality/tiny_task.py) and save it with save_pretrained.

500-1000 steps: a few minutes on a small CPU (benchmarks/README.md, tooling run times). The checked-in weights in
examples/quality/tiny_task/ came from:

    python examples/quality/train_tiny.py --out examples/quality/tiny_task
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_task  # noqa: E402


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tiny_task.VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=tiny_task.BOS, eos_token_id=tiny_task.SEP, pad_token_id=tiny_task.SEP,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "tiny_task"))
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(0)
    held_out = tiny_task.eval_batch()
    start = time.time()
    for step in range(1, args.steps + 1):
        model.train()
        batch = tiny_task.make_batch(args.batch, generator)
        logits = model(batch.ids).logits
        mask = batch.answer_mask[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1][mask], batch.ids[:, 1:][mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 250 == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                acc = tiny_task.accuracy(model(held_out.ids).logits, held_out)
            print(f"step {step:5d}  loss {loss.item():.4f}  held-out accuracy {acc:6.2f}%  ({time.time() - start:.0f} s)",
                  flush=True)
    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"saved to {args.out}: {size / 1e6:.2f} MB of weights")


if __name__ == "__main__":
    main()
