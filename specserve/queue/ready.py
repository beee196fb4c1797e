"""The ready queue: priority bands and per-tenant fair share in front of the workers.

Producers keep XADDing to the one request stream. A worker with room reads what is new and sorts it in
(SORT_IN): the entry's pending ownership moves to the pseudo-consumer `~ready` (XCLAIM JUSTID: not a
delivery) and its id joins its tenant's list in its band. To admit, a worker takes (TAKE) from the best band
(lowest priority value), rotating between the band's tenants by deficit round robin over tokens, and the
ownership moves to that worker, which then claims and runs the entry as before. Because the consumer group's
pending list stays the single record of who holds what, nothing here can lose a request: a crash between any
two scripts leaves the entry pending with a worker (reclaimed after the claim timeout) or with `~ready`
(taken later). Reclaim skips `~ready` (scripts of this module), so a long wait in the ready queue is not
mistaken for a dead worker.

Why deficit round robin by tokens, not by requests: a tenant's cost is what it asks the engine for (its
prompt and its max_tokens), so a tenant sending long generations cannot take more of the engine's time than
one sending short ones just by sending as many requests.

Why a tenant whose queue was empty joins the ring at its head, and why a turn's grant is spent in that turn:
otherwise the order of arrival decided the share. A tenant was granted its quantum and moved behind the
others in one go, to spend it a round later; a tenant arriving beside a running burst was granted, moved
behind, and waited out the burst's leftover credit and its fresh quantum too: a burst that landed first held
back a small tenant's few for up to two quanta of the burst (with quantum 256 and requests of ~28 tokens,
about 18 requests; tests/test_priority_fairness.py). Now a turn begins with its grant and the tenant is
served at once, and, as in fq_codel's new-flows list, a newly active tenant takes the next turn.

Starvation is bounded by one rule: every `oldest_every`-th admission (all workers together) takes the
request that has waited longest, whatever its band or tenant. A request that is the oldest waiting one is
therefore admitted within `oldest_every` admissions, and one with m older requests ahead within
m x `oldest_every`.

Keys ({prefix}:ready:...): `bands` (sorted set of bands with waiting work, scored by priority), `ring:<band>`
(list: the band's tenants with waiting work, in round-robin order), `q:<band>:<tenant>` (list of
"<entry id> <cost>"), `deficit:<band>` (hash: tenant -> tokens of credit), `grant:<band>` (the tenant whose
turn's quantum has been granted), `age` (sorted set of every waiting
entry, scored by its enqueue time), `turn` (admissions counter). A request without a tenant is the tenant
`~`, a name no tenant can have.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from specserve.queue import scripts
from specserve.queue.connection import TRANSIENT_ERRORS
from specserve.queue.keys import Keys
from specserve.queue.resp import RespClient, ScriptKeyMoved, fields_dict
from specserve.queue.wire import RequestBody, RequestEntry

NO_TENANT = "~"
MAX_COST = 32_768  # tokens: one request's cost is capped, so one huge request costs a tenant a bounded wait


@dataclass(frozen=True)
class FairShare:
    quantum: int = 512  # tokens of credit a tenant gains each time the round robin passes it
    oldest_every: int = 8  # every Nth admission takes the longest-waiting request, whatever its band (0: off)
    # Most entries sorted into the ready queue at once; beyond, new entries wait in the stream (and count as
    # its lag) until the ready queue drains below this. Bounds a sort's cost and keeps KEDA's lag trigger
    # meaningful for a huge backlog.
    sort_ahead: int = 4096


class Admission(enum.StrEnum):
    """SORT_IN's answer for an entry just read (its values are the script's words)."""

    READY = "ready"  # sorted into the ready queue: a take admits it
    REFUSED = "refused"  # a raw XADD over one of its tenant's limits: end it failed, naming the limit
    DIRECT = "direct"  # a duplicate or finished id: claim it now, and the claim settles it
    NOTMINE = "notmine"  # no longer pending with this worker (a retry after it moved): leave it


@dataclass(frozen=True)
class Sorted:
    verdict: Admission
    tenant: str | None = None  # READY: the tenant it waits under (None: no tenant)
    limit: str | None = None  # REFUSED: the limit that refused it (max_backlog, tenant_max_queued, ...)

    @classmethod
    def of_reply(cls, reply: list[Any]) -> Sorted:
        verdict, detail = Admission(str(reply[0])), str(reply[1])
        if verdict is Admission.READY:
            return cls(verdict, tenant=detail or None)
        if verdict is Admission.REFUSED:
            return cls(verdict, limit=detail)
        return cls(verdict)


def cost_of(body: RequestBody, default_max_tokens: int) -> int:
    """Tokens a request asks of the engine: its prompt (about 4 characters a token) and its max_tokens."""
    if body.messages is not None:
        prompt = sum(len(m.get("content") or "") for m in body.messages) // 4
    elif isinstance(body.prompt, str):
        prompt = len(body.prompt) // 4
    else:
        prompt = len(body.prompt or [])
    asked = body.sampling.get("max_tokens", default_max_tokens)
    out = asked if isinstance(asked, int) and not isinstance(asked, bool) else default_max_tokens
    return max(1, min(MAX_COST, prompt + out))


_LIB = """
local R = ARGV[3]
local function qkey(band, t) return R .. 'q:' .. band .. ':' .. t end
local function member(eid, band, t, cost) return eid .. ' ' .. band .. ' ' .. t .. ' ' .. cost end
"""

# One entry a worker has just read. KEYS: requests stream, status hash. ARGV: group, consumer, ready prefix,
# entry id, band, tenant from the body ('' none), cost, request id, then the limits for a request the API did
# not admit (a raw XADD): quota prefix, max backlog, tenant max queued, tenant tokens per minute, tokens
# asked, ttl_ms, the default tenant (a raw entry naming no tenant counts against its limits: recorded as the
# status hash's `quota`, not as its owner, so any reader may still read it). Returns {verdict, detail}:
# ready (sorted in; detail: its tenant), refused (detail: the limit), direct (a duplicate or finished id:
# the worker's claim settles it), notmine (already moved: a retry).
SORT_IN = (
    scripts._NOW
    + scripts._TERMINAL
    + scripts._QUOTA
    + _LIB
    + """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[4], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return {'notmine', ''} end
local h = redis.call('HMGET', KEYS[2], 'admitted', 'tenant', 'status', 'entry')
if (h[4] and h[4] ~= ARGV[4]) or (h[3] and terminal(h[3])) then return {'direct', ''} end
local tenant = h[2] or ARGV[6]
local eid_ms = string.match(ARGV[4], '^(%d+)')
if not h[1] then
  local q = {stream = KEYS[1], group = ARGV[1], prefix = ARGV[9], backlog = ARGV[10], max_queued = ARGV[11],
    tpm = ARGV[12], asked = ARGV[13], ttl = ARGV[14], new = 0}
  local counted = tenant
  if counted == '' then counted = ARGV[15] end  -- the default tenant ('' : none) counts what names none
  local refused = admit(counted, q)
  if refused then return {'refused', refused[2]} end
  if counted ~= '' and ARGV[9] ~= '' then queued(ARGV[9], counted, ARGV[8], now_ms, ARGV[14]) end
  local f = {'admitted', '1'}
  if tenant == '' and counted ~= '' then f = {'admitted', '1', 'quota', counted} end
  if not h[3] then
    f[#f + 1] = 'status'; f[#f + 1] = 'queued'; f[#f + 1] = 'entry'; f[#f + 1] = ARGV[4]
    f[#f + 1] = 'created'; f[#f + 1] = eid_ms
    if tenant ~= '' then f[#f + 1] = 'tenant'; f[#f + 1] = tenant end
  end
  redis.call('HSET', KEYS[2], unpack(f))
  redis.call('PEXPIRE', KEYS[2], ARGV[14])
end
local t = tenant
if t == '' then t = '"""
    + NO_TENANT
    + """' end
local band, cost = ARGV[5], ARGV[7]
local q = qkey(band, t)
redis.call('RPUSH', q, ARGV[4] .. ' ' .. cost)
if redis.call('LLEN', q) == 1 then redis.call('LPUSH', R .. 'ring:' .. band, t) end
redis.call('ZADD', R .. 'bands', tonumber(band), band)
redis.call('ZADD', R .. 'age', tonumber(eid_ms), member(ARGV[4], band, t, cost))
-- The move to `~ready` is the last write: a script stopped before it (a key its slot's migration already
-- moved, queue/resp.py) leaves the entry with this worker, and a list member that TAKE skips.
redis.call('XCLAIM', KEYS[1], ARGV[1], '"""
    + scripts.READY_CONSUMER
    + """', 0, ARGV[4], 'JUSTID')
return {'ready', tenant}
"""
)

# A worker takes up to n entries to run. KEYS: requests stream. ARGV: group, consumer, ready prefix, n,
# oldest_every, quantum, better_than ('' or a band: take only from bands below it, and no oldest turn).
# Returns {waiting left, {entry id, fields}...}.
TAKE = (
    _LIB
    + """
local n, every, quantum, better = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local function split(s)
  local out = {}
  for part in string.gmatch(s, '[^ ]+') do out[#out + 1] = part end
  return out
end
-- The ring's head has the turn; `grant:<band>` names whom the current turn was granted to. A head not granted
-- yet (it just came round, or just arrived) is granted a quantum as its turn begins; it is served while its
-- credit covers its next request, and then the turn passes (what credit is left stays its own).
local function drr(band)
  local ring, dk, granted = R .. 'ring:' .. band, R .. 'deficit:' .. band, R .. 'grant:' .. band
  for _ = 1, 100000 do
    local t = redis.call('LINDEX', ring, 0)
    if not t then return nil end
    local head = redis.call('LINDEX', qkey(band, t), 0)
    if not head then
      redis.call('LPOP', ring)
      redis.call('HDEL', dk, t)
    else
      local eid, cost = unpack(split(head))
      local d = tonumber(redis.call('HGET', dk, t) or '0')
      if redis.call('GET', granted) ~= t then
        d = d + quantum
        redis.call('HSET', dk, t, d)
        redis.call('SET', granted, t)
      end
      if d >= tonumber(cost) then
        -- the pop is the last write before the move to the worker: a script stopped before it (a key its
        -- slot's migration already moved) leaves the entry in its list, where the next take finds it
        redis.call('ZREM', R .. 'age', member(eid, band, t, cost))
        redis.call('HSET', dk, t, d - tonumber(cost))
        redis.call('LPOP', qkey(band, t))
        return eid, cost, t
      end
      redis.call('DEL', granted)
      redis.call('LMOVE', ring, ring, 'LEFT', 'RIGHT')
    end
  end
  return nil
end
local out = {0}
-- One admission; false when nothing is left to take.
local function take_one()
  local eid, band, t, cost
  if better == '' and every > 0 and redis.call('INCR', R .. 'turn') % every == 0 then
    local m = redis.call('ZRANGE', R .. 'age', 0, 0)
    if #m == 0 then return false end
    eid, band, t, cost = unpack(split(m[1]))
    redis.call('LREM', qkey(band, t), 1, eid .. ' ' .. cost)
    redis.call('ZREM', R .. 'age', m[1])  -- last before the move: stopped before it, it is still the oldest
  else
    local b = redis.call('ZRANGE', R .. 'bands', 0, 0)
    if #b == 0 then return false end
    band = b[1]
    if better ~= '' and tonumber(band) >= tonumber(better) then return false end
    eid, cost, t = drr(band)
  end
  if eid then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], eid, eid, 1)
    if #p == 1 and p[1][2] == '"""
    + scripts.READY_CONSUMER
    + """' then
      -- JUSTID: moving along the queue is not a delivery (the claim's count of failed runs stays true)
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, eid, 'JUSTID')
      local e = redis.call('XRANGE', KEYS[1], eid, eid)
      if #e == 1 then out[#out + 1] = e[1] end
    end
  end
  if band and redis.call('LLEN', qkey(band, t or '')) == 0 then
    if t then
      redis.call('LREM', R .. 'ring:' .. band, 0, t)
      redis.call('HDEL', R .. 'deficit:' .. band, t)
    end
    if redis.call('LLEN', R .. 'ring:' .. band) == 0 then
      redis.call('ZREM', R .. 'bands', band)
      redis.call('DEL', R .. 'deficit:' .. band, R .. 'grant:' .. band)
    end
  end
  return true
end
-- Once an entry has moved to this worker, a stop (a key its slot's migration already moved) must not lose
-- the reply that hands it over: the take ends there with what it has, and a later take redoes the tidying.
-- Before that, a stop is raised and the script is run again from the start (queue/resp.py ScriptKeyMoved).
local tries = 0
while #out - 1 < n and tries < n + 1000 do
  tries = tries + 1
  local ok, more = pcall(take_one)
  if not ok then
    if #out == 1 then error(more) end
    out[1] = 1  -- unknown: maybe more waits
    return out
  end
  if not more then break end
end
local ok, waiting = pcall(redis.call, 'ZCARD', R .. 'age')
if not ok then
  if #out == 1 then error(waiting) end
  waiting = 1
end
out[1] = waiting
return out
"""
)

# Take over entries of dead (or draining) workers: idle past the claim timeout and held by any consumer but
# `~ready` (whose entries are waiting, not stuck). KEYS: requests stream. ARGV: group, consumer, min idle ms,
# count. Returns {entry id, fields} pairs; entries deleted from the stream leave the pending list unreturned.
RECLAIM = (
    """
local out = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local t = {}
  for i = 1, #c, 2 do t[c[i]] = c[i + 1] end
  if t['name'] ~= '"""
    + scripts.READY_CONSUMER
    + """' and tonumber(t['pending']) > 0 then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], '-', '+', ARGV[4] - #out, t['name'])
    for _, e in ipairs(p) do
      for _, got in ipairs(redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], e[1])) do
        out[#out + 1] = got
      end
    end
    if #out >= tonumber(ARGV[4]) then return out end
  end
end
return out
"""
)


@dataclass(frozen=True)
class Taken:
    entries: list[RequestEntry]
    waiting: int  # entries left in the ready queue


class ReadyQueue:
    def __init__(
        self,
        fast: RespClient,
        keys: Keys,
        name: str,
        fair: FairShare,
        limits: Any,
        ttl_ms: int,
        default_max_tokens: int = 16,
    ) -> None:
        self.fast = fast
        self.keys = keys
        self.name = name
        self.fair = fair
        self.limits = limits  # queue.client.Limits: the raw XADDs' admission limits
        self.ttl_ms = ttl_ms
        self.default_max_tokens = default_max_tokens
        self.prefix = ready_prefix(keys)

    async def sort_in(self, items: list[tuple[RequestEntry, RequestBody]]) -> list[Sorted | Exception]:
        """Sort freshly read entries into the ready queue, one script each in one round trip. An entry whose
        script fails gets its error back in its place (the caller claims it directly); a lost connection
        raises, and the entries stay pending with this worker."""
        lim = self.limits
        commands = []
        for e, body in items:
            assert e.request_id is not None
            cost = cost_of(body, self.default_max_tokens)
            asked = body.sampling.get("max_tokens", self.default_max_tokens)
            commands.append(
                (
                    "EVAL", SORT_IN, 2, self.keys.requests, self.keys.req(e.request_id),
                    self.keys.group, self.name, self.prefix, e.entry_id, body.priority, body.tenant or "",
                    cost, e.request_id, self.keys.quota, lim.max_backlog, lim.tenant_max_queued,
                    lim.tenant_tokens_per_minute, asked if isinstance(asked, int) else 0, self.ttl_ms,
                    lim.default_tenant,
                )
            )  # fmt: skip
        replies = await self.fast.pipeline(commands, raise_on_error=False)
        for r in replies:
            # a sort stopped by a slot's migration left the entry with this worker (its move to `~ready` is
            # the script's last write): claimed directly, as any entry whose sort failed
            if isinstance(r, TRANSIENT_ERRORS) and not isinstance(r, ScriptKeyMoved):
                raise r
        return [r if isinstance(r, Exception) else Sorted.of_reply(r) for r in replies]

    async def take(self, n: int, better_than: int | None = None) -> Taken:
        """Up to n entries for this worker, best band first, fair between tenants (see the module's doc);
        with `better_than`, only from bands of a lower priority value."""
        reply = await self.fast.execute(
            "EVAL", TAKE, 1, self.keys.requests, self.keys.group, self.name, self.prefix, n,
            self.fair.oldest_every, self.fair.quantum, "" if better_than is None else better_than,
        )  # fmt: skip
        waiting, *items = reply
        entries = [RequestEntry.from_fields(eid, fields_dict(f)) for eid, f in items]
        return Taken(entries, int(waiting))

    async def depth(self) -> dict[tuple[int, str], int]:
        return await waiting_by_band(self.fast, self.keys)


def ready_prefix(keys: Keys) -> str:
    return keys.ready


async def waiting_by_band(fast: RespClient, keys: Keys) -> dict[tuple[int, str], int]:
    """(band, tenant) -> requests waiting in the ready queue ('' for no tenant)."""
    prefix = ready_prefix(keys)
    bands = await fast.execute("ZRANGE", prefix + "bands", 0, -1)
    if not bands:
        return {}
    rings = await fast.pipeline([("LRANGE", f"{prefix}ring:{b}", 0, -1) for b in bands])
    pairs = [(str(b), str(t)) for b, ring in zip(bands, rings) for t in ring]
    sizes = await fast.pipeline([("LLEN", f"{prefix}q:{b}:{t}") for b, t in pairs])
    return {(int(b), "" if t == NO_TENANT else t): int(size) for (b, t), size in zip(pairs, sizes) if size}


async def oldest_ms(fast: RespClient, keys: Keys) -> int | None:
    """Enqueue time of the longest-waiting request in the ready queue."""
    got = await fast.execute("ZRANGE", ready_prefix(keys) + "age", 0, 0, "WITHSCORES")
    return int(float(got[1])) if got else None
