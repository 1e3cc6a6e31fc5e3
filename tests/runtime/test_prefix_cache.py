"""PrefixCache: matching, references, eviction, tenant isolation, accounting, thread safety, bad input."""

import gc
import threading
import weakref

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ttftc.runtime import LeaseReleasedError, PrefixCache

BS = 4
BLOCK_BYTES = 4 * 8  # float64 payload of 4 values


def payload_for(tenant, tokens, i):
    """A payload that encodes exactly which tenant and which prefix produced block i."""
    prefix = tuple(tokens[: (i + 1) * BS])
    return torch.tensor([hash((tenant, prefix)) % (1 << 50), i, len(prefix), 0], dtype=torch.float64)


def insert(cache, tokens, tenant):
    return cache.insert(tokens, lambda i: payload_for(tenant, tokens, i), tenant=tenant)


def served_correctly(lease, tokens, tenant):
    return all(torch.equal(b, payload_for(tenant, tokens, i)) for i, b in enumerate(lease.blocks))


def test_longest_prefix_match_in_full_blocks():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(10))
    insert(cache, tokens, "t").release()
    assert cache.stats().blocks_held == 2  # the partial third block is not cached
    lease = cache.match(tokens[:8] + [99, 98], tenant="t")
    assert lease.num_tokens == 8 and served_correctly(lease, tokens, "t")
    lease.release()
    lease = cache.match([0, 1, 2, 3, 7, 7, 7, 7], tenant="t")
    assert lease.num_tokens == 4
    lease.release()
    lease = cache.match(tokens, tenant="t", max_tokens=7)  # a cap inside block 2 leaves block 1 only
    assert lease.num_tokens == 4
    lease.release()


def test_tenants_never_share_blocks():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(12))
    insert(cache, tokens, "alice").release()
    lease = cache.match(tokens, tenant="bob")
    assert lease.num_tokens == 0
    lease.release()
    assert cache.match(tokens, tenant=None).num_tokens == 0  # an unnamed caller is nobody's tenant


def test_an_unnamed_caller_shares_with_nobody_not_even_itself():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(12))
    built = []
    lease = cache.insert(tokens, lambda i: built.append(i) or payload_for(None, tokens, i), tenant=None)
    assert lease.num_tokens == 0 and built == []  # a private namespace no later call can name: nothing is stored
    lease.release()
    insert(cache, tokens, "t").release()
    assert cache.match(tokens, tenant=None).num_tokens == 0
    assert cache.cached_tokens(tokens, tenant=None) == 0
    assert cache.stats().blocks_held == 3  # only the named tenant's blocks


def test_shared_default_is_one_namespace_for_unnamed_callers_on_purpose():
    cache = PrefixCache(1 << 20, block_size=BS, shared_default=True)
    tokens = list(range(8))
    insert(cache, tokens, None).release()
    lease = cache.match(tokens, tenant=None)
    assert lease.num_tokens == 8 and served_correctly(lease, tokens, None)
    lease.release()
    assert cache.cached_tokens(tokens, tenant="None") == 0  # the string "None" is a tenant like any other
    assert cache.cached_tokens(tokens, tenant="t") == 0
    with pytest.raises(TypeError, match="shared_default"):
        PrefixCache(1 << 20, shared_default=1)


@pytest.mark.parametrize("tenant", [1, 1.0, True, ("a",), b"a", object()])
def test_tenants_are_strings(tenant):
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(8))
    for call in (lambda: cache.match(tokens, tenant=tenant), lambda: cache.cached_tokens(tokens, tenant=tenant),
                 lambda: insert(cache, tokens, tenant)):
        with pytest.raises(TypeError, match="tenant must be a str"):
            call()
    assert cache.stats().blocks_held == 0


def test_a_str_subclass_cannot_bring_its_own_equality():
    class Everyone(str):
        def __eq__(self, other):
            return True

        def __hash__(self):
            return hash("victim")

    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(8))
    insert(cache, tokens, "victim").release()
    assert cache.cached_tokens(tokens, tenant=Everyone("attacker")) == 0


def test_binding_holds_the_model_weakly_and_compares_identity():
    cache = PrefixCache(1 << 20, block_size=BS)
    model = torch.nn.Linear(1, 1)
    alive = weakref.ref(model)
    cache.bind(BLOCK_BYTES, owner=model)
    del model
    gc.collect()
    assert alive() is None  # the cache does not keep the model alive
    with pytest.raises(ValueError, match="another model.*freed"):
        cache.bind(BLOCK_BYTES, owner=torch.nn.Linear(1, 1))  # wherever it was allocated, even at the old address


def test_hit_accounting_counts_tokens():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(9))
    insert(cache, tokens, "t").release()
    cache.match(tokens, tenant="t").release()            # 8 hit of 9
    cache.match([5] * 6, tenant="t").release()           # 0 hit of 6
    s = cache.stats()
    assert (s.queries, s.query_tokens, s.hit_tokens) == (2, 15, 8)
    assert s.hit_rate == pytest.approx(8 / 15)


def test_lru_eviction_of_unreferenced_leaves_only():
    cache = PrefixCache(3 * BLOCK_BYTES, block_size=BS)
    a, b = [1] * 8, [2] * 4
    held = insert(cache, a, "t")         # 2 blocks, referenced
    insert(cache, b, "t").release()      # 1 block, unreferenced
    c = [3] * 4
    insert(cache, c, "t").release()      # needs room: only b's block may go
    assert cache.cached_tokens(b, tenant="t") == 0
    assert cache.cached_tokens(a, tenant="t") == 8
    assert cache.cached_tokens(c, tenant="t") == 4
    assert cache.stats().evicted_blocks == 1
    # With everything else referenced, an insert that does not fit is cut short instead of evicting in use.
    held_c = cache.match(c, tenant="t")
    lease = insert(cache, [4] * 8, "t")
    assert lease.num_tokens == 0 and cache.stats().bytes_held <= 3 * BLOCK_BYTES
    for x in (held, held_c, lease):
        x.release()


def test_chain_tail_goes_before_its_prefix():
    cache = PrefixCache(3 * BLOCK_BYTES, block_size=BS)
    insert(cache, list(range(12)), "t").release()   # a chain of 3 blocks fills the budget
    insert(cache, [9] * 4, "t").release()           # one eviction: the tail, never a block with a child
    assert cache.cached_tokens(list(range(12)), tenant="t") == 8
    cache.check_invariants()


def test_double_release_is_an_error_not_a_double_free():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(8))
    first = insert(cache, tokens, "t")
    second = cache.match(tokens, tenant="t")
    second.release()
    with pytest.raises(LeaseReleasedError):
        second.release()
    # `first` still holds its blocks: the failed second release did not decrement them again.
    cache.evict(1 << 20)
    assert cache.cached_tokens(tokens, tenant="t") == 8
    cache.check_invariants([first])
    first.release()
    assert cache.clear() == 2 * BLOCK_BYTES


def test_bad_construction_and_payloads():
    with pytest.raises(ValueError, match="cannot hold one block"):
        PrefixCache(BLOCK_BYTES - 1, block_size=BS, block_bytes=BLOCK_BYTES)
    with pytest.raises(ValueError):
        PrefixCache(0)
    with pytest.raises(ValueError):
        PrefixCache(1024, block_size=0)
    cache = PrefixCache(BLOCK_BYTES - 1, block_size=BS)
    with pytest.raises(ValueError, match="cannot hold one block"):
        insert(cache, [1] * 4, "t")  # the first payload fixes the block size and is refused
    cache = PrefixCache(1 << 20, block_size=BS)
    insert(cache, [1] * 4, "t").release()
    with pytest.raises(ValueError, match="bytes"):
        cache.insert([2] * 4, lambda i: torch.zeros(3), tenant="t")
    model_a, model_b = object(), object()
    cache.bind(BLOCK_BYTES, owner=model_a)
    cache.bind(BLOCK_BYTES, owner=model_a)  # the same model may bind again (a second engine on it)
    with pytest.raises(ValueError, match="another model"):
        cache.bind(BLOCK_BYTES, owner=model_b)


class CacheMachine(RuleBasedStateMachine):
    """Random insert/match/release/evict sequences against the invariants the issue lists."""

    BUDGET_BLOCKS = 6

    def __init__(self):
        super().__init__()
        self.cache = PrefixCache(self.BUDGET_BLOCKS * BLOCK_BYTES, block_size=BS)
        self.live = []
        self.queried = self.hit = 0
        self.inserted_since_eviction: dict = {}

    prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)
    tenants = st.sampled_from(["a", "b", None])  # None: private, so it must never hit

    @rule(tokens=prompts, tenant=tenants)
    def do_insert(self, tokens, tenant):
        evicted_before = self.cache.stats().evicted_blocks
        lease = insert(self.cache, tokens, tenant)
        assert served_correctly(lease, tokens, tenant)
        self.live.append((lease, tokens, tenant))
        if lease.num_tokens == len(tokens) // BS * BS:
            self.inserted_since_eviction[(tenant, tuple(tokens[:lease.num_tokens]))] = evicted_before

    @rule(tokens=prompts, tenant=tenants, cap=st.none() | st.integers(0, 14))
    def do_match(self, tokens, tenant, cap):
        lease = self.cache.match(tokens, tenant=tenant, max_tokens=cap)
        self.queried += len(tokens)
        self.hit += lease.num_tokens
        assert lease.num_tokens % BS == 0 and lease.num_tokens <= (len(tokens) if cap is None else cap)
        # Only this tenant's own KV for exactly this prefix is ever served; an unnamed caller is served nothing.
        assert served_correctly(lease, tokens, tenant)
        assert tenant is not None or lease.num_tokens == 0
        # A chain inserted whole is still whole if nothing was evicted since.
        for (t, prefix), evicted_then in self.inserted_since_eviction.items():
            if t == tenant and tuple(tokens[:len(prefix)]) == prefix and cap is None:
                if self.cache.stats().evicted_blocks == evicted_then:
                    assert lease.num_tokens >= len(prefix)
        self.live.append((lease, tokens, tenant))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def do_release(self, index):
        lease, _, _ = self.live.pop(index % len(self.live))
        lease.release()
        with pytest.raises(LeaseReleasedError):
            lease.release()

    @rule(nbytes=st.integers(0, 8 * BLOCK_BYTES))
    def do_evict(self, nbytes):
        self.cache.evict(nbytes)

    @invariant()
    def consistent(self):
        leases = [lease for lease, _, _ in self.live]
        self.cache.check_invariants(leases)  # budget, totals, refcounts == live leases, no referenced block evicted
        s = self.cache.stats()
        assert s.bytes_held <= s.budget_bytes
        assert (s.query_tokens, s.hit_tokens) == (self.queried, self.hit)
        for lease, tokens, tenant in self.live:
            assert self.cache.cached_tokens(tokens, tenant=tenant) >= lease.num_tokens

    def teardown(self):
        for lease, _, _ in self.live:
            lease.release()
        self.cache.check_invariants([])


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_threads_hammering_lose_and_corrupt_nothing():
    cache = PrefixCache(40 * BLOCK_BYTES, block_size=BS)
    errors = []
    counts = {"queried": 0, "hit": 0}
    lock = threading.Lock()
    barrier = threading.Barrier(6)

    def worker(seed):
        import random

        rng = random.Random(seed)
        tenant = f"t{seed % 3}"
        queried = hit = 0
        try:
            barrier.wait()
            for _ in range(300):
                tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 17))]
                if rng.random() < 0.5:
                    lease = insert(cache, tokens, tenant)
                else:
                    lease = cache.match(tokens, tenant=tenant)
                    queried += len(tokens)
                    hit += lease.num_tokens
                if not served_correctly(lease, tokens, tenant):
                    errors.append(("corrupt", tokens, tenant))
                lease.release()
                if rng.random() < 0.05:
                    cache.evict(BLOCK_BYTES * 3)
        except Exception as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)
        with lock:
            counts["queried"] += queried
            counts["hit"] += hit

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    cache.check_invariants([])
    s = cache.stats()
    assert (s.query_tokens, s.hit_tokens) == (counts["queried"], counts["hit"])
    assert s.inserted_blocks - s.evicted_blocks == s.blocks_held
