"""The precision pass's pieces on small aten graphs built with make_fx (weights frozen as get_attr constants, the
probe mocked): which candidate gets which precision and why not, the bf16 and W8A8 rewrites' ops, dtypes and
numerics, the cast round trips, producer fusion, module names, and the quant-dequant patterns already in a graph.
No model is compiled, so a mutation run of the precision modules takes seconds per mutant."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import ttftc
import ttftc.ops  # noqa: F401  (registers torch.ops.ttftc)
from ttftc.capabilities import Capabilities
from ttftc.ops.int8_linear import quantize_per_token
from ttftc.passes import _bf16_rewrite, _module_names, _quant_patterns, _w8a8_rewrite
from ttftc import fx_utils as gu
from ttftc.passes import precision as pp
from ttftc.passes._precision_common import Casts, is_cast_to, rewire_tuple

aten = torch.ops.aten
tt = torch.ops.ttftc
BF16, FP32, FP16, INT8 = torch.bfloat16, torch.float32, torch.float16, torch.int8
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default

NATIVE = Capabilities("cpu", "mock CPU", True, "mocked flags", True, False)
EMULATED = Capabilities("cpu", "mock CPU", False, "mocked flags", True, False)
SLOW_ATTENTION = Capabilities("cpu", "mock CPU", True, "mocked flags", True, False, bf16_attention_speedup=1.02)


def _rand(*shape, seed=0, dtype=FP32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.5).to(dtype)


def build(fn, inputs, consts=None) -> fx.GraphModule:
    """make_fx of fn(*inputs, *consts) with fake tensors; each const becomes a frozen get_attr constant."""
    consts = consts or {}
    inputs = [t.clone() for t in inputs]  # one placeholder each, even for the same tensor passed twice
    gm = make_fx(fn, tracing_mode="fake")(*inputs, *consts.values())
    mode = gu.fake_mode_of(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, (name, tensor) in zip(placeholders[len(inputs):], consts.items()):
        gm.register_buffer(name, tensor)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta["val"] = mode.from_tensor(tensor, static_shapes=True)
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()  # as in the graphs the pass gets: no unread tuple outputs
    gm.recompile()
    return gm


def set_constant(gm, name, tensor):
    """Swap a frozen constant for another (e.g. of a dtype the traced function could not take)."""
    gm.register_buffer(name, tensor)
    node = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == name)
    node.meta["val"] = gu.fake_mode_of(gm).from_tensor(tensor, static_shapes=True)


def calls(gm, *targets) -> list[fx.Node]:
    """The live nodes calling one of `targets` (DCE keeps a replaced SDPA: it is tagged nondeterministic_seeded)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets and n.users]


def one(gm, target) -> fx.Node:
    (node,) = calls(gm, target)
    return node


def attrs(gm) -> set[str]:
    """The constants the live graph reads."""
    return {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.users}


def dtypes(node, *indices) -> tuple:
    return tuple(gu.dtype_of(node.args[i]) for i in indices)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Nothing here compiles: skip conftest's two Dynamo resets per test (75 ms each, most of a test's time)."""
    yield


@pytest.fixture
def caps(monkeypatch):
    """Pin the probe (NATIVE unless set otherwise); records the devices it was asked about."""
    asked = []

    def use(capabilities: Capabilities) -> None:
        def probe(device="cpu"):
            asked.append(device)
            return capabilities
        monkeypatch.setattr(pp, "probe", probe)

    use(NATIVE)
    monkeypatch.setattr(pp, "measured_bf16_speedup", lambda: 0.25)
    use.asked = asked
    return use


def run(gm, precision, quant_skip=(), **config):
    p = pp.PrecisionPass(ttftc.Config(precision=precision, quant_skip=tuple(quant_skip), **config))
    stats = p.run(gm)
    return stats


# -- graphs --------------------------------------------------------------------------------------------------

W = _rand(32, 64, seed=1)
B = _rand(32, seed=2)


def linear_gm(bias=True, x_shape=(6, 64), x_dtype=FP32, weight=None, post=None):
    weight = W if weight is None else weight
    consts = {"w": weight.to(x_dtype)}
    if bias:
        consts["b"] = B[: weight.shape[0]].to(x_dtype)

    def fn(x, w, *b):
        out = F.linear(x, w, b[0] if b else None)
        return post(out) if post else out
    return build(fn, [torch.zeros(x_shape, dtype=x_dtype)], consts)


NORM_W = 1 + _rand(64, seed=3) * 0.1
NORM_B = _rand(64, seed=4) * 0.1
W_GU = _rand(64, 64, seed=5)  # gate|up for an intermediate size of 32
W_DOWN = _rand(64, 32, seed=6)
B_GU, B_DOWN = _rand(64, seed=7), _rand(64, seed=8)


def norm_linear_gm(residual=True, bias=True, norm_b=False, kind="rms", w=None):
    consts = {"norm_w": NORM_W, "w": W if w is None else w}
    if bias:
        consts["b"] = B
    if norm_b:
        consts["norm_b"] = NORM_B

    def fn(x, r, norm_w, w, *rest):
        b = rest[0] if bias else None
        nb = rest[-1] if norm_b else None
        out, res = tt.norm_linear(x, norm_w, nb, w, b, r if residual else None, kind=kind, eps=1e-5)
        return (out * 2, res + 1) if residual else (out * 2,)
    return build(fn, [torch.zeros(6, 64), torch.zeros(6, 64)], consts)


def gated_ffn_gm(biases=False, w_gate_up=None, act="silu"):
    consts = {"w_gu": W_GU if w_gate_up is None else w_gate_up, "w_down": W_DOWN}
    if biases:
        consts.update(b_gu=B_GU, b_down=B_DOWN)

    def fn(x, w_gu, w_down, *b):
        return tt.gated_ffn(x, w_gu, w_down, *b, act=act) + 1
    return build(fn, [torch.zeros(6, 64)], consts)


def linear_act_gm(bias=True, act="gelu_tanh"):
    consts = {"w": W, "b": B} if bias else {"w": W}

    def fn(x, w, *b):
        return tt.linear_act(x, w, *b, act=act) + 1
    return build(fn, [torch.zeros(6, 64)], consts)


def x6():
    return _rand(6, 64, seed=11)


# -- shape and weight refusals -------------------------------------------------------------------------------


def test_int8_shape_refusal_boundaries():
    assert pp.int8_shape_refusal(8, 16) is None
    assert pp.int8_shape_refusal(32, 64) is None
    message = ("shape [8, 8] unsupported by the int8 kernels (in/out features must be multiples of 8, "
               "in_features >= 16)")
    assert pp.int8_shape_refusal(8, 8) == message
    assert pp.int8_shape_refusal(12, 16) is not None  # N not a multiple of 8
    assert pp.int8_shape_refusal(8, 20) is not None  # K not a multiple of 8
    assert pp.int8_shape_refusal(8, 24) is None


def test_int8_weight_refusal():
    assert pp.int8_weight_refusal(torch.ones(16, 32)) is None
    assert pp.int8_weight_refusal(torch.ones(2, 16, 32)) == "weight is not a 2-D float matrix ((2, 16, 32), torch.float32)"
    assert pp.int8_weight_refusal(torch.ones(16, 32, dtype=torch.int64)) == (
        "weight is not a 2-D float matrix ((16, 32), torch.int64)")
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.ones(16, 32)
        w[3, 4] = bad
        assert pp.int8_weight_refusal(w) == "weights contain NaN or inf"
    assert pp.int8_weight_refusal(torch.ones(12, 32)).startswith("shape [12, 32] unsupported")


def test_int8_unavailable_reason(monkeypatch):
    assert pp.int8_unavailable_reason("cpu") is None
    assert pp.int8_unavailable_reason("cuda") is None
    assert pp.int8_unavailable_reason("xla") == "no int8 GEMM lowering for device 'xla'"
    assert pp.int8_unavailable_reason("npu") == "torch_npu is not importable"
    monkeypatch.delattr(torch, "_int_mm")
    assert pp.int8_unavailable_reason("cpu") == "this torch has no torch._int_mm"
    assert pp.int8_unavailable_reason("cuda") == "this torch has no torch._int_mm"


# -- options, policy -----------------------------------------------------------------------------------------


def test_the_policy_probes_the_device_of_the_graph(caps):
    run(linear_gm(), "auto")
    assert caps.asked == ["cpu"]


def test_options(caps):
    options = pp.PrecisionPass(ttftc.Config(precision="bf16", quant_skip=("a", "b"))).options()
    assert options == {"precision": "bf16", "quant_skip": ["a", "b"], "int8_align": 8, "int8_min_k": 16}
    assert caps.asked == []
    caps(SLOW_ATTENTION)
    for precision in ("auto", "int8"):
        options = pp.PrecisionPass(ttftc.Config(precision=precision, device="cuda")).options()
        assert options == {"precision": precision, "quant_skip": ["lm_head"], "int8_align": 8, "int8_min_k": 16,
                           "native_bf16": True, "bf16_attention": False}
    assert caps.asked == ["cuda", "cuda"]
    pp.PrecisionPass(ttftc.Config(precision="auto")).options()
    assert caps.asked[-1] == pp._default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pp.PrecisionPass(ttftc.Config(precision="fp32")).options()["precision"] == "fp32"


@pytest.mark.parametrize("available, device", [(True, "cuda"), (False, "cpu")])
def test_default_device(monkeypatch, available, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert pp._default_device() == device


def test_graph_device():
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    nodes = [gm.graph.placeholder(name) for name in "abcd"]
    assert pp._graph_device(gm) == "cpu"
    nodes[0].meta["val"] = 3
    nodes[1].meta["val"] = torch.zeros(2, dtype=torch.int64, device="meta")
    nodes[2].meta["val"] = torch.zeros(2, device="meta")
    nodes[3].meta["val"] = torch.zeros(2)
    assert pp._graph_device(gm) == "meta"
    nodes[2].meta["val"] = torch.zeros(2, dtype=torch.int64, device="meta")
    assert pp._graph_device(gm) == "cpu"


def _policy(precision, **config):
    p = pp.PrecisionPass(ttftc.Config(precision=precision, **config))
    return p, p._effective_policy(linear_gm())


def test_policy_fp32(caps):
    p, policy = _policy("fp32")
    assert policy == ("fp32", {"gemm": "fp32", "attention": "fp32"})
    assert p.stats.decisions == [] and p.stats.rejections == []


def test_policy_bf16_native_and_emulated(caps):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p, policy = _policy("bf16")
    assert policy == ("bf16", {"gemm": "bf16", "attention": "bf16"}) and p.stats.decisions == []
    caps(EMULATED)
    with pytest.warns(RuntimeWarning) as caught:
        p, policy = _policy("bf16")
    assert policy == ("bf16", {"gemm": "bf16", "attention": "bf16"})
    assert p.stats.decisions == ["precision 'bf16' as asked, although bf16 is not native on mock CPU"]
    assert [str(w.message) for w in caught] == [
        "ttftc: precision='bf16' on mock CPU, which has no native bf16 (mocked flags): bf16 GEMMs are emulated here "
        "and measured 4.0x the time of fp32 ones. precision='auto' picks the fastest precision this device "
        "computes natively."]


_NATIVE_WHY = "on mock CPU bf16 is native (mocked flags)"


@pytest.mark.parametrize("precision, capabilities, mode, gemm, attention, decision", [
    ("auto", NATIVE, "bf16", "bf16", "bf16",
     f"precision 'auto' chose bf16 GEMMs and bf16 attention: {_NATIVE_WHY}; auto never quantises to int8"),
    ("auto", SLOW_ATTENTION, "bf16", "bf16", "fp32",
     f"precision 'auto' chose bf16 GEMMs and fp32 attention: {_NATIVE_WHY}, and the bf16 attention kernel measured "
     "1.02x fp32; auto never quantises to int8"),
    ("auto", EMULATED, "fp32", "fp32", "fp32",
     "precision 'auto' chose fp32 GEMMs and fp32 attention: on mock CPU bf16 is not native (mocked flags); auto "
     "never quantises to int8"),
    ("int8", NATIVE, "int8", "bf16", "bf16",
     f"precision 'int8': W8A8 linears; the GEMMs kept out of int8 run bf16, attention bf16: {_NATIVE_WHY}"),
    ("int8", EMULATED, "int8", "fp32", "fp32",
     "precision 'int8': W8A8 linears; the GEMMs kept out of int8 run fp32, attention fp32: on mock CPU bf16 is not "
     "native (mocked flags)"),
])
def test_policy_auto_and_int8(caps, precision, capabilities, mode, gemm, attention, decision):
    caps(capabilities)
    p, policy = _policy(precision)
    assert policy == (mode, {"gemm": gemm, "attention": attention})
    assert p.stats.decisions == [decision] and p.stats.rejections == []


@pytest.mark.parametrize("capabilities, mode", [(NATIVE, "bf16"), (SLOW_ATTENTION, "bf16"), (EMULATED, "fp32")])
def test_policy_int8_without_an_int8_path_falls_back(caps, monkeypatch, capabilities, mode):
    caps(capabilities)
    monkeypatch.setattr(pp, "int8_unavailable_reason", lambda device: f"nothing on {device}")
    with pytest.warns(RuntimeWarning) as caught:
        p, policy = _policy("int8")
    assert policy[0] == mode
    message = f"precision='int8' has no int8 path on device 'cpu' (nothing on cpu); falling back to {mode}"
    assert [str(w.message) for w in caught] == [f"ttftc: {message}"]
    assert p.stats.rejections == [message] and p.stats.decisions == []


# -- find ----------------------------------------------------------------------------------------------------


def _every_kind_gm():
    def fn(x, q, k, v, a, b, w, norm_w, w_gu, w_down):
        y = F.linear(x, w) + F.linear(x, w, w[:, 0])
        n, _ = tt.norm_linear(x, norm_w, None, w, None, None, kind="rms", eps=1e-5)
        g = tt.gated_ffn(x, w_gu, w_down, act="silu")
        la = tt.linear_act(x, w, act="relu")
        at = tt.attention(q, k, v, causal=True, scale=0.5)
        sd = SDPA(q, k, v)[0]
        bm = torch.bmm(a, b)
        im = torch._int_mm(x.to(INT8), w.t().to(INT8).contiguous())
        return y, n, g, la, at, sd, bm, im, torch.relu(x)
    q = torch.zeros(1, 2, 8, 16)
    return build(fn, [torch.zeros(16, 64), q, q, q, torch.zeros(2, 16, 8), torch.zeros(2, 8, 16)],
                 {"w": W, "norm_w": NORM_W, "w_gu": W_GU, "w_down": W_DOWN})


def test_find_classifies_every_kind(caps):
    gm = _every_kind_gm()
    p = pp.PrecisionPass(ttftc.Config(precision="bf16"))
    p.mode = "bf16"
    found = [(c.kind, c.node.target) for c in p.find(gm)]
    assert found == [("linear", aten.mm.default), ("linear", aten.addmm.default),
                     ("norm_linear", tt.norm_linear.default), ("gated_ffn", tt.gated_ffn.default),
                     ("linear_act", tt.linear_act.default), ("attention", tt.attention.default),
                     ("sdpa", SDPA), ("bmm", aten.bmm.default), ("int_mm", aten._int_mm.default)]
    assert all(c.plan == "" and c.info == {} for c in p.find(gm))
    p.mode = "fp32"
    assert p.find(gm) == []


def test_candidates_are_named_for_explain(caps):
    gm = linear_gm(bias=False)
    mm = one(gm, aten.mm.default)
    p = pp.PrecisionPass(ttftc.Config(precision="bf16"))
    p.mode = "bf16"
    (c,) = p.find(gm)
    assert c.name == "? (linear)"
    mm.meta["nn_module_stack"] = {"k": ("L['self'].model.layers[0].mlp.down_proj", torch.nn.Linear)}
    (c,) = p.find(gm)
    assert c.name == "model.layers.0.mlp.down_proj"


# -- bf16: linears -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_bf16_linear(caps, bias):
    gm = linear_gm(bias=bias, x_shape=(2, 3, 64))
    ref = linear_gm(bias=bias, x_shape=(2, 3, 64))
    stats = run(gm, "bf16")
    assert (stats.candidates, stats.matched, stats.rejections) == (1, 1, [])
    gemm = one(gm, aten.addmm.default if bias else aten.mm.default)
    assert not calls(gm, aten.mm.default if bias else aten.addmm.default)
    x, w = gemm.args[-2:]
    assert gu.dtype_of(x) == gu.dtype_of(w) == BF16 and gu.dtype_of(gemm) == BF16
    assert gu.is_call(w, aten.permute.default) and list(w.args[1]) == [1, 0]
    assert gu.constant_value(gm, w.args[0]).dtype == BF16
    assert torch.equal(gu.constant_value(gm, w.args[0]), W.to(BF16))
    assert attrs(gm) == {"_ttftc____linear__w_bf16"} | ({"_ttftc____linear__b_bf16"} if bias else set())
    if bias:
        assert torch.equal(gu.constant_value(gm, gemm.args[0]), B.to(BF16))
    assert is_cast_to(x, BF16)
    out_node = next(iter(gemm.users))
    assert is_cast_to(out_node, FP32)
    xin = _rand(2, 3, 64, seed=9)
    actual, expected = gm(xin), ref(xin)
    assert actual.dtype == FP32
    exact = F.linear(xin.to(BF16), W.to(BF16), B.to(BF16) if bias else None).float()
    torch.testing.assert_close(actual, exact, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(actual, expected, atol=0.05, rtol=0.02)


def test_bf16_linear_of_a_bf16_activation_is_refused_and_fp16_too(caps):
    for dtype in (BF16, FP16):
        gm = linear_gm(x_dtype=dtype)
        stats = run(gm, "bf16")
        assert stats.matched == 0
        assert stats.rejections == [f"? (linear): bf16 refused: activation dtype {dtype} (only fp32 is lowered)"]


def test_bf16_linear_with_a_live_weight_is_refused(caps):
    gm = build(lambda x, w: F.linear(x, w), [torch.zeros(6, 64), W])
    stats = run(gm, "bf16")
    assert stats.rejections == ["? (linear): bf16 refused: weights are not frozen constants"]
    gm = build(lambda x, w: F.linear(x, w), [torch.zeros(6, 64), W])
    stats = run(gm, "int8")
    assert stats.rejections == ["? (linear): int8 refused: weights are not frozen constants; kept in its own dtype",
                                "? (linear): bf16 refused: weights are not frozen constants"]


def test_bf16_linear_of_a_3d_weight_matmul_is_refused(caps):
    # mm over a constant that is not a transposed weight: match_linear finds no linear (1-D bias of wrong size).
    gm = build(lambda x, w, b: torch.addmm(b, x, w.t()), [torch.zeros(6, 64)], {"w": W, "b": torch.zeros(6, 32)})
    p = pp.PrecisionPass(ttftc.Config(precision="bf16"))
    p.mode, p.float_policy = "bf16", {"gemm": "bf16", "attention": "bf16"}
    (c,) = p.find(gm)
    assert p._bf16_refusal(gm, c) == "weights are not frozen constants"
    c.info.update(weight=W, x=c.node.args[1])  # a stale match in c.info does not count: the node is matched again
    assert p._bf16_refusal(gm, c) == "weights are not frozen constants"


def test_auto_leaves_the_graph_alone_where_bf16_is_not_native(caps):
    caps(EMULATED)
    gm = linear_gm()
    before = str(gm.graph)
    stats = run(gm, "auto")
    assert (stats.candidates, stats.matched, stats.rejections) == (0, 0, [])
    assert str(gm.graph) == before


# -- bf16: fused ops -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("residual, bias, norm_b", [(True, True, False), (False, False, True)])
def test_bf16_norm_linear(caps, residual, bias, norm_b):
    gm = norm_linear_gm(residual=residual, bias=bias, norm_b=norm_b, kind="layer" if norm_b else "rms")
    ref = norm_linear_gm(residual=residual, bias=bias, norm_b=norm_b, kind="layer" if norm_b else "rms")
    stats = run(gm, "bf16")
    assert (stats.matched, stats.rejections) == (1, [])
    node = one(gm, tt.norm_linear.default)
    assert dtypes(node, 0, 1, 3) == (BF16, BF16, BF16)
    assert node.args[5] is None and node.kwargs == {"kind": "layer" if norm_b else "rms", "eps": 1e-5}
    assert gu.dtype_of(node.args[2]) == (BF16 if norm_b else None)
    assert gu.dtype_of(node.args[4]) == (BF16 if bias else None)
    assert attrs(gm) == {f"_ttftc____norm_linear__{name}" for name in
                         ["norm_w", "w"] + (["b"] if bias else []) + (["norm_b"] if norm_b else [])}
    adds = calls(gm, aten.add.Tensor)
    # The residual add runs fp32 outside the op (and the graph's own `res + 1`).
    assert len(adds) == (2 if residual else 0)
    x, r = _rand(6, 64, seed=12), _rand(6, 64, seed=13)
    got, want = gm(x, r), ref(x, r)
    assert got[0].dtype == FP32
    h = (x + r) if residual else x
    bf = lambda t: None if t is None else t.to(BF16)  # noqa: E731
    exact = tt.norm_linear(h.to(BF16), bf(NORM_W), bf(NORM_B) if norm_b else None, bf(W), bf(B) if bias else None,
                           None, kind="layer" if norm_b else "rms", eps=1e-5)[0].float() * 2
    torch.testing.assert_close(got[0], exact, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[0], want[0], atol=0.1, rtol=0.05)
    if residual:
        assert got[1].dtype == FP32
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)


def test_bf16_norm_linear_output_1_without_a_residual_has_no_replacement(caps):
    gm = norm_linear_gm(residual=False)
    node = one(gm, tt.norm_linear.default)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        second = gm.graph.call_function(operator.getitem, (node, 1))  # output 1, empty without a residual
    out.args = ((*out.args[0], second),)
    with pytest.raises(ValueError, match="output 1 of norm_linear is read but has no replacement"):
        run(gm, "bf16")


@pytest.mark.parametrize("biases", [False, True])
def test_bf16_gated_ffn(caps, biases):
    gm, ref = gated_ffn_gm(biases=biases), gated_ffn_gm(biases=biases)
    stats = run(gm, "bf16")
    assert (stats.matched, stats.rejections) == (1, [])
    node = one(gm, tt.gated_ffn.default)
    assert dtypes(node, 0, 1, 2) == (BF16, BF16, BF16) and node.kwargs == {"act": "silu"}
    assert dtypes(node, 3, 4) == ((BF16, BF16) if biases else (None, None))
    names = {"w_gate_up", "w_down"} | ({"b_gate_up", "b_down"} if biases else set())
    assert attrs(gm) == {f"_ttftc____gated_ffn__{name}" for name in names}
    x = x6()
    out = gm(x)
    assert out.dtype == FP32
    bf = lambda t: t.to(BF16)  # noqa: E731
    exact = tt.gated_ffn(bf(x), bf(W_GU), bf(W_DOWN), *((bf(B_GU), bf(B_DOWN)) if biases else ()), act="silu")
    torch.testing.assert_close(out, exact.float() + 1, atol=1e-6, rtol=1e-6)
    assert F.cosine_similarity(out.flatten(), ref(x).flatten(), dim=0) > 0.999


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_act(caps, bias):
    gm, ref = linear_act_gm(bias=bias), linear_act_gm(bias=bias)
    stats = run(gm, "bf16")
    assert (stats.matched, stats.rejections) == (1, [])
    node = one(gm, tt.linear_act.default)
    assert dtypes(node, 0, 1, 2) == (BF16, BF16, BF16 if bias else None) and node.kwargs == {"act": "gelu_tanh"}
    assert attrs(gm) == {"_ttftc____linear_act__w"} | ({"_ttftc____linear_act__b"} if bias else set())
    x = x6()
    exact = tt.linear_act(x.to(BF16), W.to(BF16), B.to(BF16) if bias else None, act="gelu_tanh").float() + 1
    torch.testing.assert_close(gm(x), exact, atol=1e-6, rtol=1e-6)
    assert F.cosine_similarity(gm(x).flatten(), ref(x).flatten(), dim=0) > 0.999


def test_fused_ops_with_live_weights_or_biases_are_refused(caps):
    gm = build(lambda x, w: tt.linear_act(x, w, act="relu"), [torch.zeros(6, 64), W])
    assert run(gm, "bf16").rejections == ["? (linear_act): bf16 refused: weights are not frozen constants"]
    gm = build(lambda x, b, w: tt.linear_act(x, w, b, act="relu"), [torch.zeros(6, 64), B], {"w": W})
    assert run(gm, "bf16").rejections == ["? (linear_act): bf16 refused: weights are not frozen constants"]
    gm = build(lambda x, nb, nw, w: tt.norm_linear(x, nw, nb, w, kind="layer", eps=1e-5)[0],
               [torch.zeros(6, 64), NORM_B], {"nw": NORM_W, "w": W})
    assert run(gm, "bf16").rejections == ["? (norm_linear): bf16 refused: weights are not frozen constants"]
    for role in ("b_gu", "b_down"):
        def fn(x, live, w_gu, w_down):
            return tt.gated_ffn(x, w_gu, w_down, live if role == "b_gu" else None, live if role == "b_down" else None,
                                act="silu")
        gm = build(fn, [torch.zeros(6, 64), torch.zeros(64)], {"w_gu": W_GU, "w_down": W_DOWN})
        assert run(gm, "bf16").rejections == ["? (gated_ffn): bf16 refused: weights are not frozen constants"]


def test_int8_refusal_of_live_weights_does_not_fall_back_to_bf16(caps):
    # The int8 check binds the op's arguments before it finds a live one; bf16 must not take that as frozen.
    gm = build(lambda x, nb, nw, w: tt.norm_linear(x, nw, nb, w, kind="layer", eps=1e-5)[0],
               [torch.zeros(6, 64), NORM_B], {"nw": NORM_W, "w": W})
    assert run(gm, "int8").rejections == [
        "? (norm_linear): int8 refused: weights are not frozen constants; kept in its own dtype",
        "? (norm_linear): bf16 refused: weights are not frozen constants"]
    gm = build(lambda x, w_gu, w_down: tt.gated_ffn(x, w_gu, w_down, act="silu"), [torch.zeros(6, 64), W_GU],
               {"w_down": W_DOWN})
    assert run(gm, "int8").rejections == [
        "? (gated_ffn): int8 refused: weights are not frozen constants; kept in its own dtype",
        "? (gated_ffn): bf16 refused: weights are not frozen constants"]


def test_fused_op_arguments_that_do_not_bind_are_refused(caps, monkeypatch):
    gm = linear_act_gm()
    monkeypatch.setattr(gu, "bound_arguments", lambda node: None)
    assert run(gm, "int8").rejections == [
        "? (linear_act): int8 refused: weights are not frozen constants; kept in its own dtype",
        "? (linear_act): bf16 refused: weights are not frozen constants"]


# -- bf16: attention -----------------------------------------------------------------------------------------


def _qkv(dtype=FP32):
    return [_rand(1, 2, 8, 16, seed=s, dtype=dtype) for s in (20, 21, 22)]


def attention_gm(dtype=FP32, kv_len=False):
    def fn(q, k, v):
        return tt.attention(q, k, v, None, causal=True, scale=0.25, q_offset=0, window=0) * 1
    return build(fn, [torch.zeros(1, 2, 8, 16, dtype=dtype)] * 3)


def test_bf16_attention(caps):
    gm, ref = attention_gm(), attention_gm()
    original = one(gm, tt.attention.default)
    original.args = (*original.args[:3], None)  # kv_len spelled out
    args, kwargs = original.args[3:], dict(original.kwargs)
    assert args == (None,)
    stats = run(gm, "bf16")
    assert (stats.matched, stats.rejections) == (1, [])
    node = one(gm, tt.attention.default)
    assert dtypes(node, 0, 1, 2) == (BF16, BF16, BF16)
    assert node.args[3:] == args and node.kwargs == kwargs and kwargs["scale"] == 0.25
    q, k, v = _qkv()
    out = gm(q, k, v)
    assert out.dtype == FP32
    exact = tt.attention(q.to(BF16), k.to(BF16), v.to(BF16), causal=True, scale=0.25).float()
    torch.testing.assert_close(out, exact, atol=0, rtol=0)
    torch.testing.assert_close(out, ref(q, k, v), atol=0.02, rtol=0.02)


def test_bf16_attention_refusals(caps):
    gm = attention_gm(dtype=FP16)
    assert run(gm, "bf16").rejections == ["? (attention): bf16 refused: query dtype torch.float16"]
    gm = attention_gm()
    node = one(gm, tt.attention.default)
    node.args, node.kwargs = (node.args[0], node.args[1]), {**node.kwargs, "v": node.args[2]}
    assert run(gm, "bf16").rejections == ["? (attention): bf16 refused: q, k, v are not positional"]


def test_attention_kept_fp32_where_its_bf16_kernel_is_slower(caps):
    caps(SLOW_ATTENTION)
    gm = build(lambda x, q, k, v, w: (F.linear(x, w), tt.attention(q, k, v, causal=True, scale=0.25)),
               [torch.zeros(6, 64)] + [torch.zeros(1, 2, 8, 16)] * 3, {"w": W})
    stats = run(gm, "auto")
    assert stats.matched == 1
    assert stats.rejections == ["? (attention): kept fp32: bf16 is not the faster precision for it on this device"]
    assert dtypes(one(gm, tt.attention.default), 0) == (FP32,)
    assert dtypes(one(gm, aten.mm.default), 0) == (BF16,)


def sdpa_gm(mask=None, dtype=FP32, read_lse=False, causal=False):
    def fn(q, k, v, *m):
        out = SDPA(q, k, v, 0.0, causal, attn_mask=m[0] if m else None, scale=0.25)
        return (out[0] * 1, out[1]) if read_lse else out[0] * 1
    inputs = [torch.zeros(1, 2, 8, 16, dtype=dtype)] * 3 + ([] if mask is None else [mask])
    return build(fn, inputs)


@pytest.mark.parametrize("mask", [None, torch.zeros(1, 1, 8, 8), torch.ones(1, 1, 8, 8, dtype=torch.bool)])
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_sdpa(caps, mask, causal):
    gm, ref = sdpa_gm(mask, causal=causal), sdpa_gm(mask, causal=causal)
    original = one(gm, SDPA)
    args, kwargs = original.args[3:], {k: v for k, v in original.kwargs.items() if k != "attn_mask"}
    # A non-default is_causal keeps dropout_p positional too: the rewrite must carry both in their slots.
    assert args == ((0.0, True) if causal else ())
    stats = run(gm, "bf16")
    assert (stats.matched, stats.rejections) == (1, [])
    node = one(gm, SDPA)
    assert dtypes(node, 0, 1, 2) == (BF16, BF16, BF16)
    assert node.args[3:] == args and {k: v for k, v in node.kwargs.items() if k != "attn_mask"} == kwargs
    assert kwargs["scale"] == 0.25
    if mask is None:
        assert node.kwargs.get("attn_mask") is None
    else:
        assert gu.dtype_of(node.kwargs["attn_mask"]) == (torch.bool if mask.dtype == torch.bool else BF16)
    if mask is not None and mask.dtype == torch.bool:
        assert node.kwargs["attn_mask"].op == "placeholder"  # not cast (the CPU kernel runs float masks only)
        return
    q, k, v = _qkv()
    args = (q, k, v) if mask is None else (q, k, v, torch.where(torch.rand(1, 1, 8, 8) > 0.3, 0.0, -1e4))
    out = gm(*args)
    assert out.dtype == FP32
    bf = [a.to(BF16) if a.dtype == FP32 else a for a in args]
    exact = SDPA(*bf[:3], 0.0, causal, attn_mask=bf[3] if mask is not None else None, scale=0.25)[0].float()
    torch.testing.assert_close(out, exact, atol=0, rtol=0)
    torch.testing.assert_close(out, ref(*args), atol=0.02, rtol=0.02)


def test_bf16_sdpa_refusals(caps):
    assert run(sdpa_gm(read_lse=True), "bf16").rejections == [
        "? (attention): bf16 refused: the logsumexp output is read"]
    assert run(sdpa_gm(dtype=FP16), "bf16").rejections == ["? (attention): bf16 refused: query dtype torch.float16"]
    gm = sdpa_gm(torch.zeros(1, 1, 8, 8))
    mask = [n for n in gm.graph.nodes if n.op == "placeholder"][3]
    mask.meta["val"] = mask.meta["val"].to(torch.int64)
    assert run(gm, "bf16").rejections == ["? (attention): bf16 refused: mask dtype torch.int64"]
    # The whole tuple read (no getitem 0): refused too.
    gm = build(lambda q, k, v: SDPA(q, k, v), [torch.zeros(1, 2, 8, 16)] * 3)
    assert run(gm, "bf16").rejections == ["? (attention): bf16 refused: the logsumexp output is read"]


def bmm_gm(dtype=FP32, frozen=None):
    if frozen == "a":
        return build(lambda b, a: torch.bmm(a, b) * 1, [torch.zeros(2, 8, 4, dtype=dtype)], {"a": _rand(2, 4, 8)})
    if frozen == "b":
        return build(lambda a, b: torch.bmm(a, b) * 1, [torch.zeros(2, 4, 8, dtype=dtype)], {"b": _rand(2, 8, 4)})
    return build(lambda a, b: torch.bmm(a, b) * 1, [torch.zeros(2, 4, 8, dtype=dtype), torch.zeros(2, 8, 4)])


def test_bf16_bmm(caps):
    gm, ref = bmm_gm(), bmm_gm()
    assert run(gm, "bf16").matched == 1
    node = one(gm, aten.bmm.default)
    assert dtypes(node, 0, 1) == (BF16, BF16)
    a, b = _rand(2, 4, 8, seed=30), _rand(2, 8, 4, seed=31)
    out = gm(a, b)
    assert out.dtype == FP32
    torch.testing.assert_close(out, torch.bmm(a.to(BF16), b.to(BF16)).float(), atol=0, rtol=0)
    torch.testing.assert_close(out, ref(a, b), atol=0.03, rtol=0.02)


def test_bf16_bmm_refusals(caps):
    assert run(bmm_gm(frozen="a"), "bf16").rejections == ["? (bmm): bf16 refused: bmm with a frozen operand"]
    assert run(bmm_gm(frozen="b"), "bf16").rejections == ["? (bmm): bf16 refused: bmm with a frozen operand"]
    gm = build(lambda a, b: torch.bmm(a, b) * 1, [torch.zeros(2, 4, 8, dtype=FP16), torch.zeros(2, 8, 4, dtype=FP16)])
    assert run(gm, "bf16").rejections == ["? (bmm): bf16 refused: dtype torch.float16"]
    gm = build(lambda a, b: torch.bmm(a, b.to(FP16)).float(), [torch.zeros(2, 4, 8, dtype=FP16), torch.zeros(2, 8, 4)])
    node = one(gm, aten.bmm.default)
    node.args[1].meta["val"] = node.args[1].meta["val"].to(FP32)
    node.args[0].meta["val"] = node.args[0].meta["val"].to(FP32)
    node.args[1].meta["val"] = node.args[1].meta["val"].to(FP16)
    assert run(gm, "bf16").rejections == ["? (bmm): bf16 refused: dtype torch.float32"]


def test_unknown_candidate_kind_is_refused(caps):
    p = pp.PrecisionPass(ttftc.Config(precision="bf16"))
    gm = linear_gm()
    c = pp.Candidate("pt3", one(gm, aten.addmm.default), "x")
    assert p._bf16_refusal(gm, c) == "unknown candidate kind pt3"


def test_a_candidate_without_users_is_not_rewritten(caps):
    gm = linear_gm()
    p = pp.PrecisionPass(ttftc.Config(precision="bf16"))
    p.mode, p.float_policy = "bf16", {"gemm": "bf16", "attention": "bf16"}
    (c,) = p.find(gm)
    assert p.guard(gm, c) is None and c.plan == "bf16"
    other = linear_gm()
    c2 = pp.Candidate("linear", one(other, aten.addmm.default), "n")
    assert p.guard(gm, c2) == "n: node no longer in use"
    node = one(gm, aten.addmm.default)
    for user in list(node.users):
        user.replace_input_with(node, node.args[0])
    assert p.guard(gm, pp.Candidate("linear", node, "n")) == "n: node no longer in use"


def test_fp32_leaves_the_graph_alone(caps):
    gm = _every_kind_gm()
    before = str(gm.graph)
    stats = run(gm, "fp32")
    assert (stats.candidates, stats.matched, stats.rejections) == (0, 0, [])
    assert str(gm.graph) == before


def test_bf16_on_every_kind(caps):
    gm = _every_kind_gm()
    stats = run(gm, "bf16")
    # The int_mm's weight is computed, not frozen; so is the addmm's bias w[:, 0].
    assert stats.rejections == [
        "? (linear): bf16 refused: weights are not frozen constants",
        "? (int_mm): torch._int_mm pattern: weight operand is not an int8 [N, K] matrix under t()"]
    assert stats.matched == 7
    for node in calls(gm, tt.norm_linear.default, tt.gated_ffn.default, tt.linear_act.default, tt.attention.default,
                      SDPA, aten.bmm.default, aten.mm.default):
        assert gu.dtype_of(node.args[0]) == BF16, node


# -- int8 ----------------------------------------------------------------------------------------------------


def _int8_reference(x, weight, bias=None):
    """W8A8 as the pass means it: per-token activation scales, per-output-channel weight scales."""
    xq, xs = quantize_per_token(x)
    wq, ws = quantize_per_token(weight)
    out = (xq.double() @ wq.double().t()) * xs.double()[..., None] * ws.double()
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear(caps, bias):
    gm = linear_gm(bias=bias)
    stats = run(gm, "int8")
    assert (stats.matched, stats.rejections) == (1, [])
    node = one(gm, tt.int8_linear.default)
    assert not calls(gm, aten.mm.default, aten.addmm.default, aten._to_copy.default)
    assert node.args[1] is None and node.kwargs == {"out_dtype": FP32}
    wq, ws = gu.constant_value(gm, node.args[2]), gu.constant_value(gm, node.args[3])
    assert wq.dtype == INT8 and tuple(wq.shape) == (32, 64) and ws.dtype == FP32 and tuple(ws.shape) == (32,)
    expected_q, expected_s = quantize_per_token(W)
    assert torch.equal(wq, expected_q) and torch.equal(ws, expected_s)
    assert attrs(gm) == {"_ttftc____linear__int8", "_ttftc____linear__scale"} | ({"b"} if bias else set())
    if bias:
        assert torch.equal(gu.constant_value(gm, node.args[4]), B)
    else:
        assert node.args[4] is None
    x = x6()
    torch.testing.assert_close(gm(x), _int8_reference(x, W, B if bias else None), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gm(x), F.linear(x, W, B if bias else None), atol=0.05, rtol=0.05)


def test_int8_linear_with_a_bf16_bias(caps):
    gm = linear_gm()
    set_constant(gm, "b", B.to(BF16))
    assert run(gm, "int8").matched == 1
    node = one(gm, tt.int8_linear.default)
    assert gu.dtype_of(node.args[4]) == FP32


def test_int8_linear_of_a_bf16_model_keeps_its_dtypes(caps):
    gm = build(lambda x, w, b: F.linear(x, w, b), [torch.zeros(6, 64, dtype=BF16)],
               {"w": W.to(BF16), "b": B.to(BF16)})
    assert run(gm, "int8").matched == 1
    node = one(gm, tt.int8_linear.default)
    assert node.kwargs == {"out_dtype": BF16}
    bias = gu.constant_value(gm, node.args[4])
    assert bias.dtype == FP32 and torch.equal(bias, B.to(BF16).float())
    x = x6().to(BF16)
    assert gm(x).dtype == BF16


def test_int8_refusals_fall_back_to_the_float_policy(caps):
    w = W.clone()
    w[0, 0] = float("nan")
    gm = linear_gm(weight=w)
    stats = run(gm, "int8")
    assert stats.rejections == ["? (linear): int8 refused: weights contain NaN or inf; kept bf16"]
    assert stats.matched == 1 and dtypes(one(gm, aten.addmm.default), 1) == (BF16,)
    caps(EMULATED)
    gm = linear_gm(weight=w)
    stats = run(gm, "int8")
    assert stats.rejections == ["? (linear): int8 refused: weights contain NaN or inf; kept fp32",
                                "? (linear): kept fp32: bf16 is not the faster precision for it on this device"]
    assert stats.matched == 0


def test_int8_refuses_odd_shapes(caps):
    gm = linear_gm(weight=_rand(12, 64))
    assert run(gm, "int8").rejections == [
        "? (linear): int8 refused: shape [12, 64] unsupported by the int8 kernels (in/out features must be multiples "
        "of 8, in_features >= 16); kept bf16"]


def test_int8_refused_for_a_non_float_activation_and_a_non_float_model(caps):
    gm = linear_gm(x_dtype=BF16)
    node = one(gm, aten.addmm.default)
    node.args[1].meta["val"] = node.args[1].meta["val"].to(torch.int32)
    assert run(gm, "int8").rejections == [
        "? (linear): int8 refused: activation dtype torch.int32 is not floating point; kept in its own dtype",
        "? (linear): bf16 refused: activation dtype torch.int32 (only fp32 is lowered)"]
    gm = linear_act_gm()
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    x.meta["val"] = x.meta["val"].to(torch.int32)
    assert run(gm, "int8").rejections[0] == (
        "? (linear_act): int8 refused: activation dtype torch.int32 is not floating point; kept in its own dtype")


def test_int8_refuses_a_norm_of_unknown_kind(caps):
    gm = norm_linear_gm()
    one(gm, tt.norm_linear.default).kwargs = {"kind": "batch", "eps": 1e-5}
    p = pp.PrecisionPass(ttftc.Config(precision="int8"))
    p.mode, p.float_policy = "int8", {"gemm": "bf16", "attention": "bf16"}
    (c,) = p.find(gm)
    assert p._int8_refusal(gm, c) == "norm kind 'batch'"
    for kind in ("rms", "layer"):
        c.node.kwargs = {"kind": kind, "eps": 1e-5}
        assert p._int8_refusal(gm, c) is None


def test_int8_gated_ffn_names_the_refused_weight(caps):
    w_gu = W_GU.clone()
    w_gu[1, 1] = float("inf")
    gm = gated_ffn_gm(w_gate_up=w_gu)
    assert run(gm, "int8").rejections == [
        "? (gated_ffn): int8 refused: w_gate_up: weights contain NaN or inf; kept bf16"]
    assert dtypes(one(gm, tt.gated_ffn.default), 0, 1, 2) == (BF16, BF16, BF16)


def test_quant_skip(caps):
    gm = linear_gm()
    node = one(gm, aten.addmm.default)
    node.meta["nn_module_stack"] = {"a": ("L['self'].model", None), "b": ("L['self'].model.lm_head", None)}
    stats = run(gm, "int8", quant_skip=("", "lm_he"))
    assert stats.rejections == ["model.lm_head: int8 refused: skipped by quant_skip fragment 'lm_he'; kept bf16"]
    assert not calls(gm, tt.int8_linear.default)
    # The op kind is a name too; an empty fragment matches nothing.
    for skip, quantised in ((("linear",), 0), (("",), 1), (("head_x",), 1), (("gated_ffn",), 1)):
        gm = linear_gm()
        run(gm, "int8", quant_skip=skip)
        assert len(calls(gm, tt.int8_linear.default)) == quantised, skip


def test_int8_linear_act(caps):
    for bias, act, target, kwargs in ((True, "gelu_tanh", aten.gelu.default, {"approximate": "tanh"}),
                                      (False, "relu", aten.relu.default, {}), (True, "silu", aten.silu.default, {}),
                                      (True, "gelu", aten.gelu.default, {})):
        gm = linear_act_gm(bias=bias, act=act)
        assert run(gm, "int8").matched == 1
        lin = one(gm, tt.int8_linear.default)
        (act_node,) = lin.users
        assert act_node.target is target and act_node.kwargs == kwargs and act_node.args == (lin,)
        assert lin.args[1] is None and lin.kwargs == {"out_dtype": FP32}
        assert (gu.dtype_of(lin.args[4]) == FP32) if bias else lin.args[4] is None
        x = x6()
        expected = _int8_reference(x, W, B if bias else None)
        from ttftc.ops.ffn import apply_activation
        torch.testing.assert_close(gm(x), apply_activation(expected, act) + 1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("biases", [False, True])
def test_int8_gated_ffn(caps, biases):
    gm, ref = gated_ffn_gm(biases=biases, act="gelu"), gated_ffn_gm(biases=biases, act="gelu")
    assert run(gm, "int8").matched == 1
    node = one(gm, tt.gated_ffn_int8.default)
    assert node.kwargs == {"act": "gelu", "out_dtype": FP32} and node.args[1] is None
    gu_q, gu_s, d_q, d_s = (gu.constant_value(gm, a) for a in node.args[2:6])
    assert torch.equal(gu_q, quantize_per_token(W_GU)[0]) and torch.equal(gu_s, quantize_per_token(W_GU)[1])
    assert torch.equal(d_q, quantize_per_token(W_DOWN)[0]) and torch.equal(d_s, quantize_per_token(W_DOWN)[1])
    assert attrs(gm) == {f"_ttftc____gated_ffn__{a}_{b}" for a in ("gate_up", "down") for b in ("int8", "scale")} | (
        {"b_gu", "b_down"} if biases else set())
    if biases:
        assert torch.equal(gu.constant_value(gm, node.args[6]), B_GU)
        assert torch.equal(gu.constant_value(gm, node.args[7]), B_DOWN)
    else:
        assert node.args[6:] == (None, None)
    x = x6()
    wq, ws = quantize_per_token(W_GU)
    dq, ds = quantize_per_token(W_DOWN)
    exact = tt.gated_ffn_int8(x, None, wq, ws, dq, ds, *((B_GU, B_DOWN) if biases else ()), act="gelu",
                              out_dtype=FP32) + 1
    torch.testing.assert_close(gm(x), exact, atol=0, rtol=0)
    assert F.cosine_similarity(gm(x).flatten(), ref(x).flatten(), dim=0) > 0.99


@pytest.mark.parametrize("residual, kind", [(True, "rms"), (False, "layer")])
def test_int8_norm_linear(caps, residual, kind):
    def make():
        consts = {"norm_w": NORM_W, "norm_b": NORM_B, "w": W, "b": B}

        def fn(x, r, norm_w, norm_b, w, b):
            out, res = tt.norm_linear(x, norm_w, norm_b if kind == "layer" else None, w, b, r if residual else None,
                                      kind=kind, eps=1e-3)
            return (out * 2, res + 1) if residual else out * 2
        return build(fn, [torch.zeros(6, 64), torch.zeros(6, 64)], consts)
    gm, ref = make(), make()
    assert run(gm, "int8").matched == 1
    assert not calls(gm, tt.norm_linear.default)
    nq, lin = one(gm, tt.norm_quant.default), one(gm, tt.int8_linear.default)
    assert nq.kwargs == {"kind": kind, "eps": 1e-3}
    assert (nq.args[2] is not None) == (kind == "layer") and (nq.args[3] is not None) == residual
    assert gu.is_call(lin.args[0], operator.getitem) and lin.args[0].args == (nq, 0)
    assert gu.is_call(lin.args[1], operator.getitem) and lin.args[1].args == (nq, 1)
    assert lin.kwargs == {"out_dtype": FP32} and torch.equal(gu.constant_value(gm, lin.args[4]), B)
    x, r = _rand(6, 64, seed=40), _rand(6, 64, seed=41)
    actual, expected = gm(x, r), ref(x, r)
    if residual:
        torch.testing.assert_close(actual[1], expected[1])
        actual, expected = actual[0], expected[0]
    from ttftc.ops.norm_linear import normalize
    h = normalize(x + r if residual else x, NORM_W, NORM_B if kind == "layer" else None, kind=kind, eps=1e-3)
    torch.testing.assert_close(actual, _int8_reference(h, W, B) * 2, atol=1e-4, rtol=1e-4)
    assert F.cosine_similarity(actual.flatten(), expected.flatten(), dim=0) > 0.99


def test_int8_keeps_attention_in_the_float_policy(caps):
    for capabilities, dtype in ((NATIVE, BF16), (EMULATED, FP32)):
        caps(capabilities)
        gm = build(lambda x, q, k, v, w: F.linear(x, w) + tt.attention(q, k, v, causal=True, scale=0.25).sum(),
                   [torch.zeros(6, 64)] + [torch.zeros(1, 2, 8, 16)] * 3, {"w": W})
        run(gm, "int8")
        assert dtypes(one(gm, tt.attention.default), 0) == (dtype,)
        assert len(calls(gm, tt.int8_linear.default)) == 1


# -- the driver's finishing steps ----------------------------------------------------------------------------


def test_int8_q_k_v_share_one_quantisation(caps):
    def fn(x, wq, wk, wv):
        h = (x * 2).unsqueeze(0)  # two row views before each GEMM: unsqueeze, then the linear's flattening view
        return F.linear(h, wq)[0], F.linear(h, wk)[0], F.linear(h, wv)[0]
    ws = {"wq": W, "wk": _rand(32, 64, seed=50), "wv": _rand(16, 64, seed=51)}
    gm, ref = build(fn, [torch.zeros(2, 3, 64)], ws), build(fn, [torch.zeros(2, 3, 64)], ws)
    assert run(gm, "int8").matched == 3
    quant = one(gm, tt.quantize_per_token.default)
    lins = calls(gm, tt.int8_linear.default)
    assert len(lins) == 3
    for lin in lins:
        x, scale = lin.args[:2]
        assert gu.is_call(x, aten.view.default, aten._unsafe_view.default, aten.reshape.default)
        assert gu.dtype_of(x) == INT8 and gu.dtype_of(scale) == FP32 and tuple(gu.val(x).shape) == (6, 64)
        assert x.args[0].target is aten.unsqueeze.default
        assert gu.through_views(x).args == (quant, 0) and scale.args == (quant, 1)
    x = _rand(2, 3, 64, seed=52)
    for got, (name, w) in zip(gm(x), ws.items()):
        torch.testing.assert_close(got, _int8_reference(x * 2, w).view(2, 3, -1), atol=1e-5, rtol=1e-5)
    for got, want in zip(gm(x), ref(x)):
        assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99


def test_int8_lone_consumer_quantises_in_its_prologue(caps):
    gm = build(lambda x, w: F.linear(x * 2, w), [torch.zeros(6, 64)], {"w": W})
    run(gm, "int8")
    assert not calls(gm, tt.quantize_per_token.default)
    lin = one(gm, tt.int8_linear.default)
    assert lin.args[1] is None and gu.is_call(lin.args[0], aten.mul.Tensor)


def _norm_then_linears(n_linears, extra_user=False, kind="rms"):
    def fn(x, r, nw, nb, *ws):
        h, res = tt.norm(x, nw, nb if kind == "layer" else None, r, kind=kind, eps=1e-5)
        h3 = h.view(2, 3, 64)
        outs = [F.linear(h3, w) for w in ws]
        return (*outs, res * 1) + ((h.sum(),) if extra_user else ())
    ws = {f"w{i}": _rand(32, 64, seed=60 + i) for i in range(n_linears)}
    return build(fn, [torch.zeros(6, 64), torch.zeros(6, 64)], {"nw": NORM_W, "nb": NORM_B, **ws}), ws


@pytest.mark.parametrize("n_linears, kind", [(1, "rms"), (2, "layer")])
def test_int8_norm_feeding_int8_gemms_quantises(caps, n_linears, kind):
    gm, ws = _norm_then_linears(n_linears, kind=kind)
    ref, _ = _norm_then_linears(n_linears, kind=kind)
    run(gm, "int8")
    assert not calls(gm, tt.norm.default, tt.quantize_per_token.default)
    nq = one(gm, tt.norm_quant.default)
    assert nq.kwargs == {"kind": kind, "eps": 1e-5} and (nq.args[2] is None) == (kind == "rms")
    assert nq.args[3] is not None
    for lin in calls(gm, tt.int8_linear.default):
        assert gu.through_views(lin.args[0]).args == (nq, 0) and lin.args[1].args == (nq, 1)
    x, r = _rand(6, 64, seed=70), _rand(6, 64, seed=71)
    got, want = gm(x, r), ref(x, r)
    torch.testing.assert_close(got[-1], want[-1])  # the residual stream, read from norm_quant's third output
    from ttftc.ops.norm_linear import normalize
    h = normalize(x + r, NORM_W, NORM_B if kind == "layer" else None, kind=kind, eps=1e-5)
    for out, w in zip(got[:-1], ws.values()):
        torch.testing.assert_close(out, _int8_reference(h, w).view(2, 3, -1), atol=1e-5, rtol=1e-5)


def test_int8_norm_with_another_reader_stays_a_norm(caps):
    gm, _ = _norm_then_linears(2, extra_user=True)
    run(gm, "int8")
    assert one(gm, tt.norm.default) and not calls(gm, tt.norm_quant.default)
    quant = one(gm, tt.quantize_per_token.default)  # the two GEMMs still share one quantisation
    assert all(gu.through_views(lin.args[0]).args == (quant, 0) for lin in calls(gm, tt.int8_linear.default))
    gm, _ = _norm_then_linears(1, extra_user=True)
    run(gm, "int8")
    assert not calls(gm, tt.norm_quant.default, tt.quantize_per_token.default)
    assert one(gm, tt.int8_linear.default).args[1] is None


def test_int8_norm_without_a_residual_reader_quantises(caps):
    # The norm's second output (the residual stream) read by nobody: nothing to re-point.
    def fn(x, nw, w):
        return F.linear(tt.norm(x, nw, None, None, kind="rms", eps=1e-5)[0], w)
    gm = build(fn, [torch.zeros(6, 64)], {"nw": NORM_W, "w": W})
    run(gm, "int8")
    nq = one(gm, tt.norm_quant.default)
    lin = one(gm, tt.int8_linear.default)
    assert lin.args[0].args == (nq, 0) and lin.args[1].args == (nq, 1) and not calls(gm, tt.norm.default)
    x = _rand(6, 64, seed=72)
    from ttftc.ops.norm_linear import normalize
    expected = _int8_reference(normalize(x, NORM_W, None, kind="rms", eps=1e-5), W)
    torch.testing.assert_close(gm(x), expected, atol=1e-5, rtol=1e-5)


def test_int8_lone_consumer_before_a_norm_does_not_stop_the_norm_fusion(caps):
    # Producers are visited in graph order: a first one that is left alone must not end the walk.
    def fn(x, nw, w1, w2):
        first = F.linear(x * 2, w1)
        return first, F.linear(tt.norm(x, nw, None, None, kind="rms", eps=1e-5)[0], w2)
    gm = build(fn, [torch.zeros(6, 64)], {"nw": NORM_W, "w1": W, "w2": W})
    run(gm, "int8")
    nq = one(gm, tt.norm_quant.default)
    lone, fused = sorted(calls(gm, tt.int8_linear.default), key=lambda n: n.args[1] is not None)
    assert lone.args[1] is None and fused.args[1].args == (nq, 1)


def test_fuse_quant_producers_replays_views_with_keyword_arguments():
    # Row views written with keyword arguments (hand-built or normalised graphs) are replayed with them.
    def fn(x, r, nw):
        return tt.norm(x, nw, None, r, kind="rms", eps=1e-5)
    gm = build(fn, [torch.zeros(6, 64), torch.zeros(6, 64)], {"nw": NORM_W})
    norm = one(gm, tt.norm.default)
    getitem0 = next(u for u in norm.users if u.args[1] == 0)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        wq, ws = _w8a8_rewrite._int8_weight(gm, W, "w")
        view = gu.call(gm, aten.view.default, (getitem0,), {"size": [2, 3, 64]})
        lin = gu.call(gm, tt.int8_linear.default, (view, None, wq, ws, None), {"out_dtype": FP32})
    out.args = ((lin, out.args[0][1]),)
    _w8a8_rewrite.fuse_quant_producers(gm)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    replayed = lin.args[0]
    assert replayed.target is aten.view.default and replayed.kwargs == {"size": [2, 3, 64]}
    assert replayed.args[0].args == (one(gm, tt.norm_quant.default), 0)


def test_fuse_quant_producers_edge_cases():
    def fn(x, r, nw, w1, w2):
        h, res = tt.norm(x, nw, None, r, kind="rms", eps=1e-5)
        return h, res
    gm = build(fn, [torch.zeros(6, 64), torch.zeros(6, 64)], {"nw": NORM_W, "w1": W, "w2": W})
    norm = one(gm, tt.norm.default)
    getitem0 = next(u for u in norm.users if u.args[1] == 0)
    wq, ws = _w8a8_rewrite._int8_weight(gm, W, "w")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        view = gu.call(gm, aten.view.default, (getitem0, [6, 64]))
        unused_view = gu.call(gm, aten.view.default, (getitem0, [6, 64]))
        lin = gu.call(gm, tt.int8_linear.default, (view, None, wq, ws, None), {"out_dtype": FP32})
    out.args = ((lin, out.args[0][1]),)
    # A view of the norm's output that nobody reads keeps the norm a norm (its one consumer quantises itself).
    assert not _w8a8_rewrite._all_users_are(getitem0, {lin})
    gm.graph.erase_node(unused_view)
    assert _w8a8_rewrite._all_users_are(getitem0, {lin})
    with gm.graph.inserting_before(out):
        direct = gu.call(gm, tt.int8_linear.default, (getitem0, None, wq, ws, None), {"out_dtype": FP32})
        float_reader = gu.call(gm, aten.relu.default, (getitem0,))  # after a direct consumer in getitem0's users
    assert _w8a8_rewrite._all_users_are(getitem0, {lin, direct, float_reader})
    assert not _w8a8_rewrite._all_users_are(getitem0, {lin, direct})
    gm.graph.erase_node(float_reader)
    gm.graph.erase_node(direct)
    assert _w8a8_rewrite._int8_consumers_without_scale(gm) == {getitem0: [(lin, [view])]}
    _w8a8_rewrite.fuse_quant_producers(gm)
    nq = one(gm, tt.norm_quant.default)
    assert lin.args[0].target is aten.view.default and lin.args[0].args[0].args == (nq, 0)
    assert lin.args[0].args[1] == [6, 64]


def test_int8_consumers_with_a_scale_or_a_non_float_root_are_left_alone():
    gm = build(lambda x, s, w, ws: tt.int8_linear(x, s, w, ws, out_dtype=FP32) + tt.int8_linear(x, s, w, ws, out_dtype=FP32),
               [torch.zeros(6, 64, dtype=INT8), torch.zeros(6)], {"w": torch.zeros(32, 64, dtype=INT8),
                                                                     "ws": torch.ones(32)})
    assert _w8a8_rewrite._int8_consumers_without_scale(gm) == {}
    gm = build(lambda x, w, ws: tt.int8_linear(x, None, w, ws, out_dtype=FP32) + tt.int8_linear(x, None, w, ws, out_dtype=FP32),
               [torch.zeros(6, 64, dtype=FP16)], {"w": torch.zeros(32, 64, dtype=INT8), "ws": torch.ones(32)})
    (root, consumers), = _w8a8_rewrite._int8_consumers_without_scale(gm).items()
    assert root.op == "placeholder" and len(consumers) == 2
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    x.meta["val"] = x.meta["val"].to(torch.int32)
    assert _w8a8_rewrite._int8_consumers_without_scale(gm) == {}


def test_gated_ffn_int8_consumers_share_a_quantisation(caps):
    def fn(x, w_gu, w_down, w):
        h = x * 2
        return tt.gated_ffn(h, w_gu, w_down, act="silu"), F.linear(h, w)
    gm = build(fn, [torch.zeros(6, 64)], {"w_gu": W_GU, "w_down": W_DOWN, "w": W})
    run(gm, "int8")
    quant = one(gm, tt.quantize_per_token.default)
    ffn = one(gm, tt.gated_ffn_int8.default)
    assert ffn.args[0].args == (quant, 0) and ffn.args[1].args == (quant, 1)


# -- cast round trips ----------------------------------------------------------------------------------------


def test_bf16_to_bf16_through_views_reads_the_bf16_tensor(caps):
    def fn(x, q, k, v, w):
        a = tt.attention(q, k, v, causal=True, scale=0.25)  # bf16 inside, fp32 out
        return F.linear(a.transpose(1, 2).reshape(8, 32), w)
    gm = build(fn, [torch.zeros(1)] + [torch.zeros(1, 2, 8, 16)] * 3, {"w": _rand(32, 32)})
    ref = build(fn, [torch.zeros(1)] + [torch.zeros(1, 2, 8, 16)] * 3, {"w": _rand(32, 32)})
    run(gm, "bf16")
    att, mm = one(gm, tt.attention.default), one(gm, aten.mm.default)
    # No widening cast is left between attention and the o_proj GEMM.
    assert [n.kwargs["dtype"] for n in calls(gm, aten._to_copy.default)] == [BF16, BF16, BF16, FP32]
    assert gu.through_views(mm.args[0].args[0]) if gu.is_call(mm.args[0], aten.transpose.int) else True
    node, seen = mm.args[0], []
    while node is not att:
        seen.append(node.target)
        node = node.args[0]
    assert aten._to_copy.default not in seen and seen
    q, k, v = _qkv()
    torch.testing.assert_close(gm(torch.zeros(1), q, k, v), ref(torch.zeros(1), q, k, v), atol=0.05, rtol=0.05)


def _round_trip_gm(consumer, via=lambda t: t.view(4, 2, 8)):
    def fn(y, w, ws):
        widened = via(y.to(FP32))
        return consumer(widened, w, ws)
    return build(fn, [torch.zeros(8, 8, dtype=BF16)], {"w": torch.ones(16, 8, dtype=INT8), "ws": torch.ones(16)})


def test_elide_round_trips_into_int8_consumers():
    gm = _round_trip_gm(lambda t, w, ws: tt.int8_linear(t, None, w, ws, out_dtype=FP32))
    rest = one(gm, tt.int8_linear.default).args[1:]
    _bf16_rewrite.elide_round_trips(gm)
    assert one(gm, tt.int8_linear.default).args[1:] == rest  # only the activation slot is re-pointed
    gm.graph.eliminate_dead_code()
    lin = one(gm, tt.int8_linear.default)
    assert gu.dtype_of(lin.args[0]) == BF16 and lin.args[0].target is aten.view.default
    assert lin.args[0].args[1] == [4, 2, 8] and lin.args[0].args[0].op == "placeholder"
    assert not calls(gm, aten._to_copy.default)
    # With a scale given, int8_linear reads its input as int8: nothing to elide (and the cast stays).
    gm = _round_trip_gm(lambda t, w, ws: tt.int8_linear(t.to(INT8), ws[:8].repeat(4).view(4, 8), w, ws,
                                                        out_dtype=FP32))
    cast_count = len(calls(gm, aten._to_copy.default))
    _bf16_rewrite.elide_round_trips(gm)
    assert len(calls(gm, aten._to_copy.default)) == cast_count


def test_elide_round_trips_into_quantize_per_token_and_gated_ffn_int8():
    gm = _round_trip_gm(lambda t, w, ws: tt.quantize_per_token(t)[0], via=lambda t: t.unsqueeze(0).clone())
    _bf16_rewrite.elide_round_trips(gm)
    gm.graph.eliminate_dead_code()
    quant = one(gm, tt.quantize_per_token.default)
    assert gu.dtype_of(quant.args[0]) == BF16 and not calls(gm, aten._to_copy.default)
    assert [n.target for n in (quant.args[0], quant.args[0].args[0])] == [aten.clone.default, aten.unsqueeze.default]

    def ffn(t, w, ws):
        return tt.gated_ffn_int8(t.reshape(8, 8), None, w, ws, w[:8], ws[:8], act="silu", out_dtype=FP32)
    gm = _round_trip_gm(ffn, via=lambda t: t.permute(1, 0))
    _bf16_rewrite.elide_round_trips(gm)
    gm.graph.eliminate_dead_code()
    node = one(gm, tt.gated_ffn_int8.default)
    assert gu.dtype_of(node.args[0]) == BF16 and not calls(gm, aten._to_copy.default)


def test_elide_round_trips_leaves_an_int8_gemm_reading_the_widened_tensor_elsewhere():
    # Only the activation slot of an int8 GEMM that quantises for itself reads bf16 as well as fp32; a bias does not.
    def fn(x, b, w, ws):
        return tt.int8_linear(x, None, w, ws, b.to(FP32), out_dtype=FP32)
    gm = build(fn, [torch.zeros(4, 8), torch.zeros(16, dtype=BF16)], {"w": torch.ones(16, 8, dtype=INT8),
                                                                       "ws": torch.ones(16)})
    before = str(gm.graph)
    _bf16_rewrite.elide_round_trips(gm)
    assert str(gm.graph) == before


def test_elide_round_trips_keeps_other_casts():
    # fp32 → bf16 without a bf16 origin, a float reader, a non-view op in between: all stay.
    def fn(y, z):
        a = z.to(FP32).to(BF16)  # z is fp16: widening fp16 is not a bf16 round trip
        b = (y.to(FP32) * 2).to(BF16)
        c = y.to(FP32).view(64).to(FP16)
        return a, b, c
    gm = build(fn, [torch.zeros(8, 8, dtype=BF16), torch.zeros(8, 8, dtype=FP16)])
    before = str(gm.graph)
    _bf16_rewrite.elide_round_trips(gm)
    assert str(gm.graph) == before


def test_elide_round_trips_through_each_view_kind():
    views = [lambda t: t.view(64), lambda t: t.reshape(4, 16), lambda t: t.transpose(0, 1),
             lambda t: t.permute(1, 0), lambda t: t.unsqueeze(0), lambda t: t.clone(),
             lambda t: torch.ops.aten._unsafe_view(t, [64])]
    for via in views:
        gm = build(lambda y: via(y.to(FP32)).to(BF16) * 1, [torch.zeros(8, 8, dtype=BF16)])
        _bf16_rewrite.elide_round_trips(gm)
        gm.graph.eliminate_dead_code()
        assert not calls(gm, aten._to_copy.default), via
        gm.recompile()
        y = _rand(8, 8, dtype=BF16)
        assert torch.equal(gm(y), via(y) * 1)


def test_elide_round_trips_does_not_follow_a_call_module_view():
    gm = build(lambda y: y.to(FP32).view(64).to(BF16), [torch.zeros(8, 8, dtype=BF16)])
    view = one(gm, aten.view.default)
    view.op = "call_method"  # same target, not a call_function: not followed
    _bf16_rewrite.elide_round_trips(gm)
    assert len(calls(gm, aten._to_copy.default)) == 2


# -- precision_common ----------------------------------------------------------------------------------------


def _casts_gm():
    return build(lambda x, c, i: (x * 2 + 1, c + 1, i + 1), [torch.zeros(4, 4)],
                 {"c": torch.ones(4, 4), "i": torch.ones(4, 4, dtype=torch.int64)})


def test_casts_cast_once_right_after_the_producer():
    gm = _casts_gm()
    casts = Casts()
    mul = one(gm, aten.mul.Tensor)
    assert casts.cast(gm, mul, FP32) is mul
    cast = casts.cast(gm, mul, BF16)
    assert cast.prev is mul and is_cast_to(cast, BF16) and gu.dtype_of(cast) == BF16
    assert casts.cast(gm, mul, BF16) is cast
    assert casts.cast(gm, mul, FP16) is not cast
    assert len([n for n in gm.graph.nodes if n.target is aten._to_copy.default]) == 2


def test_casts_const_like():
    gm = _casts_gm()
    casts = Casts()
    c, i = (n for n in gm.graph.nodes if n.op == "get_attr")
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert casts.const_like(gm, None, BF16, "h") is None
    assert casts.const_like(gm, c, FP32, "h") is c
    assert casts.const_like(gm, i, BF16, "h") is i
    new = casts.const_like(gm, c, BF16, "h")
    assert new.op == "get_attr" and new.target == "_ttftc_h" and gu.constant_value(gm, new).dtype == BF16
    live = casts.const_like(gm, x, BF16, "h")
    assert is_cast_to(live, BF16) and live.args == (x,)


def test_casts_restore():
    gm = _casts_gm()
    mul = one(gm, aten.mul.Tensor)
    assert Casts.restore(gm, mul, FP32) is mul
    with gm.graph.inserting_after(mul):
        back = Casts.restore(gm, mul, BF16)
    assert is_cast_to(back, BF16) and back.args == (mul,) and back.prev is mul


def test_is_cast_to():
    gm = build(lambda x: (x.to(BF16), x.to(BF16, copy=True), x.to(memory_format=torch.channels_last).to(FP16),
                          torch.ops.aten._to_copy(x, dtype=BF16, layout=torch.strided)), [torch.zeros(1, 2, 3, 4)])
    c0, *rest = calls(gm, aten._to_copy.default)
    assert is_cast_to(c0, BF16) and not is_cast_to(c0, FP16)
    assert not is_cast_to(rest[-1], BF16)  # a layout kwarg too: not a plain cast
    assert not is_cast_to(one(gm, aten._to_copy.default) if False else c0.args[0], BF16)
    assert not is_cast_to("x", BF16)


def test_rewire_tuple():
    g = fx.Graph()
    x = g.placeholder("x")
    tup = g.call_function(tt.norm.default, (x,))
    first, second = g.call_function(operator.getitem, (tup, 0)), g.call_function(operator.getitem, (tup, 1))
    out = g.output((first, second))
    a, b = g.placeholder("a"), g.placeholder("b")
    rewire_tuple(tup, {0: a, 1: b})
    assert out.args[0] == (a, b)
    with pytest.raises(ValueError, match=r"^output 1 of norm_default is read but has no replacement$"):
        rewire_tuple(tup, {0: a})  # the getitems still read tup


# -- module names --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, clean", [
    ("L['self'].model.layers[0].mlp.down_proj", "model.layers.0.mlp.down_proj"),
    ("L['args'][0].lm_head", "lm_head"),
    ("L['self']._modules['model']._modules['layers']['3']", "model.layers.3"),
    ("L['self']", ""),
    ("model.layers[12]", "model.layers.12"),
    ("L['fn'].encoder['block'][1]", "encoder.block.1"),
    ("L['self'].model.X", "model.X"),  # only dots are stripped
])
def test_clean_path(raw, clean):
    assert _module_names._clean_path(raw) == clean


def _node(g, target, *args, stack=None):
    n = g.call_function(target, args)
    if stack is not None:
        n.meta["nn_module_stack"] = {f"k{i}": (path, None) for i, path in enumerate(stack)}
    return n


def test_module_path():
    g = fx.Graph()
    x = g.placeholder("x")
    assert _module_names.module_path(x) is None
    x.meta["nn_module_stack"] = {}
    assert _module_names.module_path(x) is None
    x.meta["nn_module_stack"] = {"a": ("L['self'].model", None), "b": ("L['self'].model.layers[1]", None)}
    assert _module_names.module_path(x) == "model.layers.1"
    x.meta["nn_module_stack"] = {"a": ("L['self'].model", None), "b": ("L['self'].model.layers[1]", None),
                                 "c": ("L['self'].model.layers[1].mlp", None)}
    assert _module_names.module_path(x) == "model.layers.1.mlp"  # the innermost
    x.meta["nn_module_stack"] = {"a": "L['self'].lm_head"}
    assert _module_names.module_path(x) == "lm_head"


def test_fused_nodes_are_named_by_the_layers_they_feed():
    g = fx.Graph()
    x = g.placeholder("x")
    fused = _node(g, tt.norm_linear.default, x)
    out0 = _node(g, operator.getitem, fused, 0)
    res = _node(g, operator.getitem, fused, 1)
    _node(g, aten.view.default, out0, [1], stack=["L['self'].model.layers[0].self_attn.q_proj"])
    _node(g, aten.view.default, out0, [2], stack=["L['self'].model.layers[0].self_attn.q_proj"])  # named once
    split = _node(g, aten.split.Tensor, out0, 2)
    _node(g, aten.view.default, split, [1], stack=["L['self'].model.layers[0].self_attn.k_proj"])
    _node(g, aten.add.Tensor, split, 1, stack=["L['self'].model.layers[0]"])  # a prefix of the others: dropped
    _node(g, aten.add.Tensor, res, 1, stack=["L['self'].model.layers[0].mlp"])  # the residual: not read
    names = ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj"]
    assert _module_names.node_module_names(fused) == names
    assert _module_names.describe(fused, "norm_linear") == "+".join(names) + " (norm_linear)"
    fused.meta["nn_module_stack"] = {"a": ("L['self'].model.norm", None)}
    assert _module_names.node_module_names(fused) == ["model.norm"]
    assert _module_names.describe(fused, "norm_linear") == "model.norm"


def test_downstream_names_skip_the_next_gemms_input_view_and_stop_at_depth_5():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    fused = _node(g, tt.gated_ffn.default, x)
    # The view flattening the next linear's input belongs to that linear.
    flat = _node(g, aten.view.default, fused, [1], stack=["L['self'].next_proj"])
    _node(g, aten.mm.default, flat, w)
    assert _module_names.node_module_names(fused) == []
    assert _module_names.describe(fused, "gated_ffn") == "? (gated_ffn)"
    _node(g, aten.relu.default, fused, stack=["L['self'].mlp.down_proj"])  # after the skipped view: still read
    assert _module_names.node_module_names(fused) == ["mlp.down_proj"]
    # A chain of unnamed nodes: a name 5 steps down is found, 6 steps down is not.
    g = fx.Graph()
    x = g.placeholder("x")
    fused = _node(g, tt.gated_ffn.default, x)
    node = fused
    for _ in range(4):
        node = _node(g, aten.relu.default, node)
    named = _node(g, aten.relu.default, node, stack=["L['self'].five"])
    assert _module_names.node_module_names(fused) == ["five"]
    named.meta.pop("nn_module_stack")
    _node(g, aten.relu.default, named, stack=["L['self'].six"])
    assert _module_names.node_module_names(fused) == []


def test_downstream_names_visit_each_node_once():
    g = fx.Graph()
    x = g.placeholder("x")
    fused = _node(g, tt.gated_ffn.default, x)
    a = _node(g, aten.relu.default, fused)
    b = _node(g, aten.relu.default, fused)
    _node(g, aten.add.Tensor, a, b, stack=["L['self'].merge"])
    assert _module_names._downstream_paths(fused) == ["merge"]
    # A cycle of unnamed nodes back to the fused node ends (seen).
    assert _module_names._downstream_paths(a) == ["merge"]


@pytest.mark.parametrize("make, feeds", [
    (lambda g, v, w: _node(g, aten.mm.default, v, w), True),
    (lambda g, v, w: _node(g, aten.mm.default, w, v), False),
    (lambda g, v, w: _node(g, aten.addmm.default, w, v, w), True),
    (lambda g, v, w: _node(g, aten.addmm.default, v, w, w), False),
    (lambda g, v, w: _node(g, tt.linear.default, v, w), True),
    (lambda g, v, w: _node(g, tt.linear.default, w, v), False),
    (lambda g, v, w: _node(g, aten.relu.default, v), False),
])
def test_feeds_gemm(make, feeds):
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    view = _node(g, aten.view.default, x, [1])
    make(g, view, w)
    assert _module_names._feeds_gemm(view) is feeds
    relu = _node(g, aten.relu.default, x)
    _node(g, aten.mm.default, relu, w)
    assert not _module_names._feeds_gemm(relu)  # not a view


def test_activation_input():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    assert _module_names._activation_input(_node(g, aten.mm.default, x, w)) is x
    assert _module_names._activation_input(_node(g, aten.addmm.default, w, x, w)) is x
    assert _module_names._activation_input(_node(g, tt.norm.default, x, w)) is x
    assert _module_names._activation_input(_node(g, tt.norm.default)) is None
    assert _module_names._activation_input(_node(g, aten.relu.default, x)) is None
    method = g.call_method("relu", (x,))
    assert _module_names._activation_input(method) is None
    assert _module_names._activation_input(_node(g, operator.getitem, x, 0)) is None  # a target with no namespace


# -- quant-dequant patterns already in a graph ---------------------------------------------------------------

import torch.ao.quantization.fx._decomposed  # noqa: E402,F401  (registers quantized_decomposed)

QD = torch.ops.quantized_decomposed
W_Q, W_S = quantize_per_token(W)  # int8 [32, 64], fp32 [32]
W_ZP = torch.zeros(32, dtype=torch.int64)


def pt2e_gm(bias=True, x_shape=(6, 64), zp=(0, 0, 0), act_dtype=INT8, dq_scale=0.02, axis=0, per_tensor_w=False,
            live=(), w_q=W_Q):
    """x → quantize_per_tensor → dequantize_per_tensor → linear over a dequantized int8 weight (convert_pt2e)."""
    x_zp, dq_zp, w_zp = zp
    channels = w_q.shape[axis]
    consts = {"w_q": w_q, "w_s": torch.ones(channels) * 0.01 if channels != 32 else W_S,
              "w_zp": torch.zeros(channels, dtype=torch.int64) + w_zp, "b": B}
    inputs = [torch.zeros(x_shape)] + [consts.pop(name) for name in live]

    def fn(x, *rest):
        named = dict(zip(list(live) + list(consts), rest))
        lo, hi = (-128, 127) if act_dtype == INT8 else (0, 255)
        x_q = QD.quantize_per_tensor(x, 0.02, x_zp, lo, hi, act_dtype)
        x_dq = QD.dequantize_per_tensor(x_q, dq_scale, dq_zp, lo, hi, act_dtype)
        if per_tensor_w:
            w_dq = QD.dequantize_per_tensor(named["w_q"], 0.004, w_zp, -128, 127, INT8)
        else:
            w_dq = QD.dequantize_per_channel(named["w_q"], named["w_s"], named["w_zp"], axis, -128, 127, INT8)
        return F.linear(x_dq, w_dq, named["b"] if bias else None)
    return build(fn, inputs, consts)


def _match(gm):
    node = next(n for n in calls(gm, aten.mm.default, aten.addmm.default))
    return _quant_patterns.match_pt2e_linear(gm, node)


@pytest.mark.parametrize("precision", ["int8", "bf16"])
@pytest.mark.parametrize("bias, x_shape", [(True, (6, 64)), (False, (2, 3, 64))])
def test_pt2e_linear_fuses_into_int8_linear(caps, precision, bias, x_shape):
    gm, ref = pt2e_gm(bias, x_shape), pt2e_gm(bias, x_shape)
    stats = run(gm, precision)
    assert (stats.matched, stats.rejections) == (1, [])
    lin = one(gm, tt.int8_linear.default)
    assert not calls(gm, aten.mm.default, aten.addmm.default, QD.dequantize_per_channel.default,
                     QD.dequantize_per_tensor.default)
    x = lin.args[0]
    assert gu.dtype_of(x) == INT8 and gu.through_views(x).target is QD.quantize_per_tensor.default
    assert torch.equal(gu.constant_value(gm, lin.args[2]), W_Q)
    assert torch.equal(gu.constant_value(gm, lin.args[3]), W_S)
    assert (gu.constant_value(gm, lin.args[4]) is B) if bias else lin.args[4] is None
    assert attrs(gm) == {"_ttftc_quant_w_int8", "_ttftc_quant_w_scale"} | ({"b"} if bias else set())
    assert lin.kwargs == {"out_dtype": FP32}
    scale = lin.args[1]  # one python-float scale for the tensor, spread over the tokens
    assert tuple(gu.val(scale).shape) == (6,) and gu.dtype_of(scale) == FP32
    xin = _rand(*x_shape, seed=80)
    torch.testing.assert_close(gm(xin), ref(xin), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("zero", [0, 3])
def test_pt2e_activation_with_frozen_scale_and_zero_point_tensors(caps, zero):
    # The .tensor overloads take the activation's qparams as tensors: zero points are judged by their frozen value.
    def fn(x, s, zp, w_q, w_s, w_zp):
        x_dq = QD.dequantize_per_tensor.tensor(QD.quantize_per_tensor.tensor(x, s, zp, -128, 127, INT8), s, zp,
                                               -128, 127, INT8)
        return F.linear(x_dq, QD.dequantize_per_channel(w_q, w_s, w_zp, 0, -128, 127, INT8))
    consts = {"s": torch.tensor(0.02), "zp": torch.tensor(zero), "w_q": W_Q, "w_s": W_S, "w_zp": W_ZP}
    gm, ref = build(fn, [torch.zeros(6, 64)], consts), build(fn, [torch.zeros(6, 64)], consts)
    stats = run(gm, "int8")
    if zero:
        assert stats.rejections == ["? (linear): quant-dequant pattern: asymmetric (non-zero zero point) "
                                    "quantisation: int8_linear is symmetric"]
        assert not calls(gm, tt.int8_linear.default)
        return
    assert (stats.matched, stats.rejections) == (1, [])
    lin = one(gm, tt.int8_linear.default)
    assert gu.through_views(lin.args[0]).target is QD.quantize_per_tensor.tensor
    xin = _rand(6, 64, seed=82)
    torch.testing.assert_close(gm(xin), ref(xin), atol=1e-5, rtol=1e-5)


def test_pt2e_per_tensor_weight_scale(caps):
    gm, ref = pt2e_gm(per_tensor_w=True), pt2e_gm(per_tensor_w=True)
    info = _match(gm)
    assert "refusal" not in info and torch.equal(info["w_scale"], torch.full((32,), 0.004))
    assert info["w_scale"].dtype == FP32
    run(gm, "int8")
    assert torch.equal(gu.constant_value(gm, one(gm, tt.int8_linear.default).args[3]), torch.full((32,), 0.004))
    xin = _rand(6, 64, seed=81)
    torch.testing.assert_close(gm(xin), ref(xin), atol=1e-5, rtol=1e-5)


def test_pt2e_match_pieces():
    gm = pt2e_gm(x_shape=(2, 3, 64))
    info = _match(gm)
    quant, dequant = one(gm, QD.quantize_per_tensor.default), one(gm, QD.dequantize_per_tensor.default)
    assert info["x_q"] is quant and info["x_root"] is quant and info["x_dq"] is dequant
    assert [n.target for n in info["x_chain"]] == [aten.view.default]
    assert info["w_dq"] is one(gm, QD.dequantize_per_channel.default) and info["bias"].target == "b"
    assert torch.equal(info["w_q"], W_Q) and info["x_scale"] == 0.02
    assert "refusal" not in info


@pytest.mark.parametrize("kwargs, refusal", [
    ({"zp": (3, 3, 0)}, "asymmetric (non-zero zero point) quantisation: int8_linear is symmetric"),
    ({"zp": (3, 0, 0)}, "asymmetric (non-zero zero point) quantisation: int8_linear is symmetric"),
    ({"zp": (0, 3, 0)}, "asymmetric (non-zero zero point) quantisation: int8_linear is symmetric"),
    ({"zp": (0, 0, 1)}, "asymmetric (non-zero zero point) quantisation: int8_linear is symmetric"),
    ({"zp": (0, 0, 1), "per_tensor_w": True}, "asymmetric (non-zero zero point) quantisation: int8_linear is symmetric"),
    ({"act_dtype": torch.uint8}, "activation is not int8 with one scale for quantize and dequantize"),
    ({"dq_scale": 0.03}, "activation is not int8 with one scale for quantize and dequantize"),
    ({"axis": 1}, "weight scales are not frozen per output channel (axis 0)"),
    ({"live": ("w_s",)}, "weight scales are not frozen per output channel (axis 0)"),
    ({"live": ("w_q",)}, "weight is not a frozen 2-D int8 tensor"),
    ({"live": ("b",)}, "bias is not frozen"),
])
def test_pt2e_refusals(caps, kwargs, refusal):
    gm = pt2e_gm(**kwargs)
    assert _match(gm)["refusal"] == refusal
    stats = run(gm, "int8")
    assert stats.rejections == [f"? (linear): quant-dequant pattern: {refusal}"] and stats.matched == 0
    assert not calls(gm, tt.int8_linear.default)


def test_pt2e_refusals_of_hand_edited_graphs(caps):
    for weight in (W_Q.view(torch.uint8), W_Q[None]):
        gm = pt2e_gm()
        set_constant(gm, "w_q", weight)
        assert _match(gm)["refusal"] == "weight is not a frozen 2-D int8 tensor"
    gm = pt2e_gm()
    dq_w = one(gm, QD.dequantize_per_tensor.default)
    quant = one(gm, QD.quantize_per_tensor.default)
    dq_w.args = (dq_w.args[0].args[0], *dq_w.args[1:])  # dequantize of the float input, no quantize
    assert _match(gm)["refusal"] == "activation dequantize is not fed by a quantize_per_tensor"
    dq_w.args = (quant, *dq_w.args[1:])
    assert "refusal" not in _match(gm)
    gm = pt2e_gm(per_tensor_w=True)
    w_dq = [n for n in calls(gm, QD.dequantize_per_tensor.default) if n.args[0].op == "get_attr"][0]
    w_dq.args = (w_dq.args[0], one(gm, QD.quantize_per_tensor.default), *w_dq.args[2:])
    assert _match(gm)["refusal"] == "per-tensor weight scale is not a constant"
    gm = pt2e_gm(per_tensor_w=True)
    w_dq = [n for n in calls(gm, QD.dequantize_per_tensor.default) if n.args[0].op == "get_attr"][0]
    w_dq.args = (w_dq.args[0], 1, *w_dq.args[2:])  # an int scale is not a float one
    assert _match(gm)["refusal"] == "per-tensor weight scale is not a constant"


def test_pt2e_non_patterns():
    assert _match(linear_gm()) is None  # a plain linear
    gm = build(lambda x, w: F.linear(QD.dequantize_per_tensor(QD.quantize_per_tensor(x, 0.02, 0, -128, 127, INT8),
                                                              0.02, 0, -128, 127, INT8), w), [torch.zeros(6, 64)],
               {"w": W})
    assert _match(gm) is None  # the weight is not dequantized
    gm = build(lambda x, w: torch.mm(QD.dequantize_per_tensor(QD.quantize_per_tensor(x, 0.02, 0, -128, 127, INT8),
                                                              0.02, 0, -128, 127, INT8), w.t().contiguous()),
               [torch.zeros(6, 64)], {"w": W})
    assert _match(gm) is None  # not under t()
    gm = build(lambda x, w, s, z: F.linear(x, QD.dequantize_per_channel(w, s, z, 0, -128, 127, INT8)),
               [torch.zeros(6, 64)], {"w": W_Q, "s": W_S, "z": W_ZP})
    assert _match(gm) is None  # the activation is not dequantized
    gm = build(lambda x, w: F.linear(QD.dequantize_per_tensor(QD.quantize_per_tensor(x, 0.02, 0, -128, 127, INT8),
                                                              0.02, 0, -128, 127, INT8), w.float() * 0.01),
               [torch.zeros(6, 64)], {"w": W_Q})
    assert _match(gm) is None  # the weight is scaled by hand, not a dequantize op
    gm = build(lambda x, w: torch.mm(QD.dequantize_per_tensor(QD.quantize_per_tensor(x, 0.02, 0, -128, 127, INT8),
                                                              0.02, 0, -128, 127, INT8),
                                     QD.dequantize_per_tensor(w, 0.004, 0, -128, 127, INT8) * 1),
               [torch.zeros(6, 64)], {"w": W_Q.t().contiguous()})
    assert _match(gm) is None  # a dequantized weight under another op than t()


def test_is_zero():
    gm = build(lambda x: x * 1, [torch.zeros(1)])
    x = next(nd for nd in gm.graph.nodes if nd.op == "placeholder")
    z, n = gu.add_constant(gm, "z", torch.zeros(3)), gu.add_constant(gm, "n", torch.tensor([0.0, 1.0, 0.0]))
    assert _quant_patterns._is_zero(gm, 0) and _quant_patterns._is_zero(gm, 0.0) and _quant_patterns._is_zero(gm, None)
    assert not _quant_patterns._is_zero(gm, 2) and not _quant_patterns._is_zero(gm, -0.5)
    assert not _quant_patterns._is_zero(gm, False)  # a bool is not a zero point
    assert _quant_patterns._is_zero(gm, z) and not _quant_patterns._is_zero(gm, n)
    assert not _quant_patterns._is_zero(gm, x)  # not frozen: unknown


# -- torchao _int_mm chains ----------------------------------------------------------------------------------


def _per_token(x):
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(x / scale).clamp(-127, 127).to(INT8), scale


def int_mm_gm(order="xw", cast=True, bias=None, w_shape=(32,), out=FP32, casts=1, frozen_t=False, live_w=False):
    consts = {"w_q": W_Q.t().contiguous() if frozen_t else W_Q, "w_s": W_S.view(*w_shape).to(out)}
    if bias is not None:
        consts["b"] = B.to(out)
    inputs = [torch.zeros(6, 64)] + ([consts.pop("w_q")] if live_w else [])

    def fn(x, *rest):
        named = dict(zip((["w_q"] if live_w else []) + list(consts), rest))
        x_q, scale = _per_token(x)
        y = torch._int_mm(x_q, named["w_q"] if frozen_t else named["w_q"].t())
        for _ in range(casts if cast else 0):
            y = y.to(out)
        scale = scale.to(out)
        y = y * scale * named["w_s"] if order == "xw" else (named["w_s"] * y) * scale
        if bias == "after":
            y = y + named["b"]
        elif bias == "before":
            y = named["b"] + y
        return y
    return build(fn, inputs, consts)


def _chain(gm):
    return _quant_patterns.match_int_mm_chain(gm, one(gm, aten._int_mm.default))


def _exact_int32_product(a, b):
    return (a.long() @ b.long()).to(torch.int32)  # |a·b| <= 127 · 128 · K fits int32 for every K here


def exact_int_mm(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph with each aten._int_mm computing the exact int32 product that _int_mm is defined to return: the
    reference for a fused chain. _int_mm itself is no oracle: where oneDNN runs it with AVX2's u8s8 dot products
    (ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI CPU), their int16 sums saturate and it differs from the exact product."""
    for node in calls(gm, aten._int_mm.default):
        node.target = _exact_int32_product
    gm.recompile()
    return gm


@pytest.mark.parametrize("kwargs", [
    {}, {"order": "wx"}, {"bias": "after"}, {"bias": "before", "order": "wx"}, {"w_shape": (1, 32)},
    {"cast": False}, {"out": BF16, "bias": "after"}, {"casts": 2, "bias": "after"}, {"frozen_t": True},
    {"live_w": True, "bias": "after"},
])
def test_int_mm_chain_fuses_into_int8_linear(caps, kwargs):
    gm, ref = int_mm_gm(**kwargs), exact_int_mm(int_mm_gm(**kwargs))
    info = _chain(gm)
    assert not isinstance(info, str), info
    assert info["x_chain"] == [] and info["x_root"].target is aten._to_copy.default
    assert (info["bias"] is not None) == ("bias" in kwargs)
    assert info["end"] is next(n for n in gm.graph.nodes if n.op == "output").args[0][0] if False else True
    stats = run(gm, "int8")
    assert (stats.matched, stats.rejections) == (1, [])
    lin = one(gm, tt.int8_linear.default)
    assert not calls(gm, aten._int_mm.default, aten.mul.Tensor)
    out_dtype = kwargs.get("out", FP32)
    assert lin.kwargs == {"out_dtype": out_dtype} and gu.dtype_of(lin) == out_dtype
    assert gu.dtype_of(lin.args[0]) == INT8 and tuple(gu.val(lin.args[1]).shape) == (6,)
    assert gu.dtype_of(lin.args[3]) == FP32 and tuple(gu.val(lin.args[3]).shape) == (32,)
    if kwargs.get("live_w"):
        assert lin.args[2].op == "placeholder"
    else:
        assert torch.equal(gu.constant_value(gm, lin.args[2]), W_Q)
        assert gu.constant_value(gm, lin.args[2]).is_contiguous()
    if "bias" in kwargs:
        assert gu.dtype_of(lin.args[4]) == FP32
    else:
        assert lin.args[4] is None
    inputs = [_rand(6, 64, seed=90)] + ([W_Q] if kwargs.get("live_w") else [])
    tol = 2e-2 if out_dtype == BF16 else 1e-5
    torch.testing.assert_close(gm(*inputs), ref(*inputs), atol=tol, rtol=tol)


def test_int_mm_chain_pieces():
    gm = int_mm_gm(bias="after")
    info = _chain(gm)
    muls = calls(gm, aten.mul.Tensor)
    add = one(gm, aten.add.Tensor)
    assert info["end"] is add and info["bias"].target == "b" and info["out_dtype"] == FP32
    assert tuple(gu.val(info["x_scale"]).shape) == (6, 1) and info["w_scale"].target == "w_s"
    assert info["x_scale"] in muls[-2].args and torch.equal(info["w_q"], W_Q)


def _uint8_gm(offset=128, correction=True, corr_offset=128, widen=torch.int32, sum_of=lambda b: b):
    """torchao's CPU form: _int_mm of (x_q + 128) as uint8, minus 128 · the column sums of B."""
    def fn(x, w_q, w_s):
        x_q, scale = _per_token(x)
        a = (x_q.to(widen) + offset).to(torch.uint8)
        b = w_q.t()
        y = torch._int_mm(a, b)
        if correction:
            y = y - sum_of(b).sum([0]) * corr_offset
        return y.to(FP32) * scale * w_s
    return build(fn, [torch.zeros(6, 64)], {"w_q": W_Q, "w_s": W_S})


def test_int_mm_uint8_offset_form(caps):
    gm = _uint8_gm()
    sub, mm = one(gm, aten.sub.Tensor), one(gm, aten._int_mm.default)
    assert _quant_patterns._is_offset_correction(sub, mm, mm.args[1])
    total = sub.args[1].args[0]
    total.args = (total.args[0], [1])  # a sum over the other dimension is no correction
    assert not _quant_patterns._is_offset_correction(sub, mm, mm.args[1])
    total.args = (total.args[0], [0])
    assert _quant_patterns._is_offset_correction(sub, mm, mm.args[1])
    info = _chain(gm)
    assert not isinstance(info, str), info
    assert gu.dtype_of(info["x_root"]) == INT8 and info["x_root"].target is aten._to_copy.default
    run(gm, "int8")
    lin = one(gm, tt.int8_linear.default)
    assert not calls(gm, aten._int_mm.default, aten.sub.Tensor)
    x = _rand(6, 64, seed=91)
    x_q, scale = _per_token(x)
    expected = (x_q.double() @ W_Q.double().t() * scale.double() * W_S.double()).float()
    torch.testing.assert_close(gm(x), expected, atol=1e-5, rtol=1e-5)
    assert gu.dtype_of(lin.args[0]) == INT8


@pytest.mark.parametrize("kwargs, reason", [
    ({"correction": False}, "uint8 activation without the matching offset correction"),
    ({"corr_offset": 127}, "uint8 activation without the matching offset correction"),
    ({"sum_of": lambda b: b.to(torch.int32)}, "uint8 activation without the matching offset correction"),
    ({"offset": 127}, "activation operand is torch.uint8, not int8"),
    ({"widen": torch.int64}, "activation operand is torch.uint8, not int8"),
])
def test_int_mm_uint8_refusals(kwargs, reason):
    assert _chain(_uint8_gm(**kwargs)) == reason


def test_int_mm_offset_source_and_correction_shapes():
    gm = _uint8_gm()
    mm = one(gm, aten._int_mm.default)
    a, b = mm.args
    assert _quant_patterns._uint8_offset_source(a).target is aten._to_copy.default
    assert _quant_patterns._uint8_offset_source(b) is None
    assert _quant_patterns._uint8_offset_source(a.args[0]) is None  # the add, not the cast
    relu = gm.graph.call_function(aten.relu.default, (mm,))
    assert not _quant_patterns._is_offset_correction(relu, mm, b)
    sub = one(gm, aten.sub.Tensor)
    assert not _quant_patterns._is_offset_correction(sub, relu, b)  # not a correction of this mm


def test_int_mm_chain_refusals():
    def chain(fn, *inputs, consts=None):
        return _chain(build(fn, [torch.zeros(6, 64), *inputs], consts or {"w_q": W_Q, "w_s": W_S}))
    assert chain(lambda x, w_q, w_s: torch._int_mm(_per_token(x)[0], w_q.t()).to(FP32) * w_s) == (
        "no per-token activation scale and per-channel weight scale multiplies after it")
    assert chain(lambda x, w_q, w_s: torch._int_mm(_per_token(x)[0], w_q.t()).to(FP32) * _per_token(x)[1]) == (
        "no per-token activation scale and per-channel weight scale multiplies after it")
    # Two per-token scales: the second is not a weight scale.
    assert chain(lambda x, w_q, w_s: torch._int_mm(_per_token(x)[0], w_q.t()) * _per_token(x)[1] * _per_token(x)[1]
                 ) == "no per-token activation scale and per-channel weight scale multiplies after it"
    # A weight scale of another length; a python-number factor.
    assert chain(lambda x, w_q, w_s: torch._int_mm(_per_token(x)[0], w_q.t()) * _per_token(x)[1] * w_s[:1]) == (
        "no per-token activation scale and per-channel weight scale multiplies after it")
    assert chain(lambda x, w_q, w_s: torch._int_mm(_per_token(x)[0], w_q.t()).to(FP32) * 0.5 * w_s) == (
        "no per-token activation scale and per-channel weight scale multiplies after it")
    # Two readers of the product: not a chain.
    assert chain(lambda x, w_q, w_s: (lambda y: (y * _per_token(x)[1] * w_s, y))(
        torch._int_mm(_per_token(x)[0], w_q.t()).to(FP32))) == (
        "no per-token activation scale and per-channel weight scale multiplies after it")
    assert chain(lambda x, w_q, w_s: torch._int_mm(_per_token(x)[0], w_q.t().contiguous()) * _per_token(x)[1] * w_s
                 ) == "weight operand is not an int8 [N, K] matrix under t()"
    assert chain(lambda x, w_q, w_s: torch._int_mm(_per_token(x)[0], w_q.t()) * _per_token(x)[1].to(torch.int32)
                 * w_s.to(torch.int32)) == "the chain ends in torch.int32, not a float"
    assert chain(lambda x, w_q, w_s: torch._int_mm(_per_token(x)[0], w_q.t()) * 2 * _per_token(x)[1] * w_s) == (
        "no per-token activation scale and per-channel weight scale multiplies after it")


def test_int_mm_chain_with_a_cast_after_the_scales_or_a_second_bias_stops_there():
    gm = int_mm_gm(bias="after")
    add = one(gm, aten.add.Tensor)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        again = gu.call(gm, aten.add.Tensor, (add, gu.val(add).new_zeros(()) if False else add))
    out.args = ((again,),)
    assert _chain(gm)["end"] is add
    gm = int_mm_gm()
    last = calls(gm, aten.mul.Tensor)[-1]
    with gm.graph.inserting_after(last):
        cast = gu.call(gm, aten._to_copy.default, (last,), {"dtype": BF16})
    for user in list(last.users):
        if user is not cast:
            user.replace_input_with(last, cast)
    assert _chain(gm)["end"] is last and _chain(gm)["out_dtype"] == FP32
    gm = int_mm_gm(bias="after")
    add = one(gm, aten.add.Tensor)
    add.args = (add.args[0], _per_token_node(gm))
    assert _chain(gm)["end"] is calls(gm, aten.mul.Tensor)[-1] and _chain(gm)["bias"] is None


def _per_token_node(gm):
    """A [M, 1] node of the graph (the activation scale): the wrong shape for a bias."""
    return next(n for n in gm.graph.nodes if isinstance(gu.val(n), torch.Tensor) and tuple(gu.val(n).shape) == (6, 1))


def test_same_shape_and_mul_factor():
    assert _quant_patterns._same_shape((6, 1), (6, 1)) and not _quant_patterns._same_shape((6,), (6, 1))
    assert not _quant_patterns._same_shape((6, 2), (6, 1)) and not _quant_patterns._same_shape((6, 1), (6,))
    g = fx.Graph()
    x, y, z = g.placeholder("x"), g.placeholder("y"), g.placeholder("z")
    assert _quant_patterns._mul_factor(g.call_function(aten.mul.Tensor, (x, y)), x) is y
    assert _quant_patterns._mul_factor(g.call_function(aten.mul.Tensor, (y, x)), x) is y
    assert _quant_patterns._mul_factor(g.call_function(aten.mul.Tensor, (y, z)), x) is None
    assert _quant_patterns._mul_factor(g.call_function(aten.add.Tensor, (x, y)), x) is None
    assert _quant_patterns._mul_factor(g.call_function(aten.mul.Tensor, (x, y), {"out": z}), x) is y
    assert _quant_patterns._mul_factor(g.call_function(aten.mul.Tensor, (x,)), x) is None


def _replace_gm():
    """x [6, 64] int8, scales and weights as graph inputs, to call replace_existing_quant directly."""
    return build(lambda x, s, s1, ws, b, wq: x, [torch.zeros(6, 64, dtype=INT8), torch.zeros(6, 1),
                                                 torch.zeros(4, 1), torch.zeros(32, dtype=BF16),
                                                 torch.zeros(32, dtype=BF16), torch.zeros(32, 64, dtype=INT8)])


def test_replace_existing_quant_variants():
    gm = _replace_gm()
    x, s, s1, ws, b, wq = (n for n in gm.graph.nodes if n.op == "placeholder")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        lin = _quant_patterns.replace_existing_quant(gm, x, {"x_root": x, "x_chain": [], "x_scale": s, "w_q": wq,
                                                             "w_scale": ws, "bias": b, "out_dtype": None})
    x_arg, scale, w_q, w_s, bias = lin.args
    assert x_arg is x and scale.target is aten.reshape.default and scale.args == (s, [-1]) and w_q is wq
    assert is_cast_to(w_s, FP32) and w_s.args[0].target is aten.reshape.default and w_s.args[0].args == (ws, [-1])
    assert is_cast_to(bias, FP32) and bias.args == (b,)
    assert lin.kwargs == {"out_dtype": INT8}  # no out_dtype given: the replaced node's
    with gm.graph.inserting_before(out):
        with pytest.raises(RuntimeError, match=r"^activation scale \(4,\) does not have one entry per token$"):
            _quant_patterns.replace_existing_quant(gm, x, {"x_root": x, "x_chain": [], "x_scale": s1, "w_q": W_Q,
                                                           "w_scale": W_S, "out_dtype": FP32})
        # One scale as a node: reshaped to a scalar and spread over the tokens.
        one_scale = gu.call(gm, aten.select.int, (gu.call(gm, aten.select.int, (s, 0, 0)), 0, 0))
        lin = _quant_patterns.replace_existing_quant(gm, x, {"x_root": x, "x_chain": [], "x_scale": one_scale,
                                                             "w_q": W_Q, "w_scale": W_S, "bias": None,
                                                             "out_dtype": BF16})
    scale = lin.args[1]
    assert scale.target is aten.mul.Tensor and scale.args[1].target is aten.reshape.default
    assert scale.args[1].args == (one_scale, [])
    ones = scale.args[0]
    assert ones.target is aten.full_like.default and ones.args[1] == 1.0 and ones.kwargs == {"dtype": FP32}
    assert ones.args[0].target is aten.select.int and ones.args[0].args == (x, 1, 0)
    assert lin.args[4] is None and lin.kwargs == {"out_dtype": BF16}
    assert gu.constant_value(gm, lin.args[2]).is_contiguous() and torch.equal(gu.constant_value(gm, lin.args[3]), W_S)
    gm.graph.erase_node(lin)
    out.args = ((scale,),)
    gm.recompile()
    got = gm(*(torch.full(t.shape, 0.5, dtype=t.dtype) if t.is_floating_point() else torch.ones(t.shape, dtype=t.dtype)
               for t in (gu.val(n) for n in (x, s, s1, ws, b, wq))))
    torch.testing.assert_close(got[0], torch.full((6,), 0.5))


def test_replace_existing_quant_with_a_frozen_bf16_bias_and_an_fp32_live_scale():
    gm = _replace_gm()
    x, s, s1, ws, b, wq = (n for n in gm.graph.nodes if n.op == "placeholder")
    bias = gu.add_constant(gm, "bias", B.to(BF16))
    ws.meta["val"] = gu.val(ws).float()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        lin = _quant_patterns.replace_existing_quant(gm, x, {"x_root": x, "x_chain": [], "x_scale": s, "w_q": wq,
                                                             "w_scale": ws, "bias": bias, "out_dtype": FP32})
    assert torch.equal(gu.constant_value(gm, lin.args[4]), B.to(BF16).float())
    assert gu.dtype_of(lin.args[4]) == FP32 and lin.args[4].target == "_ttftc_quant_bias"
    assert lin.args[3].target is aten.reshape.default  # already fp32: no cast



def test_live_norm_weights_are_refused(caps):
    gm = build(lambda x, nw, w: tt.norm_linear(x, nw, None, w, kind="rms", eps=1e-5)[0] * 1,
               [torch.zeros(6, 64), NORM_W], {"w": W})
    assert run(gm, "bf16").rejections == ["? (norm_linear): bf16 refused: weights are not frozen constants"]


def test_int8_gemms_reading_a_norms_residual_output_share_a_quantize_per_token(caps):
    def fn(x, r, nw, w1, w2):
        h, res = tt.norm(x, nw, None, r, kind="rms", eps=1e-5)
        return F.linear(res, w1), F.linear(res, w2), h * 1
    gm = build(fn, [torch.zeros(6, 64), torch.zeros(6, 64)], {"nw": NORM_W, "w1": W, "w2": W})
    run(gm, "int8")
    assert one(gm, tt.norm.default) and not calls(gm, tt.norm_quant.default)
    quant = one(gm, tt.quantize_per_token.default)
    assert quant.args[0].target is operator.getitem and quant.args[0].args[1] == 1


def test_pt2e_activation_view_with_keyword_arguments_is_replayed_with_them(caps):
    gm, ref = pt2e_gm(x_shape=(2, 3, 64)), pt2e_gm(x_shape=(2, 3, 64))
    flatten = next(n for n in calls(gm, aten.view.default) if gu.is_call(n.args[0], QD.dequantize_per_tensor.default))
    flatten.args, flatten.kwargs = flatten.args[:1], {"size": list(flatten.args[1])}
    gm.recompile()
    assert run(gm, "int8").matched == 1
    x = one(gm, tt.int8_linear.default).args[0]
    assert x.target is aten.view.default and x.kwargs == {"size": [6, 64]}
    xin = _rand(2, 3, 64, seed=96)
    torch.testing.assert_close(gm(xin), ref(xin), atol=1e-5, rtol=1e-5)


def test_pt2e_activation_through_two_row_views(caps):
    def fn(x, w_q, w_s, w_zp):
        x_dq = QD.dequantize_per_tensor(QD.quantize_per_tensor(x, 0.02, 0, -128, 127, INT8), 0.02, 0, -128, 127, INT8)
        return F.linear(x_dq.unsqueeze(0), QD.dequantize_per_channel(w_q, w_s, w_zp, 0, -128, 127, INT8))[0]
    consts = {"w_q": W_Q, "w_s": W_S, "w_zp": W_ZP}
    gm, ref = build(fn, [torch.zeros(2, 3, 64)], consts), build(fn, [torch.zeros(2, 3, 64)], consts)
    assert run(gm, "int8").matched == 1
    x = one(gm, tt.int8_linear.default).args[0]
    assert tuple(gu.val(x).shape) == (6, 64) and x.args[0].target is aten.unsqueeze.default
    xin = _rand(2, 3, 64, seed=95)
    torch.testing.assert_close(gm(xin), ref(xin), atol=1e-5, rtol=1e-5)


def test_pt2e_per_channel_scales_of_another_float_dtype_become_fp32():
    gm = pt2e_gm()
    set_constant(gm, "w_s", W_S.double())
    assert _match(gm)["w_scale"].dtype == FP32 and torch.equal(_match(gm)["w_scale"], W_S)


def test_int_mm_weight_operand_that_is_not_int8_2d():
    gm = int_mm_gm()
    mm = one(gm, aten._int_mm.default)
    assert torch.equal(_quant_patterns._int8_weight_operand(gm, mm.args[1]), W_Q)
    set_constant(gm, "w_q", W_Q.view(torch.uint8))
    assert _quant_patterns._int8_weight_operand(gm, mm.args[1]) is None
    assert _chain(gm) == "weight operand is not an int8 [N, K] matrix under t()"
    set_constant(gm, "w_q", W_Q[None])
    assert _quant_patterns._int8_weight_operand(gm, mm.args[1]) is None
    gm = int_mm_gm(frozen_t=True)
    mm = one(gm, aten._int_mm.default)
    assert torch.equal(_quant_patterns._int8_weight_operand(gm, mm.args[1]), W_Q)
    set_constant(gm, "w_q", W_Q.t().contiguous().view(torch.uint8))
    assert _quant_patterns._int8_weight_operand(gm, mm.args[1]) is None
    gm = int_mm_gm(live_w=True)
    mm = one(gm, aten._int_mm.default)
    live = mm.args[1].args[0]
    assert _quant_patterns._int8_weight_operand(gm, mm.args[1]) is live
    live.meta["val"] = gu.val(live).view(torch.uint8)
    assert _quant_patterns._int8_weight_operand(gm, mm.args[1]) is None
    live.meta["val"] = gu.val(live).view(torch.int8)[None]
    assert _quant_patterns._int8_weight_operand(gm, mm.args[1]) is None
    assert _quant_patterns._int8_weight_operand(gm, live) is None  # not under t()


def _chain_of(fn, *consts):
    gm = build(fn, [torch.zeros(6, 64)], {"w_q": W_Q, "w_s": W_S, "b": B})
    return gm, _chain(gm)


def test_int_mm_chain_shapes_of_what_follows():
    def mm(x, w_q):
        return torch._int_mm(_per_token(x)[0], w_q.t())
    # A cast between the two scale multiplies, a cast to an integer, a bias before the scales: no chain.
    for fn in (lambda x, w_q, w_s, b: (mm(x, w_q) * _per_token(x)[1]).to(BF16) * w_s,
               lambda x, w_q, w_s, b: (mm(x, w_q) * w_s).to(BF16) * _per_token(x)[1],
               lambda x, w_q, w_s, b: mm(x, w_q).to(torch.int64) * _per_token(x)[1] * w_s,
               lambda x, w_q, w_s, b: (mm(x, w_q) + b) * _per_token(x)[1] * w_s,
               lambda x, w_q, w_s, b: (mm(x, w_q) * _per_token(x)[1] + b) * w_s,
               lambda x, w_q, w_s, b: (mm(x, w_q) * w_s + b) * _per_token(x)[1]):
        assert _chain_of(fn)[1] == "no per-token activation scale and per-channel weight scale multiplies after it"
    # A python-number bias and a second weight scale stay outside the chain.
    gm, info = _chain_of(lambda x, w_q, w_s, b: mm(x, w_q) * _per_token(x)[1] * w_s + 1.0)
    assert info["end"] is calls(gm, aten.mul.Tensor)[-1] and info["bias"] is None
    gm, info = _chain_of(lambda x, w_q, w_s, b: mm(x, w_q) * _per_token(x)[1] * w_s * w_s)
    assert info["end"] is calls(gm, aten.mul.Tensor)[-2]
    # At most five steps: cast, cast, cast, two scales, and the bias is left out.
    gm, info = _chain_of(lambda x, w_q, w_s, b: mm(x, w_q).to(FP32).to(BF16).to(FP32) * _per_token(x)[1] * w_s + b)
    assert info["end"] is calls(gm, aten.mul.Tensor)[-1] and info["bias"] is None


def test_int8_chain_with_a_second_weight_scale_keeps_it(caps):
    fn = lambda x, w_q, w_s: torch._int_mm(_per_token(x)[0], w_q.t()).float() * _per_token(x)[1] * w_s * w_s  # noqa
    gm, ref = (build(fn, [torch.zeros(6, 64)], {"w_q": W_Q, "w_s": W_S}) for _ in range(2))
    ref = exact_int_mm(ref)
    assert run(gm, "int8").matched == 1
    x = _rand(6, 64, seed=97)
    torch.testing.assert_close(gm(x), ref(x), atol=1e-5, rtol=1e-5)


def test_int8_gemms_reading_a_tuple_output_other_than_a_norms_share_a_quantize_per_token(caps):
    def fn(x, w1, w2):
        values = torch.sort(x, dim=-1)[0]
        return F.linear(values, w1), F.linear(values, w2)
    gm = build(fn, [torch.zeros(6, 64)], {"w1": W, "w2": W})
    run(gm, "int8")
    quant = one(gm, tt.quantize_per_token.default)
    assert quant.args[0].args[0].target is aten.sort.default and not calls(gm, tt.norm_quant.default)


def _norm_linear_promoting(x_dtype, norm_w):
    """A norm_linear whose output dtype (promoted with norm_w's) differs from its residual output's (x's)."""
    def fn(x, r, nw, w):
        out, res = tt.norm_linear(x, nw, None, w, None, r, kind="rms", eps=1e-5)
        return out * 1, res * 1
    return build(fn, [torch.zeros(6, 64, dtype=x_dtype), torch.zeros(6, 64, dtype=x_dtype)],
                 {"nw": norm_w, "w": W.to(x_dtype)})


def test_norm_linear_rewrites_keep_the_promoted_output_dtype(caps):
    gm = _norm_linear_promoting(FP32, NORM_W.double())
    assert run(gm, "bf16").matched == 1
    out, res = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert (gu.dtype_of(out), gu.dtype_of(res)) == (torch.float64, FP32)
    gm = _norm_linear_promoting(BF16, NORM_W)
    assert run(gm, "int8").matched == 1
    assert one(gm, tt.int8_linear.default).kwargs == {"out_dtype": FP32}
    out, res = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert (gu.dtype_of(out), gu.dtype_of(res)) == (FP32, BF16)


@pytest.mark.parametrize("make, biases", [
    (lambda: linear_act_gm(bias=True), {"b": "_ttftc____linear_act__b"}),
    (lambda: gated_ffn_gm(biases=True), {"b_gu": "_ttftc____gated_ffn__b_gate_up",
                                         "b_down": "_ttftc____gated_ffn__b_down"}),
    (lambda: norm_linear_gm(bias=True), {"b": "_ttftc____norm_linear__b"}),
])
def test_int8_fused_ops_widen_bf16_biases_to_fp32_constants(caps, make, biases):
    gm = make()
    values = {name: gu.constant_value(gm, next(n for n in gm.graph.nodes if n.target == name)) for name in biases}
    for name, value in values.items():
        set_constant(gm, name, value.to(BF16))
    assert run(gm, "int8").matched == 1
    node = one(gm, tt.gated_ffn_int8.default) if "b_gu" in biases else one(gm, tt.int8_linear.default)
    read = {n.target: n for n in node.args if isinstance(n, fx.Node) and n.op == "get_attr"}
    for name, new_name in biases.items():
        assert gu.dtype_of(read[new_name]) == FP32
        assert torch.equal(gu.constant_value(gm, read[new_name]), values[name].to(BF16).float())
    kind = next(iter(biases.values()))[len("_ttftc____"):].rsplit("__", 1)[0]
    weights = {f"_ttftc____{kind}__int8", f"_ttftc____{kind}__scale"} if "b_gu" not in biases else {
        f"_ttftc____gated_ffn__{a}_{b}" for a in ("gate_up", "down") for b in ("int8", "scale")}
    assert attrs(gm) - {"norm_w"} == weights | set(biases.values())  # norm_quant reads the norm weight as it was


def test_int8_norm_read_by_a_gemm_and_something_else_stays_a_norm(caps):
    def fn(x, nw, w):
        h, _ = tt.norm(x, nw, None, None, kind="rms", eps=1e-5)
        return F.linear(h, w), h.sum()  # the GEMM is the norm output's first reader, the sum its second
    gm = build(fn, [torch.zeros(6, 64)], {"nw": NORM_W, "w": W})
    run(gm, "int8")
    assert one(gm, tt.norm.default) and not calls(gm, tt.norm_quant.default, tt.quantize_per_token.default)
    assert one(gm, tt.int8_linear.default).args[1] is None


def _graph_with(*dtypes):
    g = fx.Graph()
    nodes = []
    for i, dtype in enumerate(dtypes):
        node = g.placeholder(f"p{i}")
        node.meta["val"] = torch.zeros(2, 2, dtype=dtype)
        nodes.append(node)
    return g, nodes


def test_is_offset_correction_shapes():
    g, (mm, b, other) = _graph_with(torch.int32, INT8, torch.int32)

    def correction(op=aten.sub.Tensor, first=mm, times_op=aten.mul.Tensor, factor=128, sum_op=aten.sum.dim_IntList,
                   summed=b, dims=(0,)):
        total = g.call_function(sum_op, (summed, list(dims)))
        return g.call_function(op, (first, g.call_function(times_op, (total, factor))))
    assert _quant_patterns._is_offset_correction(correction(), mm, b)
    for kwargs in ({"op": aten.add.Tensor}, {"first": other}, {"times_op": aten.add.Tensor}, {"factor": 127},
                   {"sum_op": aten.amax.default}, {"summed": other}, {"dims": (1,)}):
        assert not _quant_patterns._is_offset_correction(correction(**kwargs), mm, b), kwargs


def test_uint8_offset_source_shapes():
    g, (x_q, y) = _graph_with(INT8, torch.int32)

    def source(out=torch.uint8, offset=128, widen=torch.int32, of=x_q):
        widened = g.call_function(aten._to_copy.default, (of,), {"dtype": widen})
        return g.call_function(aten._to_copy.default, (g.call_function(aten.add.Tensor, (widened, offset)),),
                               {"dtype": out})
    assert _quant_patterns._uint8_offset_source(source()) is x_q
    for kwargs in ({"out": INT8}, {"offset": 127}, {"widen": torch.int64}, {"of": y}):
        assert _quant_patterns._uint8_offset_source(source(**kwargs)) is None, kwargs
    widened = g.call_function(aten.relu.default, (x_q,))  # not a cast to int32
    plus = g.call_function(aten._to_copy.default, (g.call_function(aten.add.Tensor, (widened, 128)),),
                           {"dtype": torch.uint8})
    assert _quant_patterns._uint8_offset_source(plus) is None
