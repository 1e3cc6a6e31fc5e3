"""Issue item 10: a stored thread count is clamped to the usable cores, a cached plan must match the requested
buckets, and the thread-count switch is per thread on this build (so tuned ops of two serving threads run at once)."""

import threading
import warnings

import pytest
import torch

import ttftc
from tests.helpers import needs_transformers
from tests.security.attack import forge
from tests.security.conftest import PROMPT
from ttftc import zoo
from ttftc.autotune.space import MACHINE_KNOBS
from ttftc.cache import CompileCache
from ttftc.codegen.cpu import _threads
from ttftc.codegen.cpu._threads import count_is_per_thread, intra_op_threads, threads_of, usable_cores

GRAPH = "graphs/b16_n1_last_kv.json"
LINEAR = {"fn": "ttftc.codegen.cpu.linear:linear_cpu"}


def test_a_stored_thread_count_is_clamped_to_the_usable_cores():
    assert threads_of({"num_threads": 10**9}) == usable_cores()
    assert threads_of({"num_threads": 0}) == threads_of({"num_threads": -7}) == 1
    assert threads_of({"num_threads": None}) is None and threads_of(None) is None
    with pytest.raises(TypeError, match="must be an int"):
        threads_of({"num_threads": "64"})


@needs_transformers
def test_an_artifact_asking_for_more_threads_than_there_are_cores_gets_the_usable_cores(artifact, outside,
                                                                                        clean_logits, monkeypatch):
    """The most a stored count may say (a bigger machine's count; a million is refused at load:
    tests/security/test_crafted_graphs.py) is clamped to this machine's cores where it is applied."""
    most = MACHINE_KNOBS["num_threads"][1]
    assert most > usable_cores()

    def mutate(graph):
        node = next(n for n in graph["nodes"] if n.get("target") == LINEAR)
        node["kwargs"]["dict"]["tuning_config"] = {"dict": {"num_threads": most}}

    forge(artifact, GRAPH, mutate)
    requested = []
    real = torch.set_num_threads
    monkeypatch.setattr(_threads.torch, "set_num_threads", lambda n: (requested.append(n), real(n)))
    before = torch.get_num_threads()
    real(1)  # so that the clamped count (all usable cores) is a switch we can see
    try:
        logits = ttftc.load(artifact)(PROMPT, logits_to_keep=1).logits
    finally:
        real(before)
    assert requested == [] if usable_cores() == 1 else set(requested) == {usable_cores(), 1}
    torch.testing.assert_close(logits, clean_logits)
    outside.assert_untouched()


@needs_transformers
def test_a_tuning_config_that_is_not_scalars_is_refused_at_load(artifact, outside):
    def mutate(graph):
        node = next(n for n in graph["nodes"] if n.get("target") == LINEAR)
        node["kwargs"]["dict"]["tuning_config"] = {"dict": {"num_threads": [{"node": "arg0_1"}]}}

    forge(artifact, GRAPH, mutate)
    with pytest.raises(ttftc.aot.ArtifactError, match="tuning_config must be a dict of scalars"):
        ttftc.load(artifact)
    outside.assert_untouched()


@needs_transformers
def test_a_cached_plan_for_other_buckets_is_discarded(tmp_path):
    model = zoo.build("llama")
    cache = CompileCache(tmp_path)
    device = torch.device("cpu")
    plan = ttftc.buckets.BucketPlan(safe=True, buckets=(16, 32, 64), evidence=("planted",))
    cache.store_plan(model, device, (16,), plan)  # stored under the key of (16,), claiming another table
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.load_plan(model, device, (16,)) is None
    assert len(caught) == 1 and "not [16]" in str(caught[0].message)
    assert not list((tmp_path / "plans").glob("*.json"))  # discarded, so the next compile writes a true one


def test_the_thread_count_is_per_thread_on_this_build():
    """Measured behaviour, not an assumption: a switch in one thread leaves another thread's count alone."""
    if not count_is_per_thread():
        pytest.skip("this torch build shares one thread pool between threads")
    own_count = torch.get_num_threads()
    other = 1 if own_count > 1 else 2
    switched, checked = threading.Event(), threading.Event()
    seen = {}

    def switcher():
        with intra_op_threads(other):
            seen["switcher"] = torch.get_num_threads()
            switched.set()
            checked.wait(10)

    thread = threading.Thread(target=switcher)
    thread.start()
    assert switched.wait(10)
    seen["here"] = torch.get_num_threads()
    checked.set()
    thread.join(10)
    assert seen == {"switcher": other, "here": own_count}
    assert torch.get_num_threads() == own_count


def test_two_threads_run_switched_regions_at_once_on_a_per_thread_build():
    """The lock that serialised every tuned op of every serving thread is gone where the count is per thread."""
    if not count_is_per_thread():
        pytest.skip("this torch build shares one thread pool: switched regions are serialised")
    inside = threading.Barrier(2, timeout=10)
    other = 1 if torch.get_num_threads() > 1 else 2
    errors = []

    def worker():
        try:
            with intra_op_threads(other):
                inside.wait()  # both threads are inside a switched region together, or this times out
        except threading.BrokenBarrierError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == []
