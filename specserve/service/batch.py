"""OpenAI's Files and Batch APIs on the queue: /v1/files and /v1/batches.

A batch's lines become ordinary queued requests (ids `<batch id>-<line>`), so a worker crash mid-batch loses
nothing: its lines are reclaimed like any other request. Lines go in through the same limits as any request
(the tenant's waiting cap, tokens per minute, the backlog): a line a limit holds back waits in the batch and
goes in as capacity frees, found by every API's background fill (BatchRoutes.fill_held, every FILL_EVERY_S)
or by a read of the batch, whichever comes first. The batch keeps no process state: its
counts are advanced from its lines' status hashes a bounded step per read (see BatchRoutes' batches
section), and the reader that finds every line ended writes the output and error files (under a lock, so two
API pods cannot both do it).

Files live in Redis (a hash per file: its bytes and metadata), for as long as results do (the request TTL);
their size is capped (`SPECSERVE_MAX_FILE_BYTES`). Batch lines run in a band of their own, BATCH_PRIORITY
plus whatever priority a line gives, so interactive requests (priority 0 by default) go first
(queue/ready.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import orjson
from aiohttp import web

from specserve.queue import wire
from specserve.queue.client import QuotaExceeded
from specserve.queue.connection import TRANSIENT_ERRORS, stop_tasks
from specserve.service.gateway import Gateway
from specserve.service.http import TENANT_KEY, ApiError, json_response, read_json, reject_deep
from specserve.service.openai.protocol import translate
from specserve.service.openai.responses import completion_body

ENDPOINTS = {"/v1/chat/completions": True, "/v1/completions": False}  # endpoint -> chat
WINDOW_S = {"24h": 86400}
LIVE = ("validating", "in_progress", "finalizing", "cancelling")
MAX_FILES_LISTED = 10_000  # OpenAI's largest `limit` for GET /v1/files, and its default
# The band batch lines run in (plus a line's own priority): behind interactive requests, whose default is 0.
BATCH_PRIORITY = 10
# Lines one poll queues or counts, at most: a poll's cost is bounded whatever the batch's size.
ADVANCE_LINES = 1000
# How often an API looks for room for batches' held-back lines when nobody reads them: a line waits about
# this long after a request ends before it takes the freed place.
FILL_EVERY_S = 0.5

log = logging.getLogger(__name__)


class BatchRoutes:
    def __init__(self, gateway: Gateway, max_file_bytes: int) -> None:
        self.gateway = gateway
        self.client = gateway.client
        self.r = gateway.client.r
        self.keys = gateway.client.keys
        self.max_file_bytes = max_file_bytes

    # ---- files ----------------------------------------------------------------------------------------

    def _file_key(self, file_id: str) -> str:
        return self.keys.batch("file", file_id)

    def _files_key(self, request: web.Request) -> str:
        """A tenant's file ids by creation time (GET /v1/files); the files themselves expire on their own."""
        return self.keys.batch("files", request.get(TENANT_KEY) or "-")

    async def _put_file(self, request: web.Request, data: bytes, filename: str, purpose: str) -> dict:
        file_id = "file-" + uuid.uuid4().hex
        meta = {"id": file_id, "bytes": len(data), "created_at": int(time.time()), "filename": filename}
        meta |= {"purpose": purpose, "tenant": request.get(TENANT_KEY) or ""}
        key, index, now = self._file_key(file_id), self._files_key(request), time.time()
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(key, mapping={"meta": orjson.dumps(meta).decode(), "data": data})
        pipe.pexpire(key, self.client.ttl_ms)
        pipe.zadd(index, {file_id: now})
        pipe.zremrangebyscore(index, "-inf", now - self.client.ttl_ms / 1000)  # files expired by now
        pipe.pexpire(index, self.client.ttl_ms)
        await pipe.execute()
        return meta

    async def _file(self, request: web.Request, file_id: str, with_data: bool = False) -> tuple[dict, bytes]:
        fields = ["meta", "data"] if with_data else ["meta"]
        # the raw client: a file's bytes are whatever was uploaded, not necessarily text
        values = await self.client.fast.execute("HMGET", self._file_key(file_id), *fields)
        meta = orjson.loads(values[0]) if values and values[0] else None
        if meta is None or (meta["tenant"] or None) != request.get(TENANT_KEY):
            raise ApiError(404, f"file_id: no file {file_id!r}", "file_id", code="not_found")
        data = values[1] if with_data else ""
        return meta, data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data

    @staticmethod
    def _file_object(meta: dict) -> dict:
        public = {k: v for k, v in meta.items() if k != "tenant"}
        return {"object": "file", "status": "processed", **public}

    async def create_file(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "body: must be multipart/form-data with `file` and `purpose`", "file")
        reader = await request.multipart()
        purpose, data, filename = None, None, "upload.jsonl"
        async for part in reader:
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode(errors="replace")
            elif part.name == "file":
                filename = part.filename or filename
                chunks, size = [], 0
                while chunk := await part.read_chunk():
                    size += len(chunk)
                    if size > self.max_file_bytes:
                        raise ApiError(
                            413, f"file: larger than the limit of {self.max_file_bytes} bytes", "file"
                        )
                    chunks.append(chunk)
                data = b"".join(chunks)
        if purpose != "batch":
            raise ApiError(400, "purpose: only 'batch' is supported", "purpose")
        if data is None:
            raise ApiError(400, "file: required", "file")
        return json_response(self._file_object(await self._put_file(request, data, filename, purpose)))

    async def get_file(self, request: web.Request) -> web.Response:
        meta, _ = await self._file(request, request.match_info["id"])
        return json_response(self._file_object(meta))

    async def file_content(self, request: web.Request) -> web.Response:
        _, data = await self._file(request, request.match_info["id"], with_data=True)
        return web.Response(body=data, content_type="application/octet-stream")

    async def delete_file(self, request: web.Request) -> web.Response:
        file_id = request.match_info["id"]
        await self._file(request, file_id)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self._file_key(file_id))
        pipe.zrem(self._files_key(request), file_id)
        await pipe.execute()
        return json_response({"id": file_id, "object": "file", "deleted": True})

    async def list_files(self, request: web.Request) -> web.Response:
        """The caller's files, newest first (OpenAI's `purpose`, `limit`, `order` and `after`)."""
        query = request.query
        try:
            limit = min(MAX_FILES_LISTED, max(1, int(query.get("limit", str(MAX_FILES_LISTED)))))
        except ValueError:
            raise ApiError(400, "limit: must be an integer", "limit") from None
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, "order: one of ['asc', 'desc']", "order")
        index = self._files_key(request)
        ids = await (self.r.zrevrange if order == "desc" else self.r.zrange)(index, 0, -1)
        if (after := query.get("after")) in ids:
            ids = ids[ids.index(after) + 1 :]
        pipe = self.r.pipeline(transaction=False)
        for file_id in ids:
            pipe.hget(self._file_key(file_id), "meta")
        metas = [orjson.loads(raw) for raw in await pipe.execute() if raw]
        purpose = query.get("purpose")
        files = [self._file_object(m) for m in metas if purpose is None or m["purpose"] == purpose]
        page = files[:limit]
        body = {"object": "list", "data": page, "has_more": len(files) > limit}
        body |= {"first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}
        return json_response(body)

    # ---- batches --------------------------------------------------------------------------------------
    # A batch is a small hash (the batch object, its tenant, its counters) and lists read only when they must
    # be: `lines` (every valid line: custom id, request id, model; read when the files are written or the
    # batch is cancelled), `errors` (lines refused when read), `pending` (valid lines a limit held back: they
    # go in as capacity frees) and `open` (queued lines not yet seen ended). A poll reads the hash, then
    # advances the batch by at most ADVANCE_LINES of `pending` and `open`, under a short lock so two API pods
    # do not count the same line twice: never the whole batch (20,000 lines were 3 MB read and rewritten on
    # every poll).

    def _batch_key(self, batch_id: str, part: str = "") -> str:
        return self.keys.batch("batch", batch_id + (f":{part}" if part else ""))

    def _index_key(self, request: web.Request) -> str:
        return self.keys.batch("batches", request.get(TENANT_KEY) or "-")

    def _holding_key(self) -> str:
        """The set of batches with lines held back, every tenant's: what the background fill walks."""
        return self.keys.batch("holding", "batches")

    async def create_batch(self, request: web.Request) -> web.Response:
        data = await read_json(request)
        endpoint, window = data.get("endpoint"), data.get("completion_window", "24h")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint: one of {sorted(ENDPOINTS)}", "endpoint")
        if window not in WINDOW_S:
            raise ApiError(400, "completion_window: only '24h' is supported", "completion_window")
        metadata = data.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise ApiError(400, "metadata: must be an object", "metadata")
        file_id = data.get("input_file_id")
        if not isinstance(file_id, str):
            raise ApiError(400, "input_file_id: required", "input_file_id")
        _, content = await self._file(request, file_id, with_data=True)
        batch_id = "batch_" + uuid.uuid4().hex
        now = int(time.time())
        lines, errors = await self._read_lines(request, batch_id, content, endpoint)
        batch = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": file_id,
            "completion_window": window,
            "status": "in_progress" if lines else "failed",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": now if lines else None,
            "expires_at": now + WINDOW_S[window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None if lines else now,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": len(lines) + len(errors), "completed": 0, "failed": len(errors)},
            "metadata": metadata,
        }
        if not lines:
            batch["errors"] = {"object": "list", "data": [e["error"] for e in errors][:100]}
        ttl = self.client.ttl_ms
        state = {"batch": orjson.dumps(batch), "tenant": request.get(TENANT_KEY) or ""}
        state |= {"completed": 0, "failed": len(errors)}
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self._batch_key(batch_id), mapping=state)
        for part, rows in (
            ("lines", [[c, rid, model] for c, rid, model, _ in lines]),
            ("errors", errors),
            ("pending", [[rid, wire_body] for _, rid, _, wire_body in lines]),
        ):
            if rows:
                pipe.rpush(self._batch_key(batch_id, part), *map(orjson.dumps, rows))
        for part in ("", "lines", "errors", "pending"):
            pipe.pexpire(self._batch_key(batch_id, part), ttl)
        pipe.zadd(self._index_key(request), {batch_id: now})
        pipe.pexpire(self._index_key(request), ttl)
        if lines:
            pipe.sadd(self._holding_key(), batch_id)
        await pipe.execute()
        if lines:
            batch = await self._refresh(request, batch_id, batch)  # its first lines go in now
        return json_response(batch)

    async def _read_lines(
        self, request: web.Request, batch_id: str, content: bytes, endpoint: str
    ) -> tuple[list[tuple[str, str, str, dict]], list[dict]]:
        """Each valid line as (custom_id, redis id, model, wire body), and the lines refused, with why.
        Nothing is queued here: limits hold lines back, never fail them (see _advance)."""
        lines: list[tuple[str, str, str, dict]] = []
        errors: list[dict] = []
        seen: set[str] = set()
        tpm = self.client.limits.tenant_tokens_per_minute
        for n, raw in enumerate(content.splitlines(), 1):
            if not raw.strip():
                continue
            custom_id = None
            try:
                line = orjson.loads(raw)
                if not isinstance(line, dict):
                    raise ApiError(400, "line: must be a JSON object", "line")
                custom_id = line.get("custom_id")
                if not isinstance(custom_id, str) or not custom_id or custom_id in seen:
                    raise ApiError(400, "custom_id: required, a string unique in the file", "custom_id")
                seen.add(custom_id)
                if line.get("method", "POST") != "POST" or line.get("url") != endpoint:
                    raise ApiError(
                        400, f"url: every line must POST to the batch's endpoint {endpoint}", "url"
                    )
                if not isinstance(line.get("body"), dict):
                    raise ApiError(400, "body: must be an object", "body")
                reject_deep(line["body"])
                body, req = translate(self.gateway, {**line["body"], "stream": False}, ENDPOINTS[endpoint])
                if req.n != 1:  # a line's result is one wire request's
                    raise ApiError(400, "n: a batch line takes n = 1 (send n lines)", "n")
                await self.gateway.check_model(body.model)
                rid = self.gateway.redis_id(request, f"{batch_id}-{n}")
                self.gateway.check_priority(request, body)
                body.priority = min(wire.MAX_PRIORITY, body.priority + BATCH_PRIORITY)
                body.tenant = request.get(TENANT_KEY) or body.tenant
                tokens = await self.gateway.tokens_asked(body)
                if tpm and tokens > tpm:  # no minute would ever admit it: refused now, not held forever
                    raise QuotaExceeded("tenant_tokens_per_minute", 60)
                held = {"body": body.to_json().decode(), "tokens": tokens}
                lines.append((custom_id, rid, body.model or "", held))
            except (orjson.JSONDecodeError, ApiError, QuotaExceeded) as e:
                code = getattr(e, "code", None) or "invalid_request"
                message = e.message if isinstance(e, ApiError) else str(e)
                param = getattr(e, "param", None) or getattr(e, "limit", None)
                error = {"code": code, "message": f"line {n}: {message}", "param": param}
                errors.append({"custom_id": custom_id, "line": n, "error": error})
        return lines, errors

    async def _state(self, request: web.Request, batch_id: str) -> tuple[dict, dict]:
        """The batch object and its counters: the hash alone, whatever the batch's size."""
        raw = await self.r.hgetall(self._batch_key(batch_id))
        if not raw or (raw.get("tenant") or None) != request.get(TENANT_KEY):
            raise ApiError(404, f"batch_id: no batch {batch_id!r}", "batch_id", code="not_found")
        return orjson.loads(raw["batch"]), {k: int(raw.get(k, 0)) for k in ("completed", "failed")}

    async def _save(self, batch: dict) -> None:
        await self.r.hset(self._batch_key(batch["id"]), "batch", orjson.dumps(batch))

    async def _refresh(self, request: web.Request, batch_id: str, batch: dict | None = None) -> dict:
        """The batch with its counts, after advancing it by a bounded step; the output files once every line
        has ended."""
        if batch is None:
            batch, _ = await self._state(request, batch_id)
        if batch["status"] not in LIVE:
            return batch
        lock = self._batch_key(batch_id, "advancing")
        if await self.r.set(lock, "1", nx=True, ex=60):  # else another API is advancing it now
            try:
                if batch["status"] == "in_progress" and time.time() > batch["expires_at"]:
                    batch["status"], batch["expired_at"] = "cancelling", int(time.time())
                    await self._save(batch)
                    await self._cancel_lines(batch_id)
                left = await self._advance(batch_id, fill=batch["status"] == "in_progress")
                batch, counts = await self._state(request, batch_id)
                batch["request_counts"] |= counts
                if left == 0:
                    await self._finalize(request, batch)
                await self._save(batch)
            finally:
                await self.r.delete(lock)
        else:
            batch, counts = await self._state(request, batch_id)
            batch["request_counts"] |= counts
        return batch

    async def _advance(self, batch_id: str, fill: bool) -> int:
        """Queue held-back lines while the limits take them, and count up to ADVANCE_LINES queued lines
        that have ended; the lines still pending or open. Runs under the batch's `advancing` lock."""
        pending, open_ = self._batch_key(batch_id, "pending"), self._batch_key(batch_id, "open")
        ttl = self.client.ttl_ms
        if fill:
            queued: list[str] = []
            for raw in await self.r.lrange(pending, 0, ADVANCE_LINES - 1):
                rid, held = orjson.loads(raw)
                body = wire.parse_body(orjson.loads(held["body"]))
                try:
                    await self.client.enqueue(body, rid, tenant=body.tenant, tokens=held["tokens"])
                except QuotaExceeded:
                    break  # full for now: the rest wait for room, in order
                queued.append(rid)
            if queued:  # a crash before this leaves them pending: queued again by id, nothing is added twice
                pipe = self.r.pipeline(transaction=True)
                pipe.lpop(pending, len(queued))
                pipe.rpush(open_, *queued)
                pipe.pexpire(open_, ttl)
                await pipe.execute()
        rids = await self.r.lrange(open_, 0, ADVANCE_LINES - 1)
        if rids:
            pipe = self.r.pipeline(transaction=False)
            for rid in rids:
                pipe.hget(self.keys.of_request(rid).req(rid), "status")
            statuses = await pipe.execute()
            ended = [(rid, s) for rid, s in zip(rids, statuses) if s in wire.TERMINAL or s is None]
            still = [rid for rid, s in zip(rids, statuses) if not (s in wire.TERMINAL or s is None)]
            done = sum(s == wire.FINISHED for _, s in ended)
            pipe = self.r.pipeline(transaction=True)
            pipe.ltrim(open_, len(rids), -1)  # the looked-at ones leave the head; the unended go to the tail
            if still:
                pipe.rpush(open_, *still)
            pipe.hincrby(self._batch_key(batch_id), "completed", done)
            pipe.hincrby(self._batch_key(batch_id), "failed", len(ended) - done)
            await pipe.execute()
        pipe = self.r.pipeline(transaction=False)
        pipe.llen(pending)
        pipe.llen(open_)
        held, running = await pipe.execute()
        return held + running

    async def fill_held(self) -> None:
        """Queue the held-back lines of every holding batch while the limits take them (a bounded step each,
        as a read does), so they go in as capacity frees whether or not their client polls. A batch leaves
        the set once nothing of it is held back, or once it is no longer in progress (a cancel ends its held
        lines). Under each batch's `advancing` lock, as a read: one API at a time advances a batch."""
        holding = self._holding_key()
        for batch_id in await self.r.smembers(holding):
            raw = await self.r.hget(self._batch_key(batch_id), "batch")
            if raw is None or orjson.loads(raw)["status"] != "in_progress":
                await self.r.srem(holding, batch_id)
                continue
            lock = self._batch_key(batch_id, "advancing")
            if not await self.r.set(lock, "1", nx=True, ex=60):
                continue  # another API (or a read) is advancing it now
            try:
                await self._advance(batch_id, fill=True)
                if not await self.r.llen(self._batch_key(batch_id, "pending")):
                    await self.r.srem(holding, batch_id)
            finally:
                await self.r.delete(lock)

    async def fill_forever(self) -> None:
        while True:
            try:
                await self.fill_held()
            except TRANSIENT_ERRORS as e:  # Redis away for now: the next round tries again
                log.debug("batch fill skipped: %r", e)
            except Exception:  # one bad round must not end the fill for every later batch
                log.exception("batch fill failed; trying again")
            await asyncio.sleep(FILL_EVERY_S)

    async def _finalize(self, request: web.Request, batch: dict) -> None:
        chat = ENDPOINTS[batch["endpoint"]]
        output, errors = [], []
        for raw in await self.r.lrange(self._batch_key(batch["id"], "lines"), 0, -1):
            custom_id, rid, model = orjson.loads(raw)
            result = await self.client.result(rid)
            line_id = "batch_req_" + uuid.uuid4().hex
            if result is not None and result.status == wire.FINISHED:
                created = int(result.info.get("created", "0")) // 1000
                body = completion_body(rid, created, model, chat, result)
                response = {"status_code": 200, "request_id": rid, "body": body}
                output.append({"id": line_id, "custom_id": custom_id, "response": response, "error": None})
            else:
                status = result.status if result is not None else "expired"
                message = (result.error if result is not None else None) or f"the request ended {status}"
                error = {"code": status, "message": message}
                errors.append({"id": line_id, "custom_id": custom_id, "response": None, "error": error})
        for raw in await self.r.lrange(self._batch_key(batch["id"], "errors"), 0, -1):
            e = orjson.loads(raw)
            line_id = "batch_req_" + uuid.uuid4().hex
            errors.append({"id": line_id, "custom_id": e["custom_id"], "response": None, "error": e["error"]})
        now = int(time.time())
        if output:
            meta = await self._put_file(
                request, _jsonl(output), f"{batch['id']}_output.jsonl", "batch_output"
            )
            batch["output_file_id"] = meta["id"]
        if errors:
            meta = await self._put_file(request, _jsonl(errors), f"{batch['id']}_error.jsonl", "batch_output")
            batch["error_file_id"] = meta["id"]
        batch["finalizing_at"] = batch["finalizing_at"] or now
        if batch["status"] == "cancelling":
            batch["status"], batch["cancelled_at"] = (
                ("expired", now) if batch["expired_at"] else ("cancelled", now)
            )
        else:
            batch["status"], batch["completed_at"] = "completed", now

    async def _cancel_lines(self, batch_id: str) -> None:
        """Lines still held back never go in (they end cancelled); queued ones are cancelled."""
        tenant = (await self.r.hget(self._batch_key(batch_id), "tenant")) or None
        held = await self.r.lrange(self._batch_key(batch_id, "pending"), 0, -1)
        if held:
            await self.r.delete(self._batch_key(batch_id, "pending"))
            await self.r.hincrby(self._batch_key(batch_id), "failed", len(held))
        for rid in await self.r.lrange(self._batch_key(batch_id, "open"), 0, -1):
            await self.client.cancel(rid, tenant)

    async def get_batch(self, request: web.Request) -> web.Response:
        return json_response(await self._refresh(request, request.match_info["id"]))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        batch_id = request.match_info["id"]
        batch, _ = await self._state(request, batch_id)
        if batch["status"] in LIVE and batch["status"] != "cancelling":
            batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
            await self._save(batch)
            await self._cancel_lines(batch_id)
        return json_response(await self._refresh(request, batch_id))

    async def list_batches(self, request: web.Request) -> web.Response:
        try:
            limit = min(100, max(1, int(request.query.get("limit", "20"))))
        except ValueError:
            raise ApiError(400, "limit: must be an integer", "limit") from None
        ids = await self.r.zrevrange(self._index_key(request), 0, -1)
        after = request.query.get("after")
        if after in ids:
            ids = ids[ids.index(after) + 1 :]
        data = []
        for batch_id in ids[: limit + 1]:
            raw = await self.r.hget(self._batch_key(batch_id), "batch")
            if raw:
                data.append(orjson.loads(raw))
        page = data[:limit]
        body = {"object": "list", "data": page, "has_more": len(data) > limit}
        body |= {"first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}
        return json_response(body)


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def add_routes(app: web.Application, gateway: Gateway, max_file_bytes: int) -> None:
    routes = BatchRoutes(gateway, max_file_bytes)
    app.router.add_post("/v1/files", routes.create_file)
    app.router.add_get("/v1/files", routes.list_files)
    app.router.add_get("/v1/files/{id}", routes.get_file)
    app.router.add_get("/v1/files/{id}/content", routes.file_content)
    app.router.add_delete("/v1/files/{id}", routes.delete_file)
    app.router.add_post("/v1/batches", routes.create_batch)
    app.router.add_get("/v1/batches", routes.list_batches)
    app.router.add_get("/v1/batches/{id}", routes.get_batch)
    app.router.add_post("/v1/batches/{id}/cancel", routes.cancel_batch)
    filling: list[asyncio.Task] = []

    async def start_filling(_app: web.Application) -> None:
        filling.append(asyncio.create_task(routes.fill_forever(), name="batch-fill"))

    async def stop_filling(_app: web.Application) -> None:
        await stop_tasks(filling)

    app.on_startup.append(start_filling)
    app.on_cleanup.append(stop_filling)
