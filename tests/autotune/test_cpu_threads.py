"""The CPU thread-count knob: the axis, the set-and-restore wrapper, and that a tuned count reaches the lowering."""

import pytest
import torch

import ttftc
from ttftc.autotune.cache import AutotuneCache
from ttftc.autotune.keys import key_for
from ttftc.autotune.space import Problem, SearchSpace, TensorSpec, space_for
from ttftc.codegen.cpu import _threads
from ttftc.codegen.cpu import attention as cpu_attention
from ttftc.codegen.cpu import int8_linear as cpu_int8
from ttftc.codegen.cpu._threads import honours_num_threads, intra_op_threads, thread_counts, with_thread_axis
import ttftc.codegen.providers  # noqa: F401  (importing it registers every lowering and search space)
from ttftc.tuning.tuner import OpInstance, tune_instances

THREADED_OPS = ("attention", "norm_linear", "gated_ffn", "linear_act", "linear", "int8_linear")


def _other_count() -> int:
    """A thread count different from the current one."""
    return 1 if torch.get_num_threads() > 1 else 2


def test_thread_counts_are_powers_of_two_then_the_core_count():
    assert thread_counts(12) == (1, 2, 4, 8, 12)
    assert thread_counts(8) == (1, 2, 4, 8)
    assert thread_counts(1) == (1,)
    assert thread_counts()[-1] == _threads.usable_cores()


def test_usable_cores_follow_the_affinity_else_the_cpu_count(monkeypatch):
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    monkeypatch.setattr(_threads.os, "cpu_count", lambda: 8)
    assert _threads.usable_cores() == 1  # pinned to one core of eight
    monkeypatch.delattr(_threads.os, "sched_getaffinity")  # a platform without affinity
    assert _threads.usable_cores() == 8
    monkeypatch.setattr(_threads.os, "cpu_count", lambda: None)  # the count is unknown
    assert _threads.usable_cores() == 1


def test_a_config_thread_count_is_at_least_one_and_an_int_not_a_bool():
    assert _threads.threads_of({"num_threads": 0}) == 1
    assert _threads.threads_of({"num_threads": 1}) == 1
    for bad in (True, 2.0):
        with pytest.raises(TypeError) as refused:
            _threads.threads_of({"num_threads": bad})
        assert str(refused.value) == f"tuning_config['num_threads'] must be an int or None, got {bad!r}"


def test_intra_op_threads_sets_and_restores_even_on_error():
    before = torch.get_num_threads()
    other = _other_count()
    with intra_op_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"):
        with intra_op_threads(other):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_same_count_or_none_never_touches_the_pool(monkeypatch):
    calls = []
    monkeypatch.setattr(_threads.torch, "set_num_threads", lambda n: calls.append(n))
    with intra_op_threads(None):
        pass
    with intra_op_threads(torch.get_num_threads()):
        pass
    assert calls == []


def test_wrapper_applies_the_count_and_passes_the_config_on_only_when_wanted():
    seen = []

    @honours_num_threads
    def with_config(x, *, tuning_config=None):
        seen.append((torch.get_num_threads(), tuning_config))
        return x

    @honours_num_threads
    def without_config(x):
        seen.append((torch.get_num_threads(), "no config"))
        return x

    other = _other_count()
    with_config(1, tuning_config={"num_threads": other, "n_block": 0})
    without_config(1, tuning_config={"num_threads": other})
    with_config(1)
    now = torch.get_num_threads()
    assert seen == [(other, {"num_threads": other, "n_block": 0}), (other, "no config"), (now, None)]
    assert with_config.__name__ == "with_config"


def test_every_cpu_space_has_the_thread_axis_and_defaults_to_the_running_process_count():
    x = TensorSpec((4, 8), torch.float32)
    for op in THREADED_OPS:
        space = space_for(op, "cpu")
        assert space.axes["num_threads"] == (None,) + thread_counts(), op
        # None, not the tuning process's count: a stored default must follow the count of the process that runs it.
        assert space.default(Problem(op, "cpu", (x,), ()))["num_threads"] is None, op


def _block_space() -> SearchSpace:
    """A space whose default reads the problem and whose constraint refuses one block size."""
    def default(problem):
        return {"block": problem.tensors()[0].shape[-1]}

    def no_block_3(config, problem):
        return "block 3 refused" if config["block"] == 3 else None

    return SearchSpace("op", "cpu", axes={"block": (8, 3)}, default=default, constraints=(no_block_3,))


def test_with_thread_axis_adds_the_counts_and_keeps_the_base_knobs_default_and_constraints():
    # The registered CPU spaces are built at import; this builds one at test time so the function itself is checked.
    problem = Problem("op", "cpu", (TensorSpec((4, 8), torch.float32),), ())
    current = torch.get_num_threads()
    explicit = (current, current + 7)  # not what thread_counts() would give, so the explicit counts must be used
    space = with_thread_axis(_block_space(), explicit)
    assert space.op == "op" and space.provider == "cpu"
    assert space.axes == {"block": (8, 3), "num_threads": (None,) + explicit}
    assert space.default(problem) == {"block": 8, "num_threads": None}
    allowed, pruned = space.candidates(problem)
    assert allowed == [{"block": 8, "num_threads": None}, {"block": 8, "num_threads": current + 7}]
    assert sorted((c["block"], c["num_threads"] or 0, reason) for c, reason in pruned) == [
        (3, 0, "block 3 refused"), (3, current, "block 3 refused"), (3, current + 7, "block 3 refused"),
        (8, current, "the current thread count: the same run as the default (None)"),
    ]
    assert with_thread_axis(_block_space()).axes["num_threads"] == (None,) + thread_counts()


def _explicit_counts() -> set:
    """The thread counts a search times besides the default: every candidate except the current count."""
    return set(thread_counts()) - {torch.get_num_threads()}


def test_plain_causal_attention_searches_its_kernel_and_the_thread_count_only():
    spec = TensorSpec((1, 2, 16, 8), torch.float32)
    problem = Problem("attention", "cpu", (spec, spec, spec),
                      (("causal", True), ("q_offset", 0), ("scale", 0.3), ("window", 0)))
    allowed, pruned = space_for("attention", "cpu").candidates(problem)
    counts = {c["num_threads"] for c in allowed}
    assert counts == {None} | _explicit_counts()
    kernels = {(c["kernel"], c["gemm_block_rows"], c["native_block_k"]) for c in allowed}
    # flash once, gemm_blocks per block size, native per key block (where built); the offset/window knobs never
    # multiply plain causal candidates
    native_blocks = 4 if "native" in cpu_attention.kernels_for(torch.float32) else 0
    assert len(allowed) == len(counts) * len(kernels) and len(kernels) == 4 + native_blocks
    assert pruned and all("ignores" in reason or "current thread count" in reason for _, reason in pruned)


INT8_PROBLEM = Problem(
    "int8_linear", "cpu",
    (TensorSpec((24, 32), torch.float32), None, TensorSpec((16, 32), torch.int8), TensorSpec((16,), torch.float32)),
    (("out_dtype", torch.float32),),
)


class FavourTimer:
    def __init__(self, favourite):
        self.favourite, self.ran = favourite, []

    def __call__(self, fn, config):
        fn()
        self.ran.append(config["num_threads"])
        return 1.0 if config == self.favourite else 2.0


def test_int8_linear_thread_count_is_tuned_and_cached(tmp_path):
    # gemm: the int8 GEMM knob, tuned alongside; the one measured here, since a candidate refused here (inexact, or
    # its extension missing) is never timed, so no timer can make it the favourite.
    favourite = {"gemm": cpu_int8.default_gemm(), "num_threads": _other_count()}
    cache = AutotuneCache(tmp_path)
    timer = FavourTimer(favourite)
    (result,) = tune_instances([OpInstance(INT8_PROBLEM, 24)], cache=cache, budget_s=60, timer=timer, progress=False)
    assert result.status == "tuned" and result.rejected == [], result.rejected
    assert result.config == favourite
    assert set(timer.ran) == {None} | _explicit_counts()
    assert cache.lookup(key_for(INT8_PROBLEM, "cpu")).config == favourite


@pytest.mark.parametrize("autotune", [True, False])
def test_compile_applies_the_cached_count_unless_config_autotune_is_off(tmp_path, monkeypatch, autotune):
    other = _other_count()
    monkeypatch.setenv("TTFTC_AUTOTUNE_CACHE", str(tmp_path))
    AutotuneCache(tmp_path).store(key_for(INT8_PROBLEM, "cpu"), {"num_threads": other}, 1.0, 2.0)
    counts = []
    real = _threads.torch.set_num_threads
    monkeypatch.setattr(_threads.torch, "set_num_threads", lambda n: (counts.append(n), real(n)))

    def fn(x, w, s):
        return torch.ops.ttftc.int8_linear.default(x, None, w, s, out_dtype=torch.float32)

    x = torch.randn(24, 32)
    w = torch.randint(-100, 100, (16, 32), dtype=torch.int8)
    s = torch.rand(16) / 100
    backend = ttftc.backend(ttftc.Config(passes=(), provider="cpu", autotune=autotune))
    before = torch.get_num_threads()
    with torch.no_grad():
        out = torch.compile(fn, backend=backend)(x, w, s)
    assert torch.get_num_threads() == before
    assert counts == ([other, before] if autotune else [])
    assert backend.report().providers == {"int8_linear": {"cpu": 1}}
    torch.testing.assert_close(out, torch.ops.ttftc.int8_linear(x, None, w, s, out_dtype=torch.float32))



@pytest.mark.parametrize("backend, per_thread", [("OpenMP", True), ("native thread pool", False)])
def test_the_thread_count_is_per_thread_only_under_openmp(monkeypatch, backend, per_thread):
    info = f"ATen/Parallel:\n\tat::get_num_threads() : 2\nATen parallel backend: {backend}\n"
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: info)
    assert _threads.count_is_per_thread.__wrapped__() is per_thread  # the uncached body


@pytest.mark.parametrize("per_thread", [True, False])
def test_a_shared_thread_count_is_switched_under_the_lock_and_a_per_thread_one_without(monkeypatch, per_thread):
    monkeypatch.setattr(_threads, "count_is_per_thread", lambda: per_thread)
    other = 1 if torch.get_num_threads() != 1 else 2
    with intra_op_threads(other):
        assert torch.get_num_threads() == other
        assert _threads._SWITCH_LOCK.locked() is not per_thread
    assert not _threads._SWITCH_LOCK.locked()
