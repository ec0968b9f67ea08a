"""Validation cost per request on the server's path: JSON decode + request model (pydantic) + the endpoint's own
checks, for a typical chat and completions body. Run from the repository root:

    python bench/request_validation.py
"""

from __future__ import annotations

import json
import time
import timeit

from jaxserve.server.chat import check_chat_request
from jaxserve.server.completions import check_completion_request
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request

CHAT = json.dumps({"model": "m", "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                              {"role": "user", "content": "Write a haiku about JAX and XLA."}],
                   "temperature": 0.7, "top_p": 0.9, "max_completion_tokens": 128, "stream": True,
                   "stream_options": {"include_usage": True}, "stop": ["\n\n"], "seed": 42}).encode()
COMPLETION = json.dumps({"model": "m", "prompt": "Once upon a time, in a land far away,", "max_tokens": 64,
                         "temperature": 0.8, "top_k": 40, "logprobs": 2, "echo": False, "n": 2,
                         "logit_bias": {"50256": -100}}).encode()


def chat() -> None:
    check_chat_request(parse_request(ChatCompletionRequest, json.loads(CHAT)))


def completion() -> None:
    check_completion_request(parse_request(CompletionRequest, json.loads(COMPLETION)))


def main(number: int = 10_000) -> None:
    for name, request in (("chat", chat), ("completions", completion)):
        best = min(timeit.repeat(request, number=number, repeat=7, timer=time.process_time))
        print(f"{name}: {best / number * 1e6:.1f} us/request (CPU time, best of 7 x {number})")


if __name__ == "__main__":
    main()
