"""The OpenAI-compatible routes on an app: each translates to the wire format and rides the same queue as
everything else."""

from __future__ import annotations

from aiohttp import web

from specserve.service.gateway import Gateway
from specserve.service.openai.chat import ChatCompletions
from specserve.service.openai.completions import Completions
from specserve.service.openai.models import Models


def add_routes(app: web.Application, gateway: Gateway) -> None:
    app.router.add_post("/v1/completions", Completions(gateway).handle)
    app.router.add_post("/v1/chat/completions", ChatCompletions(gateway).handle)
    app.router.add_get("/v1/models", Models(gateway).handle)
