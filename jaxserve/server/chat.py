"""POST /v1/chat/completions: the model's chat template (from its tokenizer config) turns messages into a prompt.

Messages: content is a string, null (read as ""), or a list of text parts (joined); other part types are 400s.
`tools` and `chat_template_kwargs` reach the template; tool calls in the output are not parsed, `tool_choice`
is ignored. Streaming: a first chunk per choice carries the role, then content deltas, then a chunk with an
empty delta and the finish_reason (OpenAI's order). Logprobs use the chat shape (logprobs.content[]).
"""

from __future__ import annotations

from typing import Any, Mapping

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.errors import bad_request
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.generation import Prompt, check_model, read_json, run_tokenizer, sampling_params, submit
from jaxserve.server.logprobs import chat_logprobs
from jaxserve.server.protocol import ChatCompletionRequest, parse_request
from jaxserve.server.responses import ResponseView, respond
from jaxserve.server.state import ServerState, server_of
from jaxserve.tokenizer import ChatTemplateError

RESERVED_TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


async def create_chat_completion(request: Request) -> Response:
    server = server_of(request)
    body = parse_request(ChatCompletionRequest, await read_json(request))
    check_chat_request(body)
    adapter = check_model(server, body.model)
    prompt = await run_tokenizer(chat_prompt, server, body)
    view = ChatView(server, body, [prompt])
    view.model_name = adapter or server.model_name
    params = chat_params(body, server.sampling_defaults)
    streams = await submit(server, view.id, [prompt], params, body.stream,
                           lambda i: {"prompt": "messages", "max_tokens": body.max_tokens_field}, lora_name=adapter)
    return await respond(request, view, streams)


def check_chat_request(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request("only response_format {\"type\": \"text\"} is supported", param="response_format")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options needs stream: true", param="stream_options")
    reserved = RESERVED_TEMPLATE_ARGUMENTS & set(body.chat_template_kwargs or {})
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                          param="chat_template_kwargs")


def chat_prompt(server: ServerState, body: ChatCompletionRequest) -> Prompt:
    messages = [message.template_input() for message in body.messages]
    try:
        ids = server.tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt,
                                           tools=body.tools, **(body.chat_template_kwargs or {}))
    except ChatTemplateError as exc:  # NoChatTemplateError included
        raise bad_request(f"the chat template cannot format these messages: {exc}", param="messages") from None
    return Prompt(ids, "")


def chat_params(body: ChatCompletionRequest, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    return sampling_params(body, max_tokens=body.max_new_tokens,
                           logprobs=(body.top_logprobs or 0) if body.logprobs else None, defaults=defaults)


class ChatView(ResponseView):
    object_name = "chat.completion"
    id_prefix = "chatcmpl"

    def choice(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput) -> dict:
        return {"index": self.index(prompt_index, sample),
                "message": {"role": "assistant", "content": sample.text},
                "logprobs": self._logprobs(sample, sample.logprobs),
                "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}

    def opening_choices(self) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.body.n)]

    def delta_choices(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput) -> list[dict]:
        index = self.index(prompt_index, sample)
        choices = []
        if sample.text or sample.logprobs:
            choices.append({"index": index, "delta": {"content": sample.text},
                            "logprobs": self._logprobs(sample, sample.logprobs), "finish_reason": None})
        if sample.finished:
            choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": sample.finish_reason,
                            "stop_reason": sample.stop_reason})
        return choices

    def _logprobs(self, sample: CompletionOutput, entries) -> dict | None:
        if sample.logprobs is None:
            return None
        return chat_logprobs(entries, self.server.token_text)
