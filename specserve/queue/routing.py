"""Prefix-aware claiming: a request goes first to a worker that already holds its prompt's
leading KV blocks, and waits for it a bounded few milliseconds before any worker may take it.

Everything stays in the one request stream and its consumer group (the KEDA lag, reclaim, dead letters and
trim see no difference). Each prompt long enough to be worth it has a routing key, a hash of its first
characters as every worker decodes them (`prefix_key`): requests behind the same long system prompt share it.
A worker that starts a keyed request advertises the key (`{prefix}:warm:<key>`, a sorted set of workers by
expiry) and, every fraction of a second, its load (`{prefix}:load`). A worker that reads a fresh keyed
entry it is cold for, while another live worker is warm for it and not much busier, passes the entry on in
one script (PASS): the group's pending entry is moved to the warm consumer (XCLAIM JUSTID: not a delivery)
and its id goes to that worker's pass stream, which it reads with a blocking XREAD. The warm worker claims it
as its own read (the CLAIM script checks the owner). If it has not within `wait_ms` (full, slow, dead), the
passer takes the entry back (TAKEBACK: only while it is still unclaimed) and runs it itself; if the passer
dies meanwhile, the entry is an idle pending entry like any other and a live worker's XAUTOCLAIM takes it
after the claim timeout. An entry is passed at most once (the status hash's `passed` field).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from specserve.queue.keys import Keys
from specserve.queue.resp import RespClient
from specserve.queue.wire import RequestBody, RequestEntry

# Below this many prompt characters (~250 tokens) a prompt holds few full blocks: reusing them saves less
# than a pass costs. The key covers the first ROUTE_KEY_CHARS: a shared system prompt decides it.
ROUTE_MIN_CHARS = 1024
ROUTE_KEY_CHARS = 1024
ROUTE_MIN_IDS = 256  # the same for prompts sent as token ids


def prefix_key(body: RequestBody) -> str | None:
    """The routing key of a request: equal for requests whose prompts begin alike, None if it is too short
    to route. Computed by every worker from the body alone, so producers need not send it."""
    if body.messages is not None:
        text = "".join(f"\x1e{m.get('role')}\x1f{m.get('content')}" for m in body.messages)
        if body.chat_template_kwargs:  # they can change what the template renders first
            text = orjson.dumps(body.chat_template_kwargs, option=orjson.OPT_SORT_KEYS).decode() + text
    elif isinstance(body.prompt, str):
        text = body.prompt
    elif isinstance(body.prompt, list) and len(body.prompt) >= ROUTE_MIN_IDS:
        text = "ids:" + ",".join(map(str, body.prompt[:ROUTE_MIN_IDS])) + "x" * ROUTE_MIN_CHARS
    else:
        return None
    if len(text) < ROUTE_MIN_CHARS:
        return None
    seed = f"{body.model or ''}\x1d{text[:ROUTE_KEY_CHARS]}"
    return hashlib.sha256(seed.encode("utf-8", "surrogateescape")).hexdigest()[:32]


@dataclass(frozen=True)
class RoutingConfig:
    # On by default: bench/prefix_routing.py, two workers on one machine: 1.6-2x tok/s when each cache holds
    # about half the system prompts, even (0.98x, noise) when both hold them all.
    enabled: bool = True
    # How long a passed request waits for the warm worker to claim it. 20 ms was too short on a 2-core CPU
    # box: the warm worker's event loop shares its core with the engine, and 3-4 of 4-7 passes came back.
    wait_ms: int = 50
    # Pass only to a warm worker with at most this many more requests in flight than the passer: a popular
    # system prompt must not pile every request onto one worker while another idles (SGLang's router has
    # the same guard).
    slack: int = 4
    warm_ttl_ms: int = 60_000  # a key is advertised this long after the worker last started a request with it
    load_every_ms: int = 200  # how often a worker publishes its load
    pass_maxlen: int = 1000


_NOW = """
local _t = redis.call('TIME')
local now_ms = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
"""

# KEYS: the load hash. ARGV: worker, in flight, free room, ttl_ms of the hash.
LOAD = (
    _NOW
    + """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. string.format('%d', now_ms))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
"""
)

# KEYS: warm sets of the keys just started. ARGV: worker, warm ttl_ms.
ADVERTISE = (
    _NOW
    + """
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, now_ms + tonumber(ARGV[2]), ARGV[1])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
  redis.call('PEXPIRE', key, ARGV[2])
end
"""
)

# KEYS: requests stream, status hash, warm set of the entry's key, load hash.
# ARGV: group, this worker, entry id, slack, load freshness ms, pass stream key prefix, pass maxlen, ttl_ms.
# Returns the worker the entry was passed to, or '' when it stays here.
PASS = (
    _NOW
    + """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] or tonumber(p[1][4]) ~= 1 then return '' end
-- A raw XADD has no status hash until its first claim: it may be passed too.
local h = redis.call('HMGET', KEYS[2], 'entry', 'status', 'passed')
if (h[1] and h[1] ~= ARGV[3]) or (h[2] and h[2] ~= 'queued') or h[3] then return '' end
local warm = redis.call('ZRANGEBYSCORE', KEYS[3], now_ms, '+inf')
if #warm == 0 then return '' end
local function load(w)
  local v = redis.call('HGET', KEYS[4], w)
  if not v then return nil end
  local busy, room, at = string.match(v, '^(%d+) (%-?%d+) (%d+)$')
  if not at or tonumber(at) < now_ms - tonumber(ARGV[5]) then return nil end
  return tonumber(busy), tonumber(room)
end
local mine = load(ARGV[2]) or 0
local best, best_busy, best_room = nil, nil, nil
for _, w in ipairs(warm) do
  if w == ARGV[2] then return '' end
  local busy, room = load(w)
  if busy and room > 0 and busy <= mine + tonumber(ARGV[4]) and (not best or busy < best_busy) then
    best, best_busy, best_room = w, busy, room
  end
end
if not best then return '' end
-- Count the pass in its load now: a burst read at once must not all go to one worker on a stale figure.
local at = string.match(redis.call('HGET', KEYS[4], best), '(%d+)$')
redis.call('HSET', KEYS[4], best, (best_busy + 1) .. ' ' .. (best_room - 1) .. ' ' .. at)
-- The pass stream is written before the move (the script may stop at it: queue/scripts.py): a stop there
-- leaves the entry here, and a pass the other worker finds not its own to claim.
local stream = ARGV[6] .. best
redis.call('XADD', stream, 'MAXLEN', '~', ARGV[7], '*', 'entry', ARGV[3], 'from', ARGV[2])
redis.call('PEXPIRE', stream, ARGV[8])
redis.call('HSET', KEYS[2], 'passed', best)
redis.call('PEXPIRE', KEYS[2], ARGV[8])
redis.call('XCLAIM', KEYS[1], ARGV[1], best, 0, ARGV[3], 'JUSTID')
return best
"""
)

# KEYS: requests stream, status hash. ARGV: group, the worker it was passed to, this worker, entry id.
# Takes a passed entry back while that worker has not claimed it (still its pending entry, still queued).
TAKEBACK = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[4], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
if redis.call('HGET', KEYS[2], 'status') == 'running' then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[4], 'JUSTID')
return 1
"""


class Router:
    """One worker's side of prefix-aware claiming."""

    def __init__(
        self, fast: RespClient, blocking: RespClient, block_ms: int, keys: Keys, name: str, cfg: RoutingConfig
    ) -> None:
        self.fast = fast
        self.blocking = blocking
        self.block_ms = block_ms
        self.keys = keys
        self.name = name
        self.cfg = cfg
        self._last_pass: str | None = None  # the last pass read; None: from now on

    async def publish_load(self, busy: int, room: int) -> None:
        ttl = max(10 * self.cfg.load_every_ms, 10_000)
        await self.fast.execute("EVAL", LOAD, 1, self.keys.load, self.name, busy, room, ttl)

    async def advertise(self, route_keys: list[str]) -> None:
        if route_keys:
            warm = [self.keys.warm(k) for k in dict.fromkeys(route_keys)]
            await self.fast.execute("EVAL", ADVERTISE, len(warm), *warm, self.name, self.cfg.warm_ttl_ms)

    async def offer(self, entries: list[tuple[RequestEntry, str]], ttl_ms: int) -> dict[str, str]:
        """Pass each (entry, key) to a warm worker where one should have it; returns entry id -> worker."""
        fresh_ms = max(10 * self.cfg.load_every_ms, 1000)
        commands: list[tuple[Any, ...]] = []
        for e, key in entries:
            assert e.request_id is not None
            commands.append(
                (
                    "EVAL", PASS, 4, self.keys.requests, self.keys.req(e.request_id), self.keys.warm(key),
                    self.keys.load, self.keys.group, self.name, e.entry_id, self.cfg.slack,
                    fresh_ms, self.keys.passes(""), self.cfg.pass_maxlen, ttl_ms,
                )
            )  # fmt: skip
        replies = await self.fast.pipeline(commands, raise_on_error=False)
        return {e.entry_id: r for (e, _), r in zip(entries, replies) if isinstance(r, str) and r}

    async def take_back(self, entry: RequestEntry, passed_to: str) -> RequestEntry | None:
        """The entry, ours again, if `passed_to` has not claimed it; None if it has (or it is gone)."""
        assert entry.request_id is not None
        ok = await self.fast.execute(
            "EVAL", TAKEBACK, 2, self.keys.requests, self.keys.req(entry.request_id),
            self.keys.group, passed_to, self.name, entry.entry_id,
        )  # fmt: skip
        return entry if ok else None

    async def passed_to_me(self) -> list[str]:
        """Entry ids other workers passed here since the last call; blocks up to the client's block time."""
        if self._last_pass is None:  # not "$": a pass sent between two reads would be missed
            sec, usec = await self.fast.execute("TIME")
            self._last_pass = f"{int(sec) * 1000 + int(usec) // 1000}-0"
        reply = await self.blocking.execute(
            "XREAD",
            "COUNT",
            256,
            "BLOCK",
            self.block_ms,
            "STREAMS",
            self.keys.passes(self.name),
            self._last_pass,
        )
        ids: list[str] = []
        for _, items in reply or []:
            for sid, fields in items:
                self._last_pass = sid
                f = dict(zip(fields[::2], fields[1::2]))
                if "entry" in f:
                    ids.append(f["entry"])
        return ids
