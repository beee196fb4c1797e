"""/v1/models: the models live workers advertise, and the ones configured here."""

from __future__ import annotations

from aiohttp import web

from specserve.service.gateway import Gateway
from specserve.service.http import json_response


class Models:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def handle(self, _request: web.Request) -> web.Response:
        models = await self.gateway.known_models()
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(info.get("seen", 0)),
                "owned_by": "specserve",
                **info,
            }
            for name, info in sorted(models.items())
        ]
        return json_response({"object": "list", "data": data})
