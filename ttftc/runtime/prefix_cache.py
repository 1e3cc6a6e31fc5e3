"""A prompt cache: KV blocks keyed by the token prefix that produced them, with tenant isolation.

Structure: one radix tree per namespace. A node holds one FULL block of `block_size` token ids (the edge label) and
the KV payload that the model produced for those tokens *given every token above it*. A path from the root spells
a prompt prefix, so the longest match is a walk down the tree. Only full blocks are cached: a partial block would
have to be copied on every extension and cannot be shared safely.

Namespaces: the namespace of a request is its `tenant`, a string. Two tenants never share a node, so a tenant can
never learn (by a faster first token, or by `FirstToken.cached_tokens`) that another tenant sent a prefix.
Prompt-cache timing is a real side channel (InputSnatch, PromptPeek); the tenant must therefore come from the host
application's notion of identity, never from a field the client controls. A host that wants to share, say, a public
system prompt across its users passes the same tenant for them on purpose. `tenant=None` (a caller that named no
tenant) is the cache's default namespace: a cache belongs to one engine or `LLM`, in one process, so its unnamed
callers are one application and share their prompts, as vLLM shares its prefix cache unless a request brings a
`cache_salt`. `tenant=PRIVATE` shares with nobody: each such call gets a namespace of its own, which no later call
can name, so nothing is looked up and nothing is stored for it. `ttftc serve` passes PRIVATE for a request that
carries no operator-set tenant header, so isolation stays fail-closed at the server. `PrefixCache(
shared_default=False)` makes `tenant=None` private too. Tenants are compared as strings only: `1`, `1.0` and `True`
would be equal as dict keys, so anything but a str, None or PRIVATE is a TypeError.

Binding: `bind(..., owner=model)` ties the cache to the model whose KV it holds through a weak reference and an
`is` check, for good: a new model allocated at a freed model's address is never served the old model's KV, and
once the bound model is freed the cache refuses every other model.

Lifetime: `match` and `insert` return a `CacheLease` that holds one reference on every block of its chain. A block
with references is never evicted. Unreferenced leaves are evicted least recently used first when an insert needs
room, so a chain shrinks from its tail and a prefix is never orphaned. Releasing a lease twice raises
`LeaseReleasedError`; it never decrements twice.

Pinning: `pin(tokens, tenant=...)` holds every full block of a prompt already in the cache for as long as the
cache lives (or until `unpin`): a pin is a lease the cache keeps itself, so its blocks count against the budget and
are never evicted, and a prompt whose blocks are not all cached (the budget ran out while it was inserted) is
refused with a ValueError and nothing pinned. `ttftc serve --warm-prompts` pins the prompts it prefills at startup.

Disk tier: given a `KVDiskTier` (ttftc/runtime/kv_disk.py), a block evicted from RAM is written to disk first,
addressed by a digest chain of the model, the namespace and the tokens, so tenants stay isolated there too; and
`persist()` writes every block held (a server calls it when it shuts down), so the cache survives a restart. When
`match` finds its RAM chain ending where the disk goes on, it loads the disk's blocks if their measured load time
is below `recompute_seconds(tokens, context)`, the caller's measured cost of computing those tokens again (the
engine supplies it); without that measurement it never loads. Loaded blocks re-enter RAM and count as hits.

Thread safety: one lock guards the tree. `insert` builds the payloads of the blocks it is missing outside the lock
(copying KV is the slow part), then re-walks the tree under the lock and keeps whatever another thread inserted
meanwhile, so a race costs a wasted copy, never a duplicate or a torn chain.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from ttftc.runtime.kv_disk import BlockAddress, KVDiskTier, child_address, root_address

DEFAULT_BLOCK_SIZE = 16

BlockPayload = torch.Tensor
MakeBlock = Callable[[int], BlockPayload]


class _Private:
    """The type of PRIVATE. One instance: a tenant that is no string, so no caller can name its namespace."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PRIVATE"

    def __reduce__(self) -> str:
        return "PRIVATE"  # a copy or a pickle is the same singleton


PRIVATE = _Private()
Tenant = Union[str, _Private, None]
_NO_TREE = object()  # the namespace of a private call: found in no tree


def _namespace(tenant: Tenant, shared_default: bool) -> object:
    """The tree a tenant's blocks live in: its name, None for the default namespace, or _NO_TREE for none."""
    if tenant is PRIVATE:
        return _NO_TREE
    if tenant is None:
        return None if shared_default else _NO_TREE
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, None (the cache's default namespace) or PRIVATE, got "
                        f"{type(tenant).__name__} {tenant!r}; convert ids to strings so that 1, 1.0 and True cannot "
                        "name the same tenant")
    return str.__str__(tenant)  # a plain str: a subclass cannot bring its own __eq__ or __hash__


class LeaseReleasedError(RuntimeError):
    """A lease (or a KV handle) was released twice."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """A consistent snapshot. Queried and hit tokens count every `match` since construction."""

    queries: int
    query_tokens: int
    hit_tokens: int
    inserted_blocks: int
    evicted_blocks: int
    blocks_held: int
    bytes_held: int
    budget_bytes: int
    block_size: int
    pinned_prompts: int = 0
    pinned_blocks: int = 0  # distinct blocks held by pins (prompts sharing a prefix share its blocks)
    pinned_bytes: int = 0
    disk_loaded_blocks: int = 0  # blocks a match loaded from the disk tier (their tokens count as hits)
    disk_declined_blocks: int = 0  # blocks on disk that a match recomputed instead: loading measured slower
    disk_stored_blocks: int = 0  # blocks written to the disk tier (evicted or persisted)

    @property
    def pinned_tokens(self) -> int:
        return self.pinned_blocks * self.block_size

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class _Node:
    __slots__ = ("key", "payload", "nbytes", "parent", "children", "refs", "last_access", "pins", "address")

    def __init__(self, key: tuple[int, ...], payload: Optional[BlockPayload], nbytes: int,
                 parent: Optional["_Node"], address: Optional[BlockAddress] = None):
        self.key = key
        self.payload = payload
        self.nbytes = nbytes
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.refs = 0
        self.last_access = 0
        self.pins = 0
        self.address = address  # its address in the disk tier; None without one


class CacheLease:
    """References on a chain of cached blocks: the first `num_tokens` tokens of a prompt.

    `blocks` are the KV payloads in prompt order. Hold the lease while the KV is in use; `release()` it after.
    """

    def __init__(self, cache: "PrefixCache", nodes: list[_Node], tenant: Tenant):
        self._cache = cache
        self._nodes = nodes
        self.tenant = tenant
        self.blocks: tuple[BlockPayload, ...] = tuple(n.payload for n in nodes)  # type: ignore[misc]
        self.num_tokens = len(nodes) * cache.block_size
        self.released = False

    def release(self) -> None:
        self._cache.release(self)

    def release_if_held(self) -> None:
        """Release unless already released: for finalizers and error paths, where a second release is expected."""
        self._cache._release(self, strict=False)

    def __enter__(self) -> "CacheLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release_if_held()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"CacheLease({self.num_tokens} tokens, tenant={self.tenant!r}, {state})"


class PrefixCache:
    """Longest-prefix KV reuse over full token blocks, under a byte budget, isolated per tenant.

    `block_bytes` (the size of one block's payload) may be given up front; otherwise the first `bind` or `insert`
    fixes it. Either way a budget that cannot hold a single block is refused with a ValueError.
    `tenant=None` is one namespace shared by every unnamed caller of this cache; `shared_default=False` makes
    each unnamed call private instead, like `tenant=PRIVATE` (see the module docstring).
    """

    def __init__(self, budget_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE, *, block_bytes: Optional[int] = None,
                 shared_default: bool = True, disk: Optional[KVDiskTier] = None,
                 recompute_seconds: Optional[Callable[[int, int], float]] = None):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 1:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        if not isinstance(shared_default, bool):
            raise TypeError(f"shared_default must be True or False, got {shared_default!r}")
        if disk is not None and not isinstance(disk, KVDiskTier):
            raise TypeError(f"disk must be a KVDiskTier or None, got {type(disk).__name__}")
        if disk is not None and disk.block_shape[-2] != block_size:
            raise ValueError(f"the disk tier holds blocks of {disk.block_shape[-2]} tokens; this cache's blocks have "
                             f"{block_size}")
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.shared_default = shared_default
        self.disk = disk
        # (tokens to compute, tokens before them) -> measured seconds; set by the engine that owns the cache.
        self.recompute_seconds = recompute_seconds
        self._disk_loaded = self._disk_declined = self._disk_stored = 0
        self._lock = threading.RLock()
        self._roots: dict[Optional[str], _Node] = {}  # None: the shared default namespace
        self._block_bytes: Optional[int] = None
        self._owner: Optional[Callable[[], object]] = None  # a weak reference (a strong one if weakref is refused)
        self._clock = itertools.count(1)
        # Min-heap of (last_access, tiebreak, node) over evictable leaves; stale entries are skipped lazily.
        self._evictable: list[tuple[int, int, _Node]] = []
        self._tiebreak = itertools.count()
        self._queries = self._query_tokens = self._hit_tokens = 0
        self._inserted = self._evicted = 0
        self._blocks_held = self._bytes_held = 0
        self._pins: list[CacheLease] = []
        self._pinned_blocks = self._pinned_bytes = 0
        if block_bytes is not None:
            self._set_block_bytes(block_bytes)
        if disk is not None:
            self.bind(disk.block_bytes)

    # ---- configuration ------------------------------------------------------------------------------------------

    @property
    def block_bytes(self) -> Optional[int]:
        return self._block_bytes

    def bind(self, block_bytes: int, owner: object = None) -> None:
        """Fix the payload size and, optionally, the model whose KV this cache holds.

        KV is only meaningful for the weights that produced it, so one cache serves one model: binding a second,
        different owner raises ValueError instead of silently serving one model's KV to another. The owner is held
        weakly and compared by identity; after it is freed no other model can bind (use a new PrefixCache).
        """
        with self._lock:
            if owner is not None:
                self._bind_owner(owner)
            if self._block_bytes is None:
                self._set_block_bytes(block_bytes)
            elif self._block_bytes != block_bytes:
                raise ValueError(
                    f"this PrefixCache holds blocks of {self._block_bytes} bytes; a block of {block_bytes} bytes "
                    "comes from a different model geometry"
                )

    def _bind_owner(self, owner: object) -> None:
        if self._owner is not None:
            bound = self._owner()
            if bound is not owner:
                gone = " (since freed)" if bound is None else ""
                raise ValueError(f"this PrefixCache already holds KV of another model{gone}; use one cache per model")
            return
        try:
            self._owner = weakref.ref(owner)
        except TypeError:  # not weak-referenceable: hold it, so its address cannot be reused while bound
            self._owner = lambda: owner

    def _set_block_bytes(self, block_bytes: int) -> None:
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        if block_bytes > self.budget_bytes:
            raise ValueError(
                f"PrefixCache budget of {self.budget_bytes} bytes cannot hold one block of {self.block_size} tokens "
                f"({block_bytes} bytes); raise budget_bytes or lower block_size"
            )
        self._block_bytes = block_bytes

    # ---- queries ------------------------------------------------------------------------------------------------

    def _block_keys(self, tokens: Sequence[int], max_tokens: Optional[int]) -> list[tuple[int, ...]]:
        limit = len(tokens) if max_tokens is None else max(0, min(len(tokens), max_tokens))
        bs = self.block_size
        return [tuple(int(t) for t in tokens[i * bs:(i + 1) * bs]) for i in range(limit // bs)]

    def _walk(self, namespace: object, keys: list[tuple[int, ...]]) -> list[_Node]:
        node = self._roots.get(namespace) if namespace is not _NO_TREE else None
        chain: list[_Node] = []
        if node is None:
            return chain
        for key in keys:
            node = node.children.get(key)
            if node is None:
                break
            chain.append(node)
        return chain

    def match(self, tokens: Sequence[int], *, tenant: Tenant = None,
              max_tokens: Optional[int] = None) -> CacheLease:
        """Lease the longest cached prefix of `tokens` (at most `max_tokens` tokens, in whole blocks).

        Counts len(tokens) queried tokens and the leased length as hit tokens.
        """
        namespace = _namespace(tenant, self.shared_default)
        keys = self._block_keys(tokens, max_tokens)
        with self._lock:
            chain = self._walk(namespace, keys)
            self._acquire(chain)  # before loading from disk: making room there must not evict the chain's tail
            if self.disk is not None and namespace is not _NO_TREE and len(chain) < len(keys):
                chain += self._load_from_disk(namespace, chain, keys)
            lease = CacheLease(self, chain, tenant)
            self._queries += 1
            self._query_tokens += len(tokens)
            self._hit_tokens += lease.num_tokens
            return lease

    def cached_tokens(self, tokens: Sequence[int], *, tenant: Tenant = None) -> int:
        """How many leading tokens a `match` would serve now; takes no reference and counts nothing."""
        namespace = _namespace(tenant, self.shared_default)
        keys = self._block_keys(tokens, None)
        with self._lock:
            return len(self._walk(namespace, keys)) * self.block_size

    # ---- pinning ------------------------------------------------------------------------------------------------

    def pin(self, tokens: Sequence[int], *, tenant: Tenant = None) -> CacheLease:
        """Pin every full block of `tokens`, which must all be cached (in `tenant`'s namespace) already; returns
        the pin, for `unpin`. A ValueError, and nothing pinned, when a block is missing or the namespace is private."""
        namespace = _namespace(tenant, self.shared_default)
        if namespace is _NO_TREE:
            raise ValueError(f"tenant {tenant!r} is private: a block pinned there could never be found")
        keys = self._block_keys(tokens, None)
        if not keys:
            raise ValueError(f"a prompt of {len(tokens)} tokens has no full block of {self.block_size} to pin")
        with self._lock:
            chain = self._walk(namespace, keys)
            if len(chain) < len(keys):
                raise ValueError(f"only {len(chain)} of the prompt's {len(keys)} full blocks are cached (the budget of "
                                 f"{self.budget_bytes} bytes ran out, or they were never inserted); nothing pinned")
            self._acquire(chain)
            lease = CacheLease(self, chain, tenant)
            for node in chain:
                node.pins += 1
                if node.pins == 1:
                    self._pinned_blocks += 1
                    self._pinned_bytes += node.nbytes
            self._pins.append(lease)
            return lease

    def unpin(self, lease: CacheLease) -> None:
        """Undo one `pin`: its blocks become ordinary cached blocks (evictable once nothing else holds them)."""
        with self._lock:
            if not any(lease is pin for pin in self._pins):
                raise ValueError("this lease is not a pin of this cache (or was unpinned already)")
            self._pins = [pin for pin in self._pins if pin is not lease]
            for node in lease._nodes:
                node.pins -= 1
                if node.pins == 0:
                    self._pinned_blocks -= 1
                    self._pinned_bytes -= node.nbytes
            self._release(lease, strict=True)

    # ---- insertion ----------------------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], make_block: MakeBlock, *, tenant: Tenant = None) -> CacheLease:
        """Cache every full block of `tokens` that is not cached yet; lease the whole cached chain.

        `make_block(i)` returns the payload of block i (tokens[i*bs:(i+1)*bs]); it is called only for missing
        blocks and its tensor must not alias memory the caller keeps mutating. When the budget runs out (every
        other block is referenced) insertion stops: the lease then covers a shorter prefix. Insertion never
        counts as a query. A private call (PRIVATE, or tenant=None without shared_default) stores nothing: no
        later call could find it.
        """
        namespace = _namespace(tenant, self.shared_default)
        if namespace is _NO_TREE:
            return CacheLease(self, [], tenant)
        keys = self._block_keys(tokens, None)
        with self._lock:
            already = len(self._walk(namespace, keys))
        built = {i: self._checked_payload(make_block(i)) for i in range(already, len(keys))}
        with self._lock:
            root = self._roots.get(namespace)
            if root is None:
                root = self._roots[namespace] = self._new_root(namespace)
            node, chain = root, []
            for i, key in enumerate(keys):
                child = node.children.get(key)
                if child is None:
                    # Another thread may have evicted a block we saw as present: rebuild it here, rarely.
                    payload = built.pop(i, None)
                    if payload is None:
                        payload = self._checked_payload(make_block(i))
                    nbytes = int(payload.nbytes)
                    # The chain built so far is referenced (acquired below as we go), so room-making can only
                    # take other tenants' or other prompts' unreferenced leaves.
                    if not self._make_room(nbytes):
                        break
                    child = _Node(key, payload, nbytes, node, self._address_below(node, key))
                    node.children[key] = child
                    self._blocks_held += 1
                    self._bytes_held += nbytes
                    self._inserted += 1
                self._acquire([child])
                chain.append(child)
                node = child
            # Room-making may have evicted this root's last child and dropped the root meanwhile.
            if root.children:
                self._roots[namespace] = root
            else:
                self._roots.pop(namespace, None)
            return CacheLease(self, chain, tenant)

    def _checked_payload(self, payload: BlockPayload) -> BlockPayload:
        if not isinstance(payload, torch.Tensor):
            raise TypeError(f"a block payload must be a torch.Tensor, got {type(payload).__name__}")
        nbytes = int(payload.nbytes)
        with self._lock:
            if self._block_bytes is None:
                self._set_block_bytes(nbytes)
            elif nbytes != self._block_bytes:
                raise ValueError(f"block payload of {nbytes} bytes; this cache holds blocks of {self._block_bytes}")
        return payload

    # ---- references and eviction ---------------------------------------------------------------------------------

    def _acquire(self, chain: list[_Node]) -> None:
        now = next(self._clock)
        for node in chain:
            node.refs += 1
            node.last_access = now

    def release(self, lease: CacheLease) -> None:
        """Drop the lease's references. A second release raises LeaseReleasedError."""
        self._release(lease, strict=True)

    def _release(self, lease: CacheLease, *, strict: bool) -> None:
        if lease._cache is not self:
            raise ValueError("this lease belongs to another PrefixCache")
        with self._lock:
            if lease.released:
                if strict:
                    raise LeaseReleasedError(f"{lease!r} was already released")
                return
            lease.released = True
            for node in lease._nodes:
                node.refs -= 1
                if node.refs == 0 and not node.children:
                    self._push_evictable(node)

    def _push_evictable(self, node: _Node) -> None:
        heapq.heappush(self._evictable, (node.last_access, next(self._tiebreak), node))
        if len(self._evictable) > 2 * self._blocks_held + 16:
            # Every release pushes an entry and only evictions pop them, so while nothing needs evicting the stale
            # ones (re-referenced, touched since, or evicted) would pile up without bound: drop them. At most one
            # entry per evictable block remains, so this runs at most once per blocks_held + 16 pushes.
            self._evictable = [entry for entry in self._evictable
                               if entry[0] == entry[2].last_access and self._is_evictable(entry[2])]
            heapq.heapify(self._evictable)

    def _is_evictable(self, node: _Node) -> bool:
        return node.refs == 0 and not node.children and node.parent is not None and node.payload is not None

    def _make_room(self, nbytes: int) -> bool:
        while self._bytes_held + nbytes > self.budget_bytes:
            if not self._evict_one():
                return False
        return True

    def _evict_one(self) -> bool:
        while self._evictable:
            stamp, _, node = heapq.heappop(self._evictable)
            if not self._is_evictable(node) or stamp != node.last_access:
                continue  # stale: re-referenced, grew a child, already evicted, or touched since it was pushed
            self._spill(node)
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            node.payload = None
            self._blocks_held -= 1
            self._bytes_held -= node.nbytes
            self._evicted += 1
            if parent.parent is not None and parent.refs == 0 and not parent.children:
                self._push_evictable(parent)
            elif parent.parent is None and not parent.children:
                self._drop_empty_root(parent)
            return True
        return False

    def _drop_empty_root(self, root: _Node) -> None:
        for tenant, r in list(self._roots.items()):
            if r is root:
                del self._roots[tenant]
                return

    def evict(self, nbytes: int) -> int:
        """Evict unreferenced leaves, least recently used first, until `nbytes` are freed or none is left.

        Returns the bytes freed.
        """
        with self._lock:
            start = self._bytes_held
            while start - self._bytes_held < nbytes and self._evict_one():
                pass
            return start - self._bytes_held

    # ---- the disk tier ------------------------------------------------------------------------------------------

    def _new_root(self, namespace: Optional[str]) -> _Node:
        address = None
        if self.disk is not None:
            label = "default" if namespace is None else f"tenant:{namespace}"
            address = root_address(self.disk.model_key, label)
        return _Node((), None, 0, None, address)

    def _address_below(self, parent: _Node, key: tuple[int, ...]) -> Optional[BlockAddress]:
        return None if parent.address is None else child_address(parent.address, key)

    def _spill(self, node: _Node) -> None:
        """Write an evicted block to the disk tier; a failing disk costs the block, never the eviction."""
        if self.disk is None or node.address is None or node.payload is None:
            return
        try:
            if self.disk.store(node.address, node.payload):
                self._disk_stored += 1
        except OSError as exc:
            warnings.warn(f"ttftc prefix cache: could not write a block to the disk tier ({exc})", stacklevel=3)

    def _load_from_disk(self, namespace: Optional[str], chain: list[_Node],
                        keys: list[tuple[int, ...]]) -> list[_Node]:
        """Continue `chain` (acquired) with the blocks the disk holds, when loading them measures cheaper than
        recomputing; the loaded blocks come back acquired."""
        root = self._roots.get(namespace)
        parent = chain[-1] if chain else root if root is not None else self._new_root(namespace)
        addresses, address = [], parent.address
        for key in keys[len(chain):]:
            address = child_address(address, key)
            if not self.disk.contains(address):
                break
            addresses.append(address)
        if not addresses:
            return []
        tokens, context = len(addresses) * self.block_size, len(chain) * self.block_size
        recompute = self.recompute_seconds(tokens, context) if self.recompute_seconds is not None else None
        if recompute is None or self.disk.load_seconds(len(addresses) * self.disk.block_bytes) >= recompute:
            self._disk_declined += len(addresses)
            return []
        if root is None:  # no chain either: the parent is a fresh root
            root = parent
        loaded: list[_Node] = []
        node = parent
        for key, address in zip(keys[len(chain):], addresses):
            payload = self.disk.load(address)
            if payload is None or not self._make_room(int(payload.nbytes)):
                break
            child = _Node(key, payload, int(payload.nbytes), node, address)
            node.children[key] = child
            self._blocks_held += 1
            self._bytes_held += child.nbytes
            self._disk_loaded += 1
            self._acquire([child])
            loaded.append(child)
            node = child
        # Room-making may have dropped the root (its last other leaf evicted); a root is kept while it has children.
        if root.children:
            self._roots[namespace] = root
        return loaded

    def persist(self) -> int:
        """Write every block held in RAM to the disk tier (those already there are kept); returns how many are
        there now. For a clean shutdown: the next process finds them."""
        if self.disk is None:
            return 0
        with self._lock:
            nodes = [node for root in self._roots.values() for node in _descendants(root)]
            for node in nodes:
                self._spill(node)
            return sum(1 for node in nodes if self.disk.contains(node.address))

    def clear(self) -> int:
        """Evict every unreferenced block; referenced ones stay. Returns the bytes freed."""
        return self.evict(self.budget_bytes + 1)

    # ---- introspection ------------------------------------------------------------------------------------------

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                queries=self._queries, query_tokens=self._query_tokens, hit_tokens=self._hit_tokens,
                inserted_blocks=self._inserted, evicted_blocks=self._evicted, blocks_held=self._blocks_held,
                bytes_held=self._bytes_held, budget_bytes=self.budget_bytes, block_size=self.block_size,
                pinned_prompts=len(self._pins), pinned_blocks=self._pinned_blocks, pinned_bytes=self._pinned_bytes,
                disk_loaded_blocks=self._disk_loaded, disk_declined_blocks=self._disk_declined,
                disk_stored_blocks=self._disk_stored,
            )

    def check_invariants(self, live_leases: Sequence[CacheLease] = ()) -> None:
        """Assert the tree is consistent: byte and block totals, budget, and (given every live lease) refcounts.

        For tests and debugging; walks the whole tree under the lock.
        """
        with self._lock:
            expected_refs: dict[int, int] = {}
            live_leases = list(live_leases) + (self._pins if live_leases else [])  # the cache's own leases
            for lease in live_leases:
                if not lease.released:
                    for node in lease._nodes:
                        expected_refs[id(node)] = expected_refs.get(id(node), 0) + 1
            blocks = nbytes = pinned = 0
            for root in self._roots.values():
                assert root.payload is None and root.refs == 0
                stack = list(root.children.values())
                while stack:
                    node = stack.pop()
                    assert node.payload is not None and len(node.key) == self.block_size
                    assert node.parent is not None and node.parent.children.get(node.key) is node
                    assert node.refs >= 0
                    if live_leases:
                        assert node.refs == expected_refs.get(id(node), 0), (node.refs, expected_refs.get(id(node)))
                    # A lease references a whole chain from the root, so no child is referenced more than its parent.
                    assert all(child.refs <= node.refs for child in node.children.values())
                    blocks += 1
                    nbytes += node.nbytes
                    pinned += node.pins > 0
                    stack.extend(node.children.values())
            assert blocks == self._blocks_held, (blocks, self._blocks_held)
            assert nbytes == self._bytes_held, (nbytes, self._bytes_held)
            assert pinned == self._pinned_blocks, (pinned, self._pinned_blocks)
            assert self._bytes_held <= self.budget_bytes, (self._bytes_held, self.budget_bytes)
            for lease in live_leases:
                if not lease.released:
                    for node in lease._nodes:
                        assert node.payload is not None, "a referenced block was evicted"

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PrefixCache({s.blocks_held} blocks, {s.bytes_held}/{s.budget_bytes} bytes, "
                f"block_size={s.block_size}, hit rate {s.hit_rate:.1%})")


def _descendants(root: _Node) -> list[_Node]:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
