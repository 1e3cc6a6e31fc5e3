"""The zoo end to end on the device through both code generators, against eager's logits and first token; an AOT
artifact built on CPU and loaded on the device.

On a GPU every core family runs in fp32 (logits within 1e-3 of eager's scale, the same first token) and Llama in
bf16 as well (cosine similarity with eager's bf16 logits >= 0.99; the first token is recorded, not asserted: random
weights give nearly flat logits, where bf16 rounding can swap the top two). In the CPU dry run one family runs, in fp32,
with one layer, under the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

import ttftc
from tests.gpu import shapes
from ttftc import zoo

CODEGENS = ("eager", "inductor")
# On a GPU: every core family in fp32, Llama in bf16 too (each case compiles a model twice: minutes in all).
CASES = ([(f, torch.float32) for f in zoo.CORE_FAMILIES] + [("llama", torch.bfloat16)] if shapes.on_gpu()
         else [("llama", torch.float32)])


def _model(family: str, dtype: torch.dtype, device: torch.device):
    layers = {} if shapes.on_gpu() else {"num_hidden_layers": 1}
    return zoo.build(family, "sdpa", dtype=dtype, **layers).to(device)


@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("family,dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_zoo_through_the_triton_kernels_matches_eager(device, record, family, codegen, dtype):
    pytest.importorskip("transformers")
    model = _model(family, dtype, device)
    ids = zoo.example_ids(model, 24).to(device)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    backend = ttftc.backend(ttftc.Config(provider="triton", codegen=codegen, precision=precision))
    # A graph Inductor loads from its FX graph cache skips ttftc's post-grad pass, which fills the report.
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        expected = model(ids).logits
        actual = torch.compile(model, backend=backend)(ids).logits
    providers = backend.report().providers
    assert providers.get("attention", {}).get("triton"), f"attention did not run the Triton kernel: {providers}"
    same_token = bool(torch.equal(actual[:, -1].argmax(-1), expected[:, -1].argmax(-1)))
    case = f"{family} codegen={codegen}"
    record.write(kernel="zoo first token", case=case, dtype=precision, same_first_token=same_token)
    if dtype == torch.float32:
        record(actual, expected, kernel="zoo logits", case=case, dtype=precision, rel=1e-3)
        assert same_token, f"{case}: the first token differs from eager's"
    else:
        cos = torch.nn.functional.cosine_similarity(actual.double().flatten(), expected.double().flatten(), dim=0)
        err = (actual.float() - expected.float()).abs().max().item()
        record.write(kernel="zoo logits", case=case, dtype=precision, max_abs_err=err, cosine=cos.item(),
                     passed=cos.item() >= 0.99)
        assert cos >= 0.99, f"{case}: cosine similarity {cos.item():.4f} with eager's bf16 logits"


def test_aot_artifact_built_on_cpu_loads_on_the_device_or_is_refused_clearly(device, record, tmp_path):
    pytest.importorskip("transformers")
    from ttftc.aot import ArtifactError, build_artifact

    directory = build_artifact("tiny", tmp_path / "tiny", ttftc.Config(buckets=(16, 32)), cache=None)
    ids = zoo.example_ids(zoo.build_preset("tiny"), 11)
    with torch.no_grad():
        expected = zoo.build_preset("tiny")(ids).logits[:, -1]
    try:
        model = ttftc.load(directory, device=device.type)
    except ArtifactError as exc:
        message = str(exc)
        record.write(kernel="aot", case=f"cpu artifact on {device.type}", outcome=f"refused: {message[:300]}",
                     passed=True)
        # a refusal must say why (the device it was built for and the one asked for) and what to do
        assert device.type != "cpu", f"a CPU artifact was refused on the CPU: {message}"
        assert "compiled for" in message and device.type in message and "ttftc compile" in message, message
        return
    with torch.no_grad():
        out = model(ids.to(device), logits_to_keep=1)
    record.write(kernel="aot", case=f"cpu artifact on {device.type}", outcome=f"loaded, bucket {out.bucket}",
                 passed=True)
    record(out.logits[:, 0].cpu(), expected, kernel="aot logits", case=f"cpu artifact on {device.type}",
           dtype="float32", rel=1e-4)
