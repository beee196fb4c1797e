"""/v1/completions: one prompt in (a string or token ids), its text out, OpenAI's legacy shape."""

from __future__ import annotations

from specserve.service.openai.serving import OpenAIServing


class Completions(OpenAIServing):
    chat = False
