"""The attention pass and the bucketing plan read a mask with one prover: an fp16 model's mask, filled with
float16's most negative value (-65504), gets the same verdict from both."""

import pytest
import torch

import ttftc
from ttftc.buckets.capture import analyse_padding
from ttftc.dynamo_backend import TtftcBackend

FP16_MIN = torch.finfo(torch.float16).min  # -65504


class _Fp16Attention(torch.nn.Module):
    """token ids -> embeddings -> eager attention whose hidden scores are `fill` where `hidden(i, j)` -> head."""

    def __init__(self, hidden, fill):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 32)
        self.hidden, self.fill = hidden, fill
        self.half()

    def forward(self, input_ids, position_ids=None):
        x = self.embed(input_ids)
        b, n = x.shape[0], x.shape[1]
        q = x.view(b, n, 2, 8).transpose(1, 2)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        scores = (q @ q.transpose(-1, -2) * 0.25).masked_fill(self.hidden(i, j), self.fill)
        probs = torch.softmax(scores, dim=-1)
        return self.head((probs @ q).transpose(1, 2).reshape(b, n, 16))


def _attention_pass_fuses(model) -> tuple[bool, list[str]]:
    backend = TtftcBackend(ttftc.Config(passes=("attention",), dynamic_shapes="dynamo"))
    ids = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids)
    report = backend.report()
    return report.pass_counts.get("attention", 0) == 1, report.rejections.get("attention", [])


@pytest.mark.parametrize("hidden, fill, proven, pass_reason, plan_reason", [
    # causal, with the fp16 "minus infinity"
    (lambda i, j: j > i, FP16_MIN, True, None, None),
    # causal, but -60000 does not mask: it shifts the scores
    (lambda i, j: j > i, -60000.0, False, "masked_fill on the scores with a value that does not mask",
     "no causal mask is applied to the scores"),
    # the wrong way round: every query sees the later keys
    (lambda i, j: j < i, FP16_MIN, False, "the mask is neither causal nor a sliding window",
     "is not proven causal (the mask is neither causal nor a sliding window"),
], ids=["causal-fp16-min", "causal-not-masking", "anti-causal-fp16-min"])
def test_an_fp16_mask_gets_one_verdict_from_the_attention_pass_and_the_bucketing_plan(
        hidden, fill, proven, pass_reason, plan_reason):
    model = _Fp16Attention(hidden, fill).eval()
    fused, rejections = _attention_pass_fuses(model)
    plan = analyse_padding(model, (16, 32), torch.device("cpu"))
    assert fused is proven, rejections
    assert plan.safe is proven, plan.reason
    if not proven:
        assert any(pass_reason in r for r in rejections), rejections
        assert plan_reason in plan.reason, plan.reason
