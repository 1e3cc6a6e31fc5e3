"""PrefixCache: matching, references, eviction, tenant isolation, accounting, thread safety, bad input."""

import copy
import gc
import pickle
import threading
import weakref

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ttftc.runtime import PRIVATE, LeaseReleasedError, PrefixCache, PrefixCacheStats

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
    assert cache.match(tokens, tenant=None).num_tokens == 0  # the default namespace is not alice's
    assert cache.match(tokens, tenant=PRIVATE).num_tokens == 0


@pytest.mark.parametrize("shared_default, tenant", [(True, PRIVATE), (False, None), (False, PRIVATE)],
                         ids=["PRIVATE", "unnamed-without-shared-default", "PRIVATE-without-shared-default"])
def test_a_private_caller_shares_with_nobody_not_even_itself(shared_default, tenant):
    cache = PrefixCache(1 << 20, block_size=BS, shared_default=shared_default)
    tokens = list(range(12))
    built = []
    lease = cache.insert(tokens, lambda i: built.append(i) or payload_for(None, tokens, i), tenant=tenant)
    assert lease.num_tokens == 0 and built == []  # a private namespace no later call can name: nothing is stored
    lease.release()
    insert(cache, tokens, "t").release()
    assert cache.match(tokens, tenant=tenant).num_tokens == 0
    assert cache.cached_tokens(tokens, tenant=tenant) == 0
    assert cache.stats().blocks_held == 3  # only the named tenant's blocks


def test_unnamed_callers_share_the_caches_default_namespace():
    cache = PrefixCache(1 << 20, block_size=BS)
    assert cache.shared_default is True
    tokens = list(range(8))
    insert(cache, tokens, None).release()
    lease = cache.match(tokens, tenant=None)
    assert lease.num_tokens == 8 and served_correctly(lease, tokens, None)
    lease.release()
    assert cache.cached_tokens(tokens, tenant="None") == 0  # the string "None" is a tenant like any other
    assert cache.cached_tokens(tokens, tenant="PRIVATE") == 0
    assert cache.cached_tokens(tokens, tenant="t") == 0
    assert cache.cached_tokens(tokens, tenant=PRIVATE) == 0
    with pytest.raises(TypeError, match="shared_default"):
        PrefixCache(1 << 20, shared_default=1)


def test_private_survives_copy_and_pickle_as_the_same_object():
    assert copy.deepcopy(PRIVATE) is PRIVATE and pickle.loads(pickle.dumps(PRIVATE)) is PRIVATE
    assert repr(PRIVATE) == "PRIVATE"


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
    tenants = st.sampled_from(["a", "b", None, PRIVATE])  # None: the default namespace; PRIVATE must never hit

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
        # Only this tenant's own KV for exactly this prefix is ever served; a private caller is served nothing.
        assert served_correctly(lease, tokens, tenant)
        assert tenant is not PRIVATE or lease.num_tokens == 0
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


# ---- behaviours pinned for mutation testing (issue 17): each test below fails for a planted bug ---------------------


def one_byte_block(_i):
    return torch.zeros(1, dtype=torch.uint8)


def test_lease_and_cache_describe_themselves():
    cache = PrefixCache(1 << 20, block_size=BS)
    lease = insert(cache, list(range(8)), "t")
    assert lease.tenant == "t" and lease.released is False
    assert repr(lease) == "CacheLease(8 tokens, tenant='t', held)"
    lease.release()
    assert lease.released is True
    assert repr(lease) == "CacheLease(8 tokens, tenant='t', released)"
    with pytest.raises(LeaseReleasedError, match=r"^CacheLease\(8 tokens, tenant='t', released\) was already released$"):
        lease.release()
    matched = cache.match(list(range(8)) + [5, 5], tenant="t")
    assert matched.tenant == "t" and repr(matched) == "CacheLease(8 tokens, tenant='t', held)"
    matched.release()
    assert repr(cache) == f"PrefixCache(2 blocks, 64/{1 << 20} bytes, block_size=4, hit rate 80.0%)"


def test_stats_is_a_snapshot_of_every_counter():
    cache = PrefixCache(3 * BLOCK_BYTES, block_size=BS)
    assert cache.stats() == PrefixCacheStats(queries=0, query_tokens=0, hit_tokens=0, inserted_blocks=0,
                                             evicted_blocks=0, blocks_held=0, bytes_held=0,
                                             budget_bytes=3 * BLOCK_BYTES, block_size=BS)
    assert cache.stats().hit_rate == 0.0
    insert(cache, list(range(12)), "t").release()            # 3 blocks
    insert(cache, [7] * 9, "t").release()                    # 2 more: 2 evictions
    cache.match([7] * 9, tenant="t").release()               # 8 hit of 9
    cache.match([1] * 3, tenant="u").release()               # 0 hit of 3
    assert cache.stats() == PrefixCacheStats(queries=2, query_tokens=12, hit_tokens=8, inserted_blocks=5,
                                             evicted_blocks=2, blocks_held=3, bytes_held=3 * BLOCK_BYTES,
                                             budget_bytes=3 * BLOCK_BYTES, block_size=BS)


def test_release_if_held_and_the_context_manager_release_once():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(8))
    insert(cache, tokens, "t").release()
    with cache.match(tokens, tenant="t") as lease:
        assert lease.num_tokens == 8
        cache.check_invariants([lease])
    assert lease.released
    lease.release_if_held()  # a second release on an error path is not an error
    with pytest.raises(LeaseReleasedError):
        lease.release()
    other = cache.match(tokens, tenant="t")
    other.release_if_held()
    assert other.released
    cache.check_invariants([])
    assert cache.clear() == 2 * BLOCK_BYTES  # the references are gone: every block can be evicted


def test_a_lease_is_released_by_its_own_cache_only():
    first, second = PrefixCache(1 << 20, block_size=BS), PrefixCache(1 << 20, block_size=BS)
    lease = insert(first, list(range(8)), "t")
    with pytest.raises(ValueError, match="^this lease belongs to another PrefixCache$"):
        second.release(lease)
    assert not lease.released
    lease.release()


def test_evict_frees_at_least_the_bytes_asked_least_recently_used_first():
    cache = PrefixCache(1 << 20, block_size=BS)
    prompts = [[1] * 4, [2] * 4, [3] * 4]
    for p in prompts:
        insert(cache, p, "t").release()
    assert cache.evict(0) == 0
    assert cache.evict(1) == BLOCK_BYTES                 # one block is enough for one byte
    assert [cache.cached_tokens(p, tenant="t") for p in prompts] == [0, 4, 4]
    assert cache.evict(BLOCK_BYTES) == BLOCK_BYTES       # exactly one block's bytes: one block
    assert [cache.cached_tokens(p, tenant="t") for p in prompts] == [0, 0, 4]
    assert cache.evict(10 * BLOCK_BYTES) == BLOCK_BYTES  # asks for more than there is: frees what there is
    assert cache.stats().blocks_held == 0 and cache.stats().evicted_blocks == 3
    assert cache.evict(BLOCK_BYTES) == 0


def test_recently_matched_blocks_outlive_older_ones():
    cache = PrefixCache(2 * BLOCK_BYTES, block_size=BS)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    insert(cache, a, "t").release()
    insert(cache, b, "t").release()
    cache.match(a, tenant="t").release()   # a is now the more recently used
    insert(cache, c, "t").release()        # one eviction: b, not a
    assert [cache.cached_tokens(p, tenant="t") for p in (a, b, c)] == [4, 0, 4]
    assert cache.stats().evicted_blocks == 1


def test_clear_evicts_every_unreferenced_block_even_one_byte_blocks():
    cache = PrefixCache(3, block_size=1, block_bytes=1)  # a budget of exactly three one-byte blocks
    for token in (1, 2, 3):
        cache.insert([token], one_byte_block, tenant="t").release()
    assert cache.stats().bytes_held == 3
    assert cache.clear() == 3
    assert cache.stats().blocks_held == 0
    cache.check_invariants([])


def test_a_budget_of_exactly_one_block_and_one_token_blocks_are_valid():
    cache = PrefixCache(BLOCK_BYTES, block_size=BS, block_bytes=BLOCK_BYTES)
    assert cache.block_bytes == BLOCK_BYTES
    insert(cache, [1] * 4, "t").release()
    insert(cache, [2] * 4, "t").release()  # the one slot is reused
    assert cache.cached_tokens([2] * 4, tenant="t") == 4 and cache.stats().evicted_blocks == 1
    cache = PrefixCache(1, block_size=1)
    lease = cache.insert([5, 6], one_byte_block, tenant="t")
    assert lease.num_tokens == 1 and cache.block_bytes == 1  # the second block does not fit beside the first
    lease.release()


def test_max_tokens_of_zero_or_below_matches_nothing_even_with_one_token_blocks():
    cache = PrefixCache(1 << 10, block_size=1)
    cache.insert([1, 2, 3], one_byte_block, tenant="t").release()
    for cap in (0, -3):
        lease = cache.match([1, 2, 3], tenant="t", max_tokens=cap)
        assert lease.num_tokens == 0
        lease.release()
    lease = cache.match([1, 2, 3], tenant="t", max_tokens=2)
    assert lease.num_tokens == 2
    lease.release()


def test_the_shared_default_namespace_is_visible_to_cached_tokens():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(9))
    insert(cache, tokens, None).release()
    assert cache.cached_tokens(tokens, tenant=None) == 8


def test_insert_builds_only_the_missing_blocks_once_each():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(16))
    built = []

    def make(i):
        built.append(i)
        return payload_for("t", tokens, i)

    cache.insert(tokens[:8], make, tenant="t").release()
    assert built == [0, 1]
    lease = cache.insert(tokens, make, tenant="t")
    assert built == [0, 1, 2, 3] and lease.num_tokens == 16 and served_correctly(lease, tokens, "t")
    assert lease.tenant == "t"
    lease.release()


def test_insert_rebuilds_a_block_evicted_while_it_was_building_the_others():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(12))
    insert(cache, tokens[:8], "t").release()
    built = []

    def make(i):  # while building block 2 (outside the lock), blocks 0 and 1 are evicted
        built.append(i)
        if len(built) == 1:
            assert cache.clear() == 2 * BLOCK_BYTES
        return payload_for("t", tokens, i)

    lease = cache.insert(tokens, make, tenant="t")
    assert built == [2, 0, 1]  # the evicted blocks are rebuilt under the lock, block 2 is not built twice
    assert lease.num_tokens == 12 and served_correctly(lease, tokens, "t")
    cache.check_invariants([lease])
    assert (cache.stats().inserted_blocks, cache.stats().evicted_blocks) == (5, 2)
    lease.release()


def test_a_tenant_with_nothing_cached_leaves_no_tree_behind():
    # One tree per tenant: a tree left empty would grow the cache by one root per tenant ever seen.
    cache = PrefixCache(2 * BLOCK_BYTES, block_size=BS)
    lease = insert(cache, [1, 2, 3], "short")  # shorter than a block: nothing to store
    assert lease.num_tokens == 0 and lease.tenant == "short"
    lease.release()
    assert "short" not in cache._roots
    insert(cache, [1] * 4, "a").release()
    insert(cache, [2] * 4, "b").release()
    insert(cache, [3] * 4, "c").release()  # evicts a's only block: a's tree goes with it
    assert set(cache._roots) == {"b", "c"}
    assert cache.cached_tokens([2] * 4, tenant="b") == 4 and cache.cached_tokens([3] * 4, tenant="c") == 4
    cache.check_invariants([])


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size must be a positive int, got 0"),
    ({"block_size": True}, "block_size must be a positive int, got True"),
    ({"block_size": 2.5}, "block_size must be a positive int, got 2.5"),
    ({"budget_bytes": 0}, "budget_bytes must be a positive int, got 0"),
    ({"budget_bytes": True}, "budget_bytes must be a positive int, got True"),
    ({"budget_bytes": 2.5}, "budget_bytes must be a positive int, got 2.5"),
    ({"block_bytes": 0}, "block_bytes must be a positive int, got 0"),
    ({"block_bytes": 2.5}, "block_bytes must be a positive int, got 2.5"),
    ({"budget_bytes": 63, "block_bytes": 64},
     "PrefixCache budget of 63 bytes cannot hold one block of 4 tokens (64 bytes); raise budget_bytes or lower "
     "block_size"),
])
def test_bad_construction_says_what_is_wrong(kwargs, message):
    kwargs = {"budget_bytes": 1 << 20, "block_size": BS, **kwargs}
    with pytest.raises(ValueError) as raised:
        PrefixCache(**kwargs)
    assert str(raised.value) == message


def test_errors_name_the_offending_value():
    cache = PrefixCache(1 << 20, block_size=BS)
    with pytest.raises(TypeError) as raised:
        cache.match([1] * 4, tenant=1)
    assert str(raised.value) == ("tenant must be a str, None (the cache's default namespace) or PRIVATE, got int 1; "
                                 "convert ids to strings so that 1, 1.0 and True cannot name the same tenant")
    with pytest.raises(TypeError, match="^a block payload must be a torch.Tensor, got list$"):
        cache.insert([1] * 4, lambda i: [0.0] * 4, tenant="t")
    insert(cache, [1] * 4, "t").release()
    with pytest.raises(ValueError, match="^block payload of 12 bytes; this cache holds blocks of 32$"):
        cache.insert([2] * 4, lambda i: torch.zeros(3), tenant="t")


def test_bind_refuses_another_geometry_and_another_model():
    cache = PrefixCache(1 << 20, block_size=BS)
    cache.bind(BLOCK_BYTES)
    assert cache.block_bytes == BLOCK_BYTES
    with pytest.raises(ValueError) as raised:
        cache.bind(16)
    assert str(raised.value) == ("this PrefixCache holds blocks of 32 bytes; a block of 16 bytes comes from a "
                                 "different model geometry")
    model, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    cache.bind(BLOCK_BYTES, owner=model)
    with pytest.raises(ValueError) as raised:
        cache.bind(BLOCK_BYTES, owner=other)  # the bound model is alive: nothing was freed
    assert str(raised.value) == "this PrefixCache already holds KV of another model; use one cache per model"
    del model
    gc.collect()
    with pytest.raises(ValueError) as raised:
        cache.bind(BLOCK_BYTES, owner=other)
    assert str(raised.value) == ("this PrefixCache already holds KV of another model (since freed); use one cache "
                                 "per model")


def _chain(cache, tokens, tenant):
    """The tree nodes of a cached prompt, root first (white box: for corrupting the tree on purpose)."""
    node, nodes = cache._roots[tenant], []
    for i in range(len(tokens) // BS):
        node = node.children[tuple(tokens[i * BS:(i + 1) * BS])]
        nodes.append(node)
    return nodes


def _corrupt_root_refs(cache, nodes):
    nodes[0].parent.refs = 1


def _corrupt_root_payload(cache, nodes):
    nodes[0].parent.payload = torch.zeros(4, dtype=torch.float64)


def _corrupt_payload(cache, nodes):
    nodes[1].payload = None


def _corrupt_key(cache, nodes):  # a key of the right length that its parent does not file it under
    nodes[1].key = (9, 9, 9, 9)


def _corrupt_short_key(cache, nodes):  # a key of the wrong length, filed under it
    parent, node = nodes[0], nodes[1]
    del parent.children[node.key]
    node.key = node.key[:2]
    parent.children[node.key] = node


def _corrupt_parent(cache, nodes):
    nodes[1].parent = nodes[2]


def _corrupt_negative_refs(cache, nodes):
    for node in nodes:
        node.refs -= 1


def _corrupt_child_refs(cache, nodes):
    nodes[2].refs += 1


def _corrupt_blocks_held(cache, nodes):
    cache._blocks_held += 1


def _corrupt_bytes_held(cache, nodes):
    cache._bytes_held -= 1


@pytest.mark.parametrize("corrupt", [_corrupt_root_refs, _corrupt_root_payload, _corrupt_payload, _corrupt_key,
                                     _corrupt_short_key, _corrupt_parent, _corrupt_negative_refs,
                                     _corrupt_child_refs, _corrupt_blocks_held, _corrupt_bytes_held])
def test_check_invariants_catches_a_corrupted_tree(corrupt):
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(12))
    insert(cache, tokens, "t").release()
    cache.check_invariants([])
    corrupt(cache, _chain(cache, tokens, "t"))
    with pytest.raises(AssertionError):
        cache.check_invariants([])


def test_check_invariants_compares_refcounts_with_the_live_leases():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(8))
    held = insert(cache, tokens, "t")
    released = cache.match(tokens, tenant="t")
    released.release()
    cache.check_invariants([held, released])  # a released lease counts for nothing
    nodes = _chain(cache, tokens, "t")
    nodes[0].refs += 1
    with pytest.raises(AssertionError) as raised:
        cache.check_invariants([held])
    assert raised.value.args == ((2, 1),)  # (references found, references the leases hold)
    nodes[0].refs -= 1
    # A referenced block that left the tree (the bug the check is for) while the totals stayed consistent.
    del nodes[0].children[nodes[1].key]
    nodes[1].payload = None
    cache._blocks_held -= 1
    cache._bytes_held -= BLOCK_BYTES
    cache.check_invariants([])  # without the leases, the tree itself is consistent
    with pytest.raises(AssertionError, match="^a referenced block was evicted$"):
        cache.check_invariants([held])


def test_check_invariants_holds_at_a_full_budget():
    cache = PrefixCache(2 * BLOCK_BYTES, block_size=BS)
    lease = insert(cache, list(range(8)), "t")
    assert cache.stats().bytes_held == cache.budget_bytes
    cache.check_invariants([lease])
    lease.release()


def test_released_leases_do_not_pile_up_in_the_eviction_queue():
    # Each release queues its leaf for eviction and only evictions dequeue: with room to spare, a server that serves
    # the same prompt over and over must not grow the queue by one entry per request. The queue is compacted when
    # it passes 2 x blocks + 16 entries, keeping the entries that are still current.
    cache = PrefixCache(1 << 20, block_size=BS)
    kept, served = list(range(16)), list(range(100, 116))
    insert(cache, kept, "t").release()    # its leaf's queue entry stays current throughout
    insert(cache, served, "t").release()
    longest = 0
    for _ in range(1000):
        cache.match(served, tenant="t").release()
        longest = max(longest, len(cache._evictable))
    assert longest == 2 * 8 + 16
    assert cache.clear() == 8 * BLOCK_BYTES  # the compacted queue still finds every leaf, and then their prefixes
    cache.check_invariants([])


def test_check_invariants_counts_every_live_lease_on_a_shared_block():
    cache = PrefixCache(1 << 20, block_size=BS)
    tokens = list(range(8))
    first = insert(cache, tokens, "t")
    second = cache.match(tokens, tenant="t")  # both leases hold the same two blocks: refcount 2 each
    cache.check_invariants([first, second])
    with pytest.raises(AssertionError):
        cache.check_invariants([first])  # a live lease left out: the refcounts no longer add up
    second.release()
    cache.check_invariants([first])
    first.release()


# ---- pinning ---------------------------------------------------------------------------------------------------


def test_pinned_blocks_count_against_the_budget_and_are_never_evicted():
    cache = PrefixCache(6 * BLOCK_BYTES, block_size=BS)
    warm = list(range(100, 109))  # two full blocks and a partial one
    insert(cache, warm, "acme").release()
    pin = cache.pin(warm, tenant="acme")
    stats = cache.stats()
    assert (stats.pinned_prompts, stats.pinned_blocks, stats.pinned_tokens, stats.pinned_bytes) == (
        1, 2, 8, 2 * BLOCK_BYTES)
    # Traffic of another tenant, four times the budget: LRU takes its own blocks, never the pinned ones.
    for k in range(6):
        insert(cache, [k] * 16, "other").release()
    assert cache.stats().blocks_held == 6 and cache.cached_tokens(warm, tenant="acme") == 8
    assert cache.evict(cache.budget_bytes) == 4 * BLOCK_BYTES and cache.clear() == 0
    lease = cache.match(warm, tenant="acme")
    assert lease.num_tokens == 8 and served_correctly(lease, warm, "acme")
    cache.check_invariants([lease])  # the pins' own references are the cache's: counted without being passed
    lease.release()
    cache.unpin(pin)
    assert cache.stats().pinned_blocks == 0 and cache.clear() == 2 * BLOCK_BYTES
    with pytest.raises(ValueError, match="not a pin of this cache"):
        cache.unpin(pin)


def test_prompts_sharing_a_prefix_pin_its_blocks_once():
    cache = PrefixCache(1 << 20, block_size=BS)
    system = list(range(8))
    first, second = system + [50, 51, 52, 53], system + [60, 61, 62, 63]
    for tokens in (first, second):
        insert(cache, tokens, "acme").release()
    pins = [cache.pin(tokens, tenant="acme") for tokens in (first, second)]
    assert (cache.stats().pinned_prompts, cache.stats().pinned_blocks) == (2, 4)  # 2 shared + 1 + 1
    cache.unpin(pins[0])
    assert cache.stats().pinned_blocks == 3, "the shared blocks stay pinned by the other prompt"
    cache.check_invariants([])


def test_a_prompt_not_wholly_cached_is_not_pinned_at_all():
    cache = PrefixCache(2 * BLOCK_BYTES, block_size=BS)
    tokens = list(range(12))
    lease = insert(cache, tokens, "acme")  # the budget holds two of its three blocks
    assert lease.num_tokens == 8
    lease.release()
    with pytest.raises(ValueError, match="only 2 of the prompt's 3 full blocks are cached"):
        cache.pin(tokens, tenant="acme")
    assert cache.stats().pinned_blocks == 0 and cache.clear() == 2 * BLOCK_BYTES
    with pytest.raises(ValueError, match="private"):
        cache.pin(tokens, tenant=PRIVATE)
    with pytest.raises(ValueError, match="no full block"):
        cache.pin([1, 2], tenant="acme")
    cache.check_invariants([])
