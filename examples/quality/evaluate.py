"""Task accuracy of the checked-in tiny model (examples/quality/tiny_task/) in auto, fp32, bf16 and int8 through ttftc.

    python examples/quality/evaluate.py [--model examples/quality/tiny_task] [--size 512]

Prints eager fp32 accuracy and, per precision, the accuracy of the ttftc-compiled model and its logits cosine
against eager fp32. tests/quality/test_tiny_task.py asserts on the same numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_task  # noqa: E402

import ttftc  # noqa: E402

MODEL_DIR = HERE / "tiny_task"


def load_model(path: Path = MODEL_DIR):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa").eval()


def evaluate(model, precision: str | None, batch: tiny_task.Batch) -> tuple[float, torch.Tensor]:
    """(accuracy %, logits) for eager fp32 (precision None) or ttftc at `precision`."""
    torch._dynamo.reset()
    with torch.no_grad():
        if precision is None:
            logits = model(batch.ids).logits
        else:
            compiled = torch.compile(model, backend=ttftc.backend(ttftc.Config(precision=precision)))
            logits = compiled(batch.ids).logits
    return tiny_task.accuracy(logits, batch), logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODEL_DIR))
    parser.add_argument("--size", type=int, default=512)
    args = parser.parse_args()
    model = load_model(Path(args.model))
    batch = tiny_task.eval_batch(args.size)
    eager_acc, eager_logits = evaluate(model, None, batch)
    print(f"{'eager fp32':<14} accuracy {eager_acc:7.3f}%")
    for precision in ("auto", "fp32", "bf16", "int8"):
        acc, logits = evaluate(model, precision, batch)
        cos = torch.nn.functional.cosine_similarity(logits.double().flatten(), eager_logits.double().flatten(), dim=0)
        print(f"ttftc {precision:<8} accuracy {acc:7.3f}%  (Δ {acc - eager_acc:+.3f} points)  logits cosine {cos:.5f}")


if __name__ == "__main__":
    main()
