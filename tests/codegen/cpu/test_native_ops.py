"""Issue 30: the native kernels are torch operators, torch.ops.ttftc_native.*, with typed schemas in place of
positional int tuples of addresses. The profiler names them inside a compiled model, every one has a fake for
tracing (opcheck runs each schema, fake and AOT path), Inductor's generated code calls them, and each checks the
tensors it is handed itself, since anyone may call it directly."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ttftc import zoo
from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu import attention as cpu_attention

pytestmark = pytest.mark.skipif(_native.unavailable_reason() is not None, reason=str(_native.unavailable_reason()))

ops = torch.ops.ttftc_native


def _case(name: str) -> tuple:
    """Small, valid arguments for the operator `name` (its outputs freshly allocated)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, generator=g)
    acc = torch.randint(-500, 500, (4, 16), dtype=torch.int32, generator=g)
    xs, ws = torch.rand(4, generator=g) + 0.1, torch.rand(16, generator=g) + 0.1
    q = torch.randn(1, 2, 8, 16, generator=g)
    if name == "attention":
        return q, torch.randn(1, 1, 8, 16, generator=g), torch.randn(1, 1, 8, 16, generator=g), torch.empty_like(q), \
            torch.tensor([6]), True, 0.25, 0, 0, 32, 1, False
    if name == "quantize_rows":
        return x, torch.empty(4, 8, dtype=torch.int8), torch.empty(4), 1
    if name == "norm":
        return x, torch.randn(4, 8, generator=g), torch.empty(4, 8), w, None, None, None, torch.empty(4, 8), False, \
            1e-5, 1
    if name == "gated_act":
        return torch.randn(4, 16, generator=g), torch.empty(4, 8), "silu", 1
    if name == "dequant":
        return acc, xs, ws, torch.randn(16, generator=g), torch.empty(4, 16), 1
    if name == "gated_quant":
        return acc, xs, ws, None, torch.empty(4, 8, dtype=torch.int8), torch.empty(4), "gelu_tanh", 1
    if name == "rope":
        x4 = torch.randn(1, 2, 4, 8, generator=g)
        table = torch.randn(1, 1, 4, 8, generator=g).expand(x4.shape)  # a broadcast view, stride 0 over heads
        return x4, table, table.flip(-1).expand(x4.shape), torch.empty_like(x4), 1
    assert name == "int8_gemm"
    xq = torch.randint(-127, 128, (4, 12), dtype=torch.int8, generator=g)
    packed = _native.pack_int8_weight(torch.randint(-127, 128, (10, 12), dtype=torch.int8, generator=g))
    return xq, packed, torch.rand(4, generator=g), torch.rand(10, generator=g), None, torch.empty(4, 10), 64, 2, 1


def test_every_operator_has_a_typed_schema_that_declares_what_it_writes():
    writes = {"attention": {"out"}, "quantize_rows": {"q", "scale"}, "norm": {"summed", "q", "scale", "out"},
              "gated_act": {"out"}, "dequant": {"out"}, "gated_quant": {"q", "scale"}, "rope": {"out"},
              "int8_gemm": {"out"}}
    assert set(_native.OPS) == set(writes)
    for name in _native.OPS:
        schema = getattr(ops, name).default._schema
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == writes[name], name
        assert not schema.returns
        assert all(str(a.type) in ("Tensor", "Optional[Tensor]", "int", "float", "bool", "str")
                   for a in schema.arguments), schema


@pytest.mark.parametrize("name", _native.OPS)
def test_opcheck_passes(name):
    """Schema (only the declared outputs change), fake, autograd registration, and the AOT (functionalised) path."""
    torch.library.opcheck(getattr(ops, name).default, _case(name))


@pytest.mark.parametrize("name", _native.OPS)
def test_fake_tensors_trace_through_every_operator(name):
    real = _case(name)
    with FakeTensorMode() as mode:
        args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real)
        assert getattr(ops, name).default(*args) is None


def test_the_operators_compute_what_the_wrappers_return():
    x, residual, summed, w = _case("norm")[:4]
    out, expected_sum = _native.norm(x, w, None, residual, layer=False, eps=1e-5)
    got = torch.empty(4, 8)
    ops.norm(x, residual, summed, w, None, None, None, got, False, 1e-5, 1)
    assert torch.equal(got, out) and torch.equal(summed, expected_sum)


def test_inductor_calls_an_operator_from_its_generated_code():
    x, cos, sin, _, _ = _case("rope")

    def f(x, cos, sin):
        out = torch.empty_like(x)
        ops.rope(x * 2, cos, sin, out, 1)
        return out + 1

    expected = f(x, cos, sin)
    assert torch.equal(torch.compile(f, backend="inductor", fullgraph=True)(x, cos, sin), expected)


def test_a_compiled_llama_shows_the_native_kernels_by_name_in_the_profiler(monkeypatch):
    monkeypatch.setitem(cpu_attention.DEFAULT_TUNING, "kernel", "native")
    model = zoo.build("llama")
    ids = zoo.example_ids(model, 12)
    with torch.no_grad():
        compiled = torch.compile(model, backend="ttftc")
        compiled(ids)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(ids)
    names = {event.key for event in prof.key_averages()}
    assert {"ttftc_native::attention", "ttftc_native::rope", "ttftc_native::norm",
            "ttftc_native::gated_act"} <= names


# -- what an operator refuses when called directly, past the wrappers' checks ------------------------------------

def _with(name: str, **changes) -> tuple:
    args = list(_case(name))
    schema = getattr(ops, name).default._schema
    for index, argument in enumerate(schema.arguments):
        if argument.name in changes:
            args[index] = changes[argument.name]
    return tuple(args)


@pytest.mark.parametrize("name, changes, message", [
    ("attention", dict(threads=0), "threads must be in"),
    ("attention", dict(threads=2**40), "threads must be in"),
    ("attention", dict(block_k=0), "block_k"),
    ("attention", dict(q_offset=-1), "positions"),
    ("attention", dict(q_offset=2**24), "positions"),
    ("attention", dict(window=-1), "negative"),
    ("attention", dict(k=torch.randn(1, 3, 8, 16), v=torch.randn(1, 3, 8, 16)), "multiple of kv heads"),
    ("attention", dict(out=torch.empty(1, 2, 8, 8)), "do not fit"),
    ("attention", dict(out=torch.empty(1, 2, 16, 8).transpose(2, 3)), "contiguous last dimension"),
    ("attention", dict(kv_len=torch.tensor([6], dtype=torch.int32)), "kv_len"),
    ("attention", dict(q=torch.randn(1, 2, 8, 12), k=torch.randn(1, 1, 8, 12), v=torch.randn(1, 1, 8, 16)),
     "multiples of 8"),
    ("quantize_rows", dict(q=torch.empty(4, 8)), "q must be"),
    ("quantize_rows", dict(x=torch.randn(8, 4).t()), "unit stride"),
    ("norm", dict(summed=None), "residual and its sum"),
    ("norm", dict(bias=torch.zeros(8)), "RMSNorm takes no bias"),
    ("norm", dict(out=torch.empty(4, 8, dtype=torch.bfloat16)), "promoted dtype"),
    ("norm", dict(q=torch.empty(4, 8, dtype=torch.int8), scale=torch.empty(4)), "no out"),
    ("gated_act", dict(act="tanh"), "activation"),
    ("gated_act", dict(gate_up=torch.randn(4, 15)), "2I"),
    ("dequant", dict(w_scale=torch.ones(15)), "scales"),
    ("dequant", dict(out=torch.empty(4, 16, dtype=torch.float64)), "out must be"),
    ("gated_quant", dict(act="swish"), "activation"),
    ("gated_quant", dict(scale=torch.empty(4, dtype=torch.float64)), "scale"),
    ("rope", dict(cos=torch.randn(1, 1, 4, 8)), "x's shape"),
    ("rope", dict(out=torch.empty(1, 2, 8, 4).transpose(2, 3)), "unit stride"),
    ("int8_gemm", dict(block_rows=0), "blocks"),
    ("int8_gemm", dict(packed=torch.zeros(2, 3, 8, 4, dtype=torch.int8)[:1]), "packed"),
    ("int8_gemm", dict(out=torch.empty(4, 10, dtype=torch.int32)), "no scales"),
    ("int8_gemm", dict(x_scale=None), "needs scales"),
    ("int8_gemm", dict(out=torch.empty(4, 10, dtype=torch.float16)), "int32, fp32 or bf16"),
])
def test_an_operator_refuses_what_does_not_fit_with_a_value_error(name, changes, message):
    with pytest.raises(ValueError, match=message):
        getattr(ops, name).default(*_with(name, **changes))


def test_an_operator_refuses_a_meta_operand_among_cpu_ones():
    """One meta operand selects the Meta kernel (the fake), which would write nothing into the CPU ones."""
    with pytest.raises(ValueError, match="meta operand"):
        ops.quantize_rows(torch.randn(4, 8), torch.empty(4, 8, dtype=torch.int8, device="meta"), torch.empty(4), 1)
    q = torch.empty(4, 8, dtype=torch.int8, device="meta")
    assert ops.quantize_rows(torch.randn(4, 8, device="meta"), q, torch.empty(4, device="meta"), 1) is None


def test_bf16_attention_is_refused_below_the_avx512_bf16_kernels():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    previous = _native.set_isa("base")
    try:
        with pytest.raises(ValueError, match="bf16 attention needs the avx512_bf16 kernels; this process runs base"):
            ops.attention(q, q, q, torch.empty_like(q), None, True, 0.25, 0, 0, 32, 1, False)
    finally:
        _native.set_isa(previous)


def test_a_huge_block_is_clamped_to_the_keys():
    args = _case("attention")
    expected = args[3]
    ops.attention(*args)
    out = torch.empty_like(expected)
    ops.attention(*_with("attention", out=out, block_k=2**61))
    assert torch.equal(out, expected)
