"""Issue items 6 and 7: the prefix cache fails closed.

The attacker here is another caller of the same server process: one who sends no tenant (the server runs it as
PRIVATE), or who passes a tenant that compares equal to someone else's, or a model object that lands at a freed
model's address.
"""

import gc
import weakref

import pytest

from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.runtime import PRIVATE, PrefillEngine, PrefixCache

pytestmark = needs_transformers


@pytest.fixture(scope="module")
def model():
    return zoo.build("llama")


@pytest.fixture
def secret(model):
    return zoo.example_ids(model, 40)[0].tolist()  # the victim's prompt: five blocks of 8


@pytest.mark.parametrize("shared_default, tenant", [(True, PRIVATE), (False, None)])
def test_private_callers_learn_nothing_from_each_other(model, secret, shared_default, tenant):
    """What `ttftc serve` does for a request without the operator's tenant header (tests/serve/test_server.py)."""
    engine = PrefillEngine(model, prefix_cache=PrefixCache(1 << 24, block_size=8, shared_default=shared_default))
    engine.first_token(secret, tenant=tenant).kv.release()  # the victim
    probe = engine.first_token(secret, tenant=tenant)  # the attacker guesses the same prompt
    assert probe.cached_tokens == 0 and probe.computed_tokens == len(secret)
    probe.kv.release()
    assert engine.prefix_cache.stats().blocks_held == 0  # nothing was kept that a later guess could hit


def test_in_process_callers_without_a_tenant_share_the_engines_namespace(model, secret):
    """One engine in one process is one application: its unnamed calls reuse each other's prompts (as vLLM does
    without a cache_salt), and nobody else can name that namespace."""
    engine = PrefillEngine(model, prefix_cache=PrefixCache(1 << 24, block_size=8))
    engine.first_token(secret).kv.release()
    again = engine.first_token(secret)
    assert again.cached_tokens == 32
    again.kv.release()
    for outsider in ("None", "", "default", PRIVATE):
        probe = engine.first_token(secret, tenant=outsider)
        assert probe.cached_tokens == 0, outsider
        probe.kv.release()


@pytest.mark.parametrize("victim, attacker", [("1", 1), ("1", 1.0), ("1", True), ("acme", ("acme",))])
def test_tenants_are_strings_so_equal_looking_values_cannot_collide(model, secret, victim, attacker):
    engine = PrefillEngine(model, prefix_cache=PrefixCache(1 << 24, block_size=8))
    engine.first_token(secret, tenant=victim).kv.release()
    with pytest.raises(TypeError, match="tenant must be a str"):
        engine.first_token(secret, tenant=attacker)
    cache = engine.prefix_cache
    for other in (1, 1.0, True):
        with pytest.raises(TypeError):
            cache.cached_tokens(secret, tenant=other)


def test_a_model_at_a_freed_models_address_is_not_served_its_kv(secret):
    """The review's exploit: the cache compared id(model); after a free, a new model could reuse the address."""
    cache = PrefixCache(1 << 24, block_size=8)
    victim = zoo.build("llama", seed=0)
    engine = PrefillEngine(victim, prefix_cache=cache)
    engine.first_token(secret, tenant="t").kv.release()
    held = cache.stats().blocks_held
    address = id(victim)
    del victim, engine
    gc.collect()
    reused = False
    for seed in range(1, 6):  # try to land a different model on the freed address
        other = zoo.build("llama", seed=seed)
        reused = reused or id(other) == address
        with pytest.raises(ValueError, match="another model"):
            PrefillEngine(other, prefix_cache=cache)
        del other
        gc.collect()
    # Whether or not CPython reused the address, no other model got the old KV; the cache still holds it, unserved.
    assert held > 0 and cache.stats().blocks_held == held and cache.stats().queries == 1


def test_the_cache_does_not_keep_the_model_alive():
    cache = PrefixCache(1 << 24, block_size=8)
    model = zoo.build("llama")
    PrefillEngine(model, prefix_cache=cache)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
