"""Fleet-wide tenant limits on a Redis Cluster with several shards: each tenant's counters in a slot of its
own.

On one instance, or on a cluster with one shard, the admission scripts (scripts.ENQUEUE, ready.SORT_IN,
CLAIM, CANCEL, HANDBACK) count a tenant's queued requests and tokens per minute beside the request stream,
atomically. With N > 1 shards on a cluster no slot holds every shard's stream and a tenant's counters, and
counting per shard would let a tenant queue N times its cap. So the counters move to the tenant's own slot,
`{<prefix>:t:<tenant>}` (`Keys.tenant_quota`), and admission becomes two steps, each in one slot:

1. RESERVE on the tenant's slot: the same `admit` rule as a single instance's (queued set pruned of members
   older than the request TTL, then the cap on queued requests, then the tokens-per-minute counter), and the
   request ids join the tenant's queued set, scored by the server's clock. Ids already there (a retried
   enqueue) count nothing twice.
2. ENQUEUE on the request's shard, with the tenant limits off (the backlog cap still counted per shard).
   A refusal there (the backlog), or ids the shard already knew (an idempotent re-add), gives the
   reservation back at once (RELEASE: the ids it added, and the tokens it counted).

Nothing here holds a count that a crash can leak for good, because the queued set is a cache whose truth is
each request's status hash: the worker takes a request out of its tenant's set as it claims it (what CLAIM
does in-script on one instance), and when a reservation is refused for `tenant_max_queued` the counters are
first reconciled and the reservation tried once more. Reconciling reads every member's status hash (on its
shard) and forgets each member that is no longer queued (running, ended, gone), or that has no status hash
RESERVE_GRACE_MS after it was reserved (a producer that died between the two steps); a member is forgotten
only if its score is still the one read (FORGET), so one queued again meanwhile stays. So a worker killed
between its claim and its release, an API killed between the two steps, a cancel or a failover that lost the
release all cost nothing beyond the next reconcile: a refusal is only ever answered while the tenant really
has `tenant_max_queued` requests queued or being enqueued.

Tokens per minute are a counter of what was asked, as on one instance: an enqueue refused after its
reservation gives its tokens back; a producer killed between the two steps leaves its tokens counted for
the rest of that minute (the key lives 2 minutes), erring on the side of the limit.

Raw XADDs (producers that skip the API) are not counted against tenant limits in this layout: their tenant
is only known once a worker reads the entry on its shard.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from specserve.queue import scripts
from specserve.queue.keys import Keys

log = logging.getLogger(__name__)

# How long a reserved id may have no status hash before a reconcile forgets it: longer than an enqueue's
# retries across a failover (client.FAILOVER_RETRIES: about 5 s) with room to spare.
RESERVE_GRACE_MS = 60_000

# KEYS: the tenant's queued set (its slot; the tokens-per-minute key shares the tag). ARGV: quota prefix,
# tenant, max queued, tokens per minute, tokens each request asks, ttl_ms, then the request ids.
# Returns {-1, limit, retry after s} when a limit refuses them (nothing counted), else {1, minute, ids the
# set did not hold yet...}.
RESERVE = (
    scripts._NOW
    + scripts._QUOTA
    + """
local fresh = {}
for i = 7, #ARGV do
  if not redis.call('ZSCORE', KEYS[1], ARGV[i]) then fresh[#fresh + 1] = ARGV[i] end
end
local minute = math.floor(tonumber(now_ms) / 60000)
if #fresh == 0 then return {1, minute} end
local q = {prefix = ARGV[1], backlog = '0', max_queued = ARGV[3], tpm = ARGV[4], asked = ARGV[5],
  ttl = ARGV[6], new = 1, count = #fresh}
local refused = admit(ARGV[2], q)
if refused then return refused end
local out = {1, minute}
for _, id in ipairs(fresh) do
  queued(ARGV[1], ARGV[2], id, now_ms, ARGV[6])
  out[#out + 1] = id
end
return out
"""
)

# Give a reservation back. KEYS: the tenant's queued set. ARGV: quota prefix, tenant, minute, tokens to give
# back, then the ids to forget.
RELEASE = """
for i = 5, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
local tokens = tonumber(ARGV[4])
if tokens > 0 then
  local key = ARGV[1] .. 'tpm:' .. ARGV[2] .. ':' .. ARGV[3]
  local left = tonumber(redis.call('GET', key) or '0') - tokens
  if left > 0 then redis.call('SET', key, left, 'KEEPTTL') else redis.call('DEL', key) end
end
return 1
"""

# The members to reconcile. KEYS: the tenant's queued set. ARGV: ttl_ms. Returns {now_ms, id, score, ...}
# after dropping members older than the TTL.
SNAPSHOT = (
    scripts._NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(now_ms) - tonumber(ARGV[1]))
local out = {now_ms}
local got = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #got do out[#out + 1] = got[i] end
return out
"""
)

# Forget members whose score is still the one read (one queued again meanwhile has a newer one).
# KEYS: the tenant's queued set. ARGV: id, score, id, score... Returns how many were forgotten.
FORGET = """
local n = 0
for i = 1, #ARGV, 2 do
  local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if s and tonumber(s) == tonumber(ARGV[i + 1]) then
    redis.call('ZREM', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
"""


@dataclass(frozen=True)
class Reservation:
    """What RESERVE counted: the ids it added to the tenant's set, in `minute`, `tokens` each."""

    tenant: str
    minute: int
    tokens: int
    ids: tuple[str, ...]


class TenantCounters:
    """One tenant-slot side of admission for a sharded cluster (see the module's doc). `redis` is the
    cluster client, which routes each script by its one key."""

    def __init__(self, redis: Any, keys: Keys, ttl_ms: int, grace_ms: int = RESERVE_GRACE_MS) -> None:
        self.r = redis
        self.keys = keys
        self.ttl_ms = ttl_ms
        self.grace_ms = grace_ms

    def queued_key(self, tenant: str) -> str:
        return f"{self.keys.tenant_quota(tenant)}queued:{tenant}"

    async def reserve(
        self, tenant: str, ids: Sequence[str], tokens: int, max_queued: int, tokens_per_minute: int
    ) -> Reservation | tuple[str, int]:
        """Count `ids` against the tenant's limits: a Reservation, or (limit, retry after s) when refused
        (nothing counted). A refusal for the queued cap is answered only after a reconcile confirms it."""
        for attempt in range(2):
            reply = await self.r.eval(
                RESERVE, 1, self.queued_key(tenant), self.keys.tenant_quota(tenant), tenant, max_queued,
                tokens_per_minute, tokens, self.ttl_ms, *ids,
            )  # fmt: skip
            if int(reply[0]) == -1:
                limit, retry = str(reply[1]), int(reply[2])
                if limit == "tenant_max_queued" and attempt == 0 and await self.reconcile(tenant):
                    continue
                return limit, retry
            return Reservation(tenant, int(reply[1]), tokens, tuple(str(i) for i in reply[2:]))
        raise AssertionError("unreachable")

    async def release(self, reservation: Reservation, ids: Sequence[str], tokens: int) -> None:
        """Give back part of a reservation: `ids` leave the queued set, `tokens` leave the minute's count."""
        if not ids and not tokens:
            return
        t = reservation.tenant
        await self.r.eval(
            RELEASE, 1, self.queued_key(t), self.keys.tenant_quota(t), t, reservation.minute, tokens, *ids
        )

    async def forget(self, pairs: Sequence[tuple[str, str]]) -> None:
        """(tenant, request id) pairs no longer queued (claimed, cancelled): out of their tenants' sets.
        Best effort: a release lost here is found by the next reconcile."""
        by_tenant: dict[str, list[str]] = {}
        for tenant, request_id in pairs:
            by_tenant.setdefault(tenant, []).append(request_id)
        for tenant, ids in by_tenant.items():
            try:
                await self.r.zrem(self.queued_key(tenant), *ids)
            except RedisError as e:
                log.warning("could not release %d of tenant %s's queued requests (%s)", len(ids), tenant, e)

    async def reconcile(self, tenant: str) -> int:
        """Forget the members of the tenant's queued set that are not queued any more; returns how many."""
        key = self.queued_key(tenant)
        reply = await self.r.eval(SNAPSHOT, 1, key, self.ttl_ms)
        now = int(reply[0])
        members = [(str(reply[i]), str(reply[i + 1])) for i in range(1, len(reply), 2)]
        if not members:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for request_id, _ in members:
            pipe.hget(self.keys.of_request(request_id).req(request_id), "status")
        statuses = await pipe.execute()
        stale: list[str] = []
        for (request_id, score), status in zip(members, statuses):
            if status == "queued":
                continue
            if status is None and now - int(float(score)) < self.grace_ms:
                continue  # reserved, its enqueue maybe still under way
            stale += [request_id, score]
        if not stale:
            return 0
        return int(await self.r.eval(FORGET, 1, key, *stale))
