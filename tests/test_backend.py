"""The foundation's contract: the backend is reachable by name, matches eager, adds no graph breaks."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import ttftc
from tests.helpers import assert_logits_match, compile_and_run, needs_transformers, zoo_cases
from ttftc import zoo

pytestmark = needs_transformers


@pytest.mark.parametrize("family, attn", zoo_cases(tuple(zoo.FAMILIES)))
def test_default_backend_matches_eager(family, attn):
    model = zoo.build(family, attn)
    ids = zoo.example_ids(model, 13)
    actual, expected, report = compile_and_run(model, ids)
    assert_logits_match(actual, expected)
    assert report.graphs >= 1


@pytest.mark.parametrize("family", zoo.CORE_FAMILIES)
def test_no_passes_reproduces_eager_exactly(family):
    model = zoo.build(family, "sdpa")
    ids = zoo.example_ids(model, 9)
    actual, expected, report = compile_and_run(model, ids, ttftc.Config(passes=()))
    assert torch.equal(actual, expected)
    assert report.pass_counts == {}
    assert not any(op.startswith("ttftc.") for op in report.ops_after)


def test_entry_point_works_in_a_fresh_interpreter():
    """`backend="ttftc"` must resolve through the entry point in a process that never imports ttftc."""
    script = textwrap.dedent(
        """
        import torch, transformers
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, 128, (1, 7))
        with torch.no_grad():
            expected = model(ids).logits
            actual = torch.compile(model, backend="ttftc")(ids).logits
        assert (actual - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())
        import sys
        assert "ttftc" in sys.modules, "the backend did not come from ttftc"
        print("OK")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")


class _GraphCounter:
    def __init__(self, inner):
        self.inner, self.graphs = inner, 0

    def __call__(self, gm, example_inputs):
        compiled = self.inner(gm, example_inputs)  # a backend that asks Dynamo to retrace compiled nothing yet
        self.graphs += 1
        return compiled


@pytest.mark.parametrize("family", zoo.CORE_FAMILIES)
def test_backend_adds_no_graph_breaks(family):
    model = zoo.build(family, "eager")
    ids = zoo.example_ids(model, 8)
    counts = []
    for inner in ("eager", ttftc.backend()):
        torch._dynamo.reset()
        counter = _GraphCounter(torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner)
        with torch.no_grad():
            torch.compile(model, backend=counter)(ids)
        counts.append(counter.graphs)
    assert counts[0] == counts[1]


def test_compile_rejects_non_modules_with_a_clear_type_error():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ttftc.compile(lambda x: x)
    with pytest.raises(TypeError, match="ttftc.Config"):
        ttftc.backend({"precision": "bf16"})


def test_compile_returns_a_working_module():
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 6)
    compiled = ttftc.compile(model, ttftc.Config())
    with torch.no_grad():
        assert_logits_match(compiled(ids).logits, model(ids).logits)


def test_grad_enabled_graph_runs_uncompiled_with_a_warning():
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 6)
    backend = ttftc.backend()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend=backend)(ids).logits
    assert out.requires_grad, "autograd must be preserved when it was asked for"
    assert any("torch.no_grad" in str(w.message) for w in caught)
    assert any("uncompiled" in note for note in backend.report().notes)


def test_plain_module_with_nothing_to_fuse_runs_unchanged_and_says_why():
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3), torch.nn.Tanh()).eval()
    x = torch.randn(2, 4, 10)
    report = ttftc.explain(model, x)
    with torch.no_grad():
        compiled = torch.compile(model, backend="ttftc")(x)
        assert torch.equal(compiled, model(x))
    assert all(n == 0 for n in report.pass_counts.values())
    text = str(report)
    for name in report.pass_counts:
        assert name in text
    if report.pass_counts:
        assert "no candidate" in text or any(report.rejections.values())


class _BrokenLayer(torch.nn.Module):
    """A layer whose forward breaks the graph, so Dynamo compiles it once and reuses it for every instance."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = torch.relu(self.proj(x))
        torch._dynamo.graph_break()
        return x * 2


def test_frozen_weights_are_never_reused_for_other_weights():
    """Dynamo reuses one graph across layers and instances without guarding on parameter identity; frozen
    weights must follow the parameters actually passed, not the first ones seen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_BrokenLayer(), _BrokenLayer(), _BrokenLayer()).eval()
    x = torch.randn(4, 8)
    backend = ttftc.backend(ttftc.Config(passes=()))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
        twin = torch.nn.Sequential(_BrokenLayer(), _BrokenLayer(), _BrokenLayer()).eval()
        torch.testing.assert_close(torch.compile(twin, backend=backend)(x), twin(x))


def test_two_instances_of_one_model_class_keep_their_own_weights():
    first, second = zoo.build("llama", "sdpa", seed=0), zoo.build("llama", "sdpa", seed=1)
    ids = zoo.example_ids(first, 7)
    backend = ttftc.backend()
    with torch.no_grad():
        for model in (first, second):
            assert_logits_match(torch.compile(model, backend=backend)(ids).logits, model(ids).logits)


def test_config_device_that_disagrees_with_the_tensors_is_reported_not_obeyed():
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 6)
    backend = ttftc.backend(ttftc.Config(device="cuda"))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_logits_match(torch.compile(model, backend=backend)(ids).logits, model(ids).logits)
    assert any("Config.device='cuda'" in str(w.message) for w in caught)
    assert any("tensors are on cpu" in note for note in backend.report().notes)


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_the_hooks_see_the_graph_before_any_rewrite_and_after_lowering():
    from ttftc.dynamo_backend import TtftcBackend

    seen = []

    def on_aten_graph(gm, num_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        seen.append(("aten", len(placeholders), num_inputs, len([n for n in gm.graph.nodes if n.op == "get_attr"])))

    def on_lowered(lowered):
        placeholders = [n for n in lowered.graph_module.graph.nodes if n.op == "placeholder"]
        seen.append(("lowered", len(placeholders), lowered.live_inputs, lowered.num_inputs, lowered.graph_module))

    model, x = _Mlp().eval(), torch.randn(3, 8)
    backend = TtftcBackend(ttftc.Config(passes=()), on_aten_graph=on_aten_graph, on_lowered=on_lowered)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        assert torch.equal(out, model(x))
    # Four weights and the input reach the aten graph as placeholders; after freezing only the input is read.
    assert seen[0] == ("aten", 5, 5, 0)
    (kind, placeholders, live, num_inputs, gm), = seen[1:]
    assert (kind, placeholders, len(live), num_inputs) == ("lowered", 1, 1, 5)
    assert [gm] == backend.graph_modules  # the graph that runs, the one the backend keeps


def test_a_hook_that_raises_ends_the_compile_with_its_exception():
    from torch._dynamo.exc import BackendCompilerFailed

    from ttftc.dynamo_backend import TtftcBackend

    class Stop(Exception):
        pass

    def stop(*args):
        raise Stop()

    for hooks in ({"on_aten_graph": stop}, {"on_lowered": stop}):
        torch._dynamo.reset()
        backend = TtftcBackend(ttftc.Config(passes=()), **hooks)
        with torch.no_grad(), pytest.raises(BackendCompilerFailed) as failed:
            torch.compile(_Mlp().eval(), backend=backend, fullgraph=True)(torch.randn(3, 8))
        assert isinstance(failed.value.inner_exception, Stop)
        # Raised before the passes ran, nothing was reported; after lowering, the graph was.
        assert len(backend.reports) == (0 if "on_aten_graph" in hooks else 1)

def test_a_compile_imports_every_listed_provider_and_no_kernel_tooling():
    # In a fresh interpreter: the kernel tooling (catalog, AOT kernel checks, the triton-ascend venv builder) is for
    # `ttftc kernels` and explain, never for a compile.
    script = textwrap.dedent(
        """
        import sys, torch
        from ttftc.codegen.providers import PROVIDER_MODULES

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.norm, self.proj = torch.nn.RMSNorm(16), torch.nn.Linear(16, 16)

            def forward(self, x):
                return self.proj(self.norm(x))

        model = Block().eval()
        with torch.no_grad():
            torch.compile(model, backend="ttftc")(torch.randn(1, 5, 16))
        print("missing", [m for m in PROVIDER_MODULES if m not in sys.modules])
        print("tooling", sorted(m for m in sys.modules if m.startswith("ttftc.codegen.triton.tools")))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "missing []" in done.stdout and "tooling []" in done.stdout, done.stdout


def test_every_module_that_registers_a_lowering_is_listed():
    import pathlib
    import re

    from ttftc.codegen.providers import PROVIDER_MODULES
    from ttftc.codegen import registry
    from ttftc.codegen.registry import PROVIDER_PACKAGES

    root = pathlib.Path(registry.__file__).parent
    registers = re.compile(r"\bregister_(?:lowering|space)\(")
    registering = {f"ttftc.codegen.{package}.{path.stem}" for package in PROVIDER_PACKAGES
                   for path in (root / package).glob("*.py") if registers.search(path.read_text())}
    assert registering and registering <= set(PROVIDER_MODULES), registering - set(PROVIDER_MODULES)
    assert list(PROVIDER_MODULES) == sorted(PROVIDER_MODULES, key=lambda m: PROVIDER_PACKAGES.index(m.split(".")[2]))
