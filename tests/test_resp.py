"""The lean hot-path client (specserve.queue.resp) against a real valkey-server: replies in order for any
number of callers on one connection, errors as redis-py's exceptions, reconnects, timeouts, credentials, a
failed-over (read-only) server, and the TLS settings of the redis-py client it is made from."""

from __future__ import annotations

import asyncio
import ssl
import time

import pytest
from redis.exceptions import AuthenticationError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from valkey_helpers import run

from specserve.queue.connection import connect
from specserve.queue.resp import Endpoint, RespClient, fields_dict

pytest_plugins = ("valkey_fixtures",)  # the valkey fixture


def test_replies_match_redis_py_and_errors_are_its_exceptions(valkey):
    async def main():
        r = connect(valkey.url)
        fast = RespClient(r)
        try:
            assert await fast.execute("SET", "k", "v") == "OK"
            assert await fast.execute("GET", "k") == "v" and await fast.execute("GET", "missing") is None
            assert await fast.execute("EVAL", "return {1, 'two', {3}}", 0) == [1, "two", [3]]
            eid = await fast.execute("XADD", "s", "*", "a", "1", "b", "é")
            ((_, items),) = await fast.execute("XREAD", "STREAMS", "s", "0")
            assert items == [[eid, ["a", "1", "b", "é"]]] and fields_dict(items[0][1]) == {"a": "1", "b": "é"}
            assert (await r.xrange("s"))[0] == (eid, fields_dict(items[0][1]))
            with pytest.raises(ResponseError, match="WRONGTYPE"):
                await fast.execute("LPUSH", "k", "x")
            # one write, replies in their places; an error raises (first one) unless asked to hand it back
            replies = await fast.pipeline([("INCR", "n"), ("LPUSH", "k", "x"), ("INCR", "n")], False)
            assert replies[0] == 1 and isinstance(replies[1], ResponseError) and replies[2] == 2
            with pytest.raises(ResponseError):
                await fast.pipeline([("INCR", "n"), ("LPUSH", "k", "x")])
            assert await fast.execute("GET", "n") == "3"  # the raising pipeline still ran every command
        finally:
            await fast.aclose()
            await r.aclose()

    run(main())


def test_many_tasks_share_one_connection_and_a_caller_that_gives_up_keeps_the_order(valkey):
    async def main():
        r = connect(valkey.url)
        fast = RespClient(r)
        try:
            await fast.execute("PING")
            before = (await r.info("clients"))["connected_clients"]
            values = await asyncio.gather(*(fast.execute("INCR", "counter") for _ in range(300)))
            assert sorted(values) == list(range(1, 301))  # each caller got a reply of its own
            assert (await r.info("clients"))["connected_clients"] == before  # and no new connection
            # A caller cancelled while its reply is on the way: the next caller still gets its own reply.
            waiting = asyncio.ensure_future(fast.execute("BLPOP", "nothing", 0.3))
            await asyncio.sleep(0.05)
            waiting.cancel()
            assert await fast.execute("ECHO", "mine") == "mine"
        finally:
            await fast.aclose()
            await r.aclose()

    run(main())


def test_a_lost_connection_fails_what_is_in_flight_and_the_next_command_reconnects(valkey):
    async def main():
        admin = connect(valkey.url)
        fast = RespClient(admin)
        try:
            first_id = await fast.execute("CLIENT", "ID")
            blocked = asyncio.ensure_future(fast.execute("BLPOP", "nothing", 5))
            await asyncio.sleep(0.05)
            await admin.client_kill_filter(_id=first_id)
            t0 = time.monotonic()
            with pytest.raises(RedisConnectionError):
                await blocked
            assert time.monotonic() - t0 < 1  # at once, not at the block's or the reply timeout's end
            assert await fast.execute("CLIENT", "ID") != first_id
            await asyncio.to_thread(valkey.restart)
            assert await fast.execute("PING", retries=2) == "PONG"
        finally:
            await fast.aclose()
            await admin.aclose()

    run(main())


def test_a_reply_that_does_not_come_times_out_and_the_client_recovers(valkey):
    async def main():
        r = connect(valkey.url, socket_timeout=0.3)
        fast = RespClient(r)
        try:
            t0 = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await fast.execute("BLPOP", "nothing", 3)
            assert 0.25 < time.monotonic() - t0 < 1.5
            assert await fast.execute("PING") == "PONG"
            blocking = RespClient(r, block_ms=1000)  # a reader that blocks waits out its block
            assert await blocking.execute("BLPOP", "nothing", 0.8) is None
            await blocking.aclose()
        finally:
            await fast.aclose()
            await r.aclose()

    run(main())


def test_credentials_and_database_come_from_the_redis_py_client(valkey):
    async def main():
        admin = connect(valkey.url)
        await admin.acl_setuser("svc", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"])
        user = connect(f"redis://svc:s3cret@{valkey.host}:{valkey.port}/3")
        fast = RespClient(user)
        wrong = RespClient(connect(f"redis://svc:nope@{valkey.host}:{valkey.port}/0"))
        try:
            assert await fast.execute("ACL", "WHOAMI") == "svc"
            await fast.execute("SET", "in-db-3", "yes")
            assert await user.get("in-db-3") == "yes" and await admin.get("in-db-3") is None
            with pytest.raises(AuthenticationError):
                await wrong.execute("PING")
        finally:
            for c in (fast, wrong):
                await c.aclose()
            await user.aclose()
            await admin.aclose()

    run(main())


def test_a_read_only_reply_drops_the_connection_so_the_next_command_finds_the_primary(valkey):
    """A failed-over primary turns replica and answers READONLY; the client reconnects on its next command
    (behind a service name, that reaches the new primary)."""

    async def main():
        admin = connect(valkey.url)
        fast = RespClient(admin)
        try:
            first_id = await fast.execute("CLIENT", "ID")
            await admin.execute_command("REPLICAOF", "127.0.0.1", "1")  # a primary that is not there
            with pytest.raises(ReadOnlyError):
                await fast.execute("SET", "k", "v")
            await admin.execute_command("REPLICAOF", "NO", "ONE")
            assert await fast.execute("SET", "k", "v") == "OK"
            assert await fast.execute("CLIENT", "ID") != first_id
        finally:
            await fast.aclose()
            await admin.aclose()

    run(main())


def test_endpoint_takes_tls_socket_and_timeouts_from_the_url() -> None:
    plain = Endpoint.of(connect("redis://u:p@cache:6380/2"))
    assert (plain.host, plain.port, plain.username, plain.password, plain.db, plain.ssl) == (
        "cache",
        6380,
        "u",
        "p",
        2,
        None,
    )
    tls = Endpoint.of(connect("rediss://cache:6380/0?ssl_cert_reqs=none"))
    assert isinstance(tls.ssl, ssl.SSLContext) and tls.ssl.verify_mode == ssl.CERT_NONE
    verified = Endpoint.of(connect("rediss://cache:6380/0"))
    assert verified.ssl is not None and verified.ssl.verify_mode == ssl.CERT_REQUIRED
    assert Endpoint.of(connect("unix:///run/valkey.sock?db=1")).path == "/run/valkey.sock"


def test_a_script_goes_whole_once_a_connection_then_by_sha_and_whole_again_after_noscript(valkey):
    """The first EVAL of a script on a connection sends its text (and loads it), the next ones EVALSHA; a
    server that lost its script cache (SCRIPT FLUSH, a restart) answers NOSCRIPT, and the command goes again
    whole, in execute and in a pipeline alike, running once each time."""
    script = "return redis.call('INCR', KEYS[1])"

    def calls(stats: dict, name: str) -> int:
        return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))

    async def main():
        r = connect(valkey.url)
        fast = RespClient(r)
        try:
            await r.config_resetstat()
            got = [await fast.execute("EVAL", script, 1, "n")]
            got += await fast.pipeline([("EVAL", script, 1, "n"), ("EVAL", script, 1, "n")])
            stats = await r.info("commandstats")
            first = calls(stats, "eval"), calls(stats, "evalsha")
            await r.script_flush()
            got.append(await fast.execute("EVAL", script, 1, "n"))
            await r.script_flush()
            got += await fast.pipeline([("EVAL", script, 1, "n"), ("INCR", "other")])
            got.append(await fast.execute("EVAL", script, 1, "n"))
            return got, first, await r.get("n")
        finally:
            await fast.aclose()
            await r.aclose()

    got, first, n = run(main())
    assert first == (1, 2)  # one EVAL, then EVALSHA
    assert got == [1, 2, 3, 4, 5, 1, 6] and n == "6"  # each ran once, in order
