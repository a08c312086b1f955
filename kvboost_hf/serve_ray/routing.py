"""Routing by chunk identity, as pure functions and small state objects (no Ray here; :mod:`.routers` wires them
into Ray Serve's request-router extension point).

* :func:`routing_keys`: a request's leading chunk keys, computed exactly as the store names the chunks (the same
  namespace, tenant ``cache_salt`` included, the same chunking and the same chained prefix keys), so a replica that
  computed a conversation's prefix is found again by its next turn, and two tenants never share a key.
* :class:`PrefixTable`: which replicas were sent which keys (bounded, least recently used keys dropped first).
* :class:`InFlight`: requests each replica is working on, as this router sent them.
* :class:`ForwardedRequest`: an HTTP request on its way from the ingress to a replica, carrying its keys.
* :func:`choose_ranked`: ranks of replicas for one request: the replicas holding its longest stored prefix first,
  unless the replicas' loads differ by more than a threshold; then least-loaded or power-of-two.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from kvboost_hf.core.chunking import chunk_spans
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.core.keys import KeySpace, chain_prefix_keys

FALLBACKS = ("least_loaded", "power_of_two")
DEFAULT_FALLBACK = FALLBACKS[0]
DEFAULT_IMBALANCE_THRESHOLD = 1
"""In-flight requests by which replicas may differ before prefix routing lets load decide."""
DEFAULT_MAX_CHUNKS = 512  # keys computed per request: 512 chunks of the default 128 tokens cover 64k tokens


def routing_keys(
    space: KeySpace, token_ids: Sequence[int], cache_salt: str | None, max_chunks: int = DEFAULT_MAX_CHUNKS
) -> tuple[str, ...]:
    """Prefix keys of the first ``max_chunks`` full chunks of ``token_ids`` in tenant ``cache_salt``'s namespace:
    the keys under which a replica stores the prompt's K/V (the unfinished last chunk has none)."""
    spans = chunk_spans(token_ids, space.chunking)[:max_chunks]
    return tuple(chain_prefix_keys(space.namespace(cache_salt), token_ids, spans))


@dataclass(frozen=True, kw_only=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it (headers lower-cased, the whole body) and its routing keys."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    routing_keys: tuple[str, ...] = ()


def request_keys(args: Sequence[object]) -> tuple[str, ...]:
    """The routing keys of a call whose first argument is a :class:`ForwardedRequest`; () for any other call."""
    return args[0].routing_keys if args and isinstance(args[0], ForwardedRequest) else ()


class PrefixTable:
    """Chunk key -> replicas that were sent a request holding it (most recent last), at most ``capacity`` keys.

    Prefix keys are chained, so a request's key ``i`` being known means its first ``i + 1`` chunks were seen
    together: the deepest known key gives the longest stored prefix.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ConfigError(f"capacity must be at least one key, got {capacity}")
        self.capacity = capacity
        self._holders: OrderedDict[str, list[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, keys: Sequence[str], replica: str) -> None:
        """Note that ``replica`` computed (and stored) the chunks named by ``keys``."""
        for key in keys:
            holders = self._holders.pop(key, [])
            if replica in holders:
                holders.remove(replica)
            holders.append(replica)
            self._holders[key] = holders
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def longest_match(self, keys: Sequence[str], replicas: Collection[str]) -> tuple[int, list[str]]:
        """(chunks matched, the ``replicas`` holding them, most recent first): the deepest of ``keys`` that one of
        ``replicas`` holds; (0, []) when none does."""
        for depth in range(len(keys), 0, -1):
            holders = self._holders.get(keys[depth - 1])
            live = [r for r in reversed(holders or ()) if r in replicas]
            if live:
                self._holders.move_to_end(keys[depth - 1])
                return depth, live
        return 0, []

    def forget(self, replicas: Collection[str]) -> None:
        """Drop ``replicas`` (gone: their RAM tier went with them)."""
        gone = set(replicas)
        for key in list(self._holders):
            kept = [r for r in self._holders[key] if r not in gone]
            if kept:
                self._holders[key] = kept
            else:
                del self._holders[key]


@dataclass
class InFlight:
    """Requests sent and not yet completed, by request id: ``loads()`` counts them per replica."""

    replica_of: dict[str, str] = field(default_factory=dict)

    def start(self, request_id: str, replica: str) -> None:
        self.replica_of[request_id] = replica

    def finish(self, request_id: str) -> None:
        """Forget ``request_id`` (unknown ids are ignored: a request refused by a full replica never started)."""
        self.replica_of.pop(request_id, None)

    def loads(self) -> Counter[str]:
        return Counter(self.replica_of.values())


def choose_ranked(
    keys: Sequence[str],
    candidates: Sequence[str],
    loads: Mapping[str, int],
    table: PrefixTable,
    *,
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
    fallback: str = DEFAULT_FALLBACK,
    rng: random.Random | None = None,
) -> list[list[str]]:
    """Ranks of ``candidates`` for a request with chunk ``keys`` (Ray Serve tries the first rank first and takes
    its least-loaded replica that accepts).

    While the candidates' ``loads`` (requests in flight) differ by at most ``imbalance_threshold``, the replicas
    holding the longest stored prefix come first (least-loaded first), the others after. Otherwise, or when no
    candidate holds any of ``keys``: ``fallback`` ``"least_loaded"`` (the least-loaded replicas, then the rest) or
    ``"power_of_two"`` (two random candidates, least-loaded first).
    """
    if fallback not in FALLBACKS:
        raise ConfigError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if not candidates:
        return []

    def load(replica: str) -> int:
        return loads.get(replica, 0)

    spread = max(map(load, candidates)) - min(map(load, candidates))
    depth, holders = table.longest_match(keys, candidates) if spread <= imbalance_threshold else (0, [])
    if depth:
        first = sorted(holders, key=load)
        return [first, [r for r in candidates if r not in first]] if len(first) < len(candidates) else [first]
    if fallback == "power_of_two":
        return [sorted((rng or random).sample(list(candidates), min(2, len(candidates))), key=load)]
    lowest = min(map(load, candidates))
    first = [r for r in candidates if load(r) == lowest]
    rest = [r for r in candidates if load(r) != lowest]
    return [first, rest] if rest else [first]
