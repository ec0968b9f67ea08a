"""The OpenAI-compatible HTTP server (Starlette on uvicorn). Thin: validate, tokenize, admit, stream.

    command.py     `jaxserve serve` flags and start-up          app.py        routes, error handlers, middleware
    protocol.py    pydantic request/response models            (bounds: jaxserve.validation's ranges)
    completions.py /v1/completions                              chat.py       /v1/chat/completions
    generation.py  request -> engine streams (429/503/400)     responses.py  engine outputs -> JSON or SSE
    streaming.py   SSE framing, stream merging, disconnects    logprobs.py   the two OpenAI logprob shapes
    middleware.py  request id, access log, auth, body limit    lifecycle.py  draining on SIGTERM
    metrics.py     Prometheus registry per server              openapi.py    /openapi.json
    dashboard.py   /dashboard (dashboard.html) and its JSON     models.py     /v1/models[/{id}], /tokenizer_info
    state.py       ServerState: what handlers share            errors.py     OpenAI-shaped errors
"""
