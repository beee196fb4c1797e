"""OpenAI's Files and Batch APIs on the queue: /v1/files and /v1/batches.

A batch's lines become ordinary queued requests (ids `<batch id>-<line>`), so a worker crash mid-batch loses
nothing: its lines are reclaimed like any other request. The batch keeps no process state: its status,
counts and output are worked out from its lines' status hashes whenever it is read, and the first reader to
find every line ended writes the output and error files (under a lock, so two API pods cannot both do it).

Files live in Redis (a hash per file: its bytes and metadata), for as long as results do (the request TTL);
their size is capped (`SPECSERVE_MAX_FILE_BYTES`). Batch lines run in a band of their own, BATCH_PRIORITY
plus whatever priority a line gives, so interactive requests (priority 0 by default) go first
(queue/ready.py).
"""

from __future__ import annotations

import time
import uuid

import orjson
from aiohttp import web

from specserve.queue import wire
from specserve.queue.client import QuotaExceeded
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

    def _batch_key(self, batch_id: str) -> str:
        return self.keys.batch("batch", batch_id)

    def _index_key(self, request: web.Request) -> str:
        return self.keys.batch("batches", request.get(TENANT_KEY) or "-")

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
        lines, errors = await self._enqueue_lines(request, batch_id, content, endpoint)
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
        state = {"batch": batch, "lines": lines, "errors": errors, "tenant": request.get(TENANT_KEY) or ""}
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self._batch_key(batch_id), orjson.dumps(state), px=self.client.ttl_ms)
        pipe.zadd(self._index_key(request), {batch_id: now})
        pipe.pexpire(self._index_key(request), self.client.ttl_ms)
        await pipe.execute()
        return json_response(batch)

    async def _enqueue_lines(
        self, request: web.Request, batch_id: str, content: bytes, endpoint: str
    ) -> tuple[list[list[str]], list[dict]]:
        """Each valid line queued as an ordinary request; ([custom_id, redis id, model], ...) and the lines
        refused, with why."""
        lines: list[list[str]] = []
        errors: list[dict] = []
        seen: set[str] = set()
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
                await self.client.enqueue(body, rid, tenant=body.tenant)
                lines.append([custom_id, rid, body.model or ""])
            except (orjson.JSONDecodeError, ApiError, QuotaExceeded) as e:
                code = getattr(e, "code", None) or "invalid_request"
                message = e.message if isinstance(e, ApiError) else str(e)
                error = {"code": code, "message": f"line {n}: {message}", "param": getattr(e, "param", None)}
                errors.append({"custom_id": custom_id, "line": n, "error": error})
        return lines, errors

    async def _state(self, request: web.Request, batch_id: str) -> dict:
        raw = await self.r.get(self._batch_key(batch_id))
        state = orjson.loads(raw) if raw else None
        if state is None or (state["tenant"] or None) != request.get(TENANT_KEY):
            raise ApiError(404, f"batch_id: no batch {batch_id!r}", "batch_id", code="not_found")
        return state

    async def _save(self, state: dict) -> None:
        key = self._batch_key(state["batch"]["id"])
        await self.r.set(key, orjson.dumps(state), px=self.client.ttl_ms)

    async def _refresh(self, request: web.Request, state: dict) -> dict:
        """Counts from the lines' status hashes; the output files once every line has ended."""
        batch = state["batch"]
        if batch["status"] not in LIVE:
            return batch
        pipe = self.r.pipeline(transaction=False)
        for _, rid, _ in state["lines"]:
            pipe.hget(self.keys.req(rid), "status")
        statuses = await pipe.execute()
        done = sum(s == wire.FINISHED for s in statuses)
        ended = sum(s in wire.TERMINAL for s in statuses)
        batch["request_counts"]["completed"] = done
        batch["request_counts"]["failed"] = len(state["errors"]) + ended - done
        if batch["status"] == "in_progress" and time.time() > batch["expires_at"]:
            await self._cancel_lines(state)
            batch["status"], batch["expired_at"] = "cancelling", int(time.time())
        if ended < len(state["lines"]):
            return batch
        lock = self._batch_key(batch["id"]) + ":finalizing"
        if not await self.r.set(lock, "1", nx=True, ex=60):
            return batch  # another API is writing the files now
        try:
            await self._finalize(request, state)
            await self._save(state)
        finally:
            await self.r.delete(lock)
        return batch

    async def _finalize(self, request: web.Request, state: dict) -> None:
        batch = state["batch"]
        chat = ENDPOINTS[batch["endpoint"]]
        output, errors = [], []
        for custom_id, rid, model in state["lines"]:
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
        for e in state["errors"]:
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

    async def _cancel_lines(self, state: dict) -> None:
        for _, rid, _ in state["lines"]:
            await self.client.cancel(rid, state["tenant"] or None)

    async def get_batch(self, request: web.Request) -> web.Response:
        state = await self._state(request, request.match_info["id"])
        before = orjson.dumps(state["batch"])
        batch = await self._refresh(request, state)
        if orjson.dumps(batch) != before:
            await self._save(state)
        return json_response(batch)

    async def cancel_batch(self, request: web.Request) -> web.Response:
        state = await self._state(request, request.match_info["id"])
        batch = state["batch"]
        if batch["status"] in LIVE and batch["status"] != "cancelling":
            batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
            await self._save(state)
            await self._cancel_lines(state)
        return json_response(await self._refresh(request, state))

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
            raw = await self.r.get(self._batch_key(batch_id))
            if raw:
                data.append(orjson.loads(raw)["batch"])
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
