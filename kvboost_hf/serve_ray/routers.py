"""Request routers for the replicas, built on Ray Serve's extension point (``ray.serve.request_router``).

A router lives in the process holding the deployment handle (the ingress) and sees each call's arguments: the
:class:`~kvboost_hf.serve_ray.routing.ForwardedRequest` with its chunk keys. It returns ranks of replicas; Ray Serve
probes the first rank's queue lengths and sends the request to the least-loaded replica that accepts it, falling to
the next rank when none does. Ray's own ``PowerOfTwoChoicesRequestRouter`` is the third policy (no class here).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvboost_hf.serve_ray.routing import (
    DEFAULT_FALLBACK,
    DEFAULT_IMBALANCE_THRESHOLD,
    InFlight,
    PrefixTable,
    choose_ranked,
    request_keys,
)


class ChunkAffinityRouter(RequestRouter):
    """Sends a request to the replica that was sent its longest chunk-key prefix (its RAM tier holds those
    chunks), unless replicas' in-flight requests differ by more than ``imbalance_threshold``; then, or for a
    prefix no replica holds, ``fallback`` (``least_loaded`` or ``power_of_two``). See
    :func:`~kvboost_hf.serve_ray.routing.choose_ranked`.

    The table of keys is per router (per ingress replica), learnt from the requests it routed.
    """

    def initialize_state(
        self,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
        fallback: str = DEFAULT_FALLBACK,
        table_capacity: int = 1 << 16,
        seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.imbalance_threshold = imbalance_threshold
        self.fallback = fallback
        self.table = PrefixTable(table_capacity)
        self.in_flight = InFlight()
        self.rng = random.Random(seed)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        keys = request_keys(pending_request.args) if pending_request is not None else ()
        ranks = choose_ranked(
            keys,
            list(by_id),
            self.in_flight.loads(),
            self.table,
            imbalance_threshold=self.imbalance_threshold,
            fallback=self.fallback,
            rng=self.rng,
        )
        return [[by_id[replica] for replica in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.in_flight.start(pending_request.metadata.internal_request_id, replica_id.unique_id)
        self.table.record(request_keys(pending_request.args), replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.finish(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget([replica_id.unique_id])

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = {replica_id.unique_id for replica_id in self.curr_replicas} - {r.replica_id.unique_id for r in replicas}
        super().update_replicas(replicas)
        if gone:
            self.table.forget(gone)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in a fixed order (the baseline that ignores chunk keys). A request keeps its
    turn while Ray Serve routes it again (a full replica, backoff), so every request takes exactly one turn."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.counter = itertools.count()
        self.turns: dict[str, int] = {}  # request id -> its turn, until routed or completed

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        if pending_request is None:
            return [[ordered[next(self.counter) % len(ordered)]]]
        request_id = pending_request.metadata.internal_request_id
        if request_id not in self.turns:
            self.turns[request_id] = next(self.counter)
        return [[ordered[self.turns[request_id] % len(ordered)]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.turns.pop(pending_request.metadata.internal_request_id, None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.turns.pop(internal_request_id, None)
