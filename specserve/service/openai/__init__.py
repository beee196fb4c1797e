"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions (streaming and not), /v1/models.

protocol.py     the fields each route accepts; translate(): a request body as the wire's and an
                OpenAIRequest, what its answer needs
responses.py    response shapes: whole answers, streamed chunks, logprobs, usage, errors
serving.py      what the generating routes share: fan-out of n choices, answer once or stream
completions.py  /v1/completions
chat.py         /v1/chat/completions, tool calls included
models.py       /v1/models
tool_calls.py   tools, tool_choice and the tool calls read out of a choice's text
routes.py       add_routes(): the routes on an app
"""
