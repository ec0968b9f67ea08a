"""POST /v1/chat/completions: the model's chat template (from its tokenizer config) turns messages into a prompt.

Messages: content is a string, null (read as ""), or a list of text parts (joined); other part types are 400s.
An assistant message's tool_calls reach the template with their arguments as objects; `role: "tool"` messages
carry results back. Streaming: a first chunk per choice carries the role, then content deltas, then a chunk with
an empty delta and the finish_reason (OpenAI's order). Logprobs use the chat shape (logprobs.content[]).

Output constraints: response_format / structured_outputs / guided_* (jaxserve.server.constraints). Tools
(jaxserve.structured.tools): tool_choice "required" or a named function constrain the output with the tools'
JSON Schemas; "auto" parses the model family's tool-call syntax. Either way calls come back as
message.tool_calls (streamed: delta.tool_calls) with finish_reason "tool_calls".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.constraints import field_names, structured_outputs
from jaxserve.server.errors import bad_request
from jaxserve.server.generation import Prompt, check_model, read_json, run_tokenizer, sampling_params, submit
from jaxserve.server.logprobs import chat_logprobs
from jaxserve.server.protocol import ChatCompletionRequest, parse_request
from jaxserve.server.responses import ResponseView, respond
from jaxserve.server.state import ServerState, server_of
from jaxserve.structured import StructuredOutputsParams
from jaxserve.structured.tools import (PARSERS, ToolCall, ToolCallStream, ToolError, ToolPlan, calls_from_required,
                                       parser_for, plan_tools)
from jaxserve.tokenizer import ChatTemplateError

RESERVED_TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


async def create_chat_completion(request: Request) -> Response:
    server = server_of(request)
    body = parse_request(ChatCompletionRequest, await read_json(request))
    check_chat_request(body)
    adapter = check_model(server, body.model)
    tools = chat_tools(body)
    constraint, field = chat_constraint(body, tools)
    prompt = await run_tokenizer(chat_prompt, server, body)
    view = ChatView(server, body, [prompt], tools, tool_parser(server, tools))
    view.model_name = adapter or server.model_name
    params = chat_params(body, server.sampling_defaults, constraint, view.parser)
    streams = await submit(server, view.id, [prompt], params, body.stream,
                           lambda i: {"prompt": "messages", "max_tokens": body.max_tokens_field, **field_names(field)},
                           lora_name=adapter)
    return await respond(request, view, streams)


def check_chat_request(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options needs stream: true", param="stream_options")
    reserved = RESERVED_TEMPLATE_ARGUMENTS & set(body.chat_template_kwargs or {})
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                          param="chat_template_kwargs")


def chat_tools(body: ChatCompletionRequest) -> ToolPlan:
    try:
        return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def chat_constraint(body: ChatCompletionRequest, tools: ToolPlan) -> tuple[StructuredOutputsParams | None, str | None]:
    constraint, field = structured_outputs(body)
    if tools.constraint is None:
        return constraint, field
    if constraint is not None:
        raise bad_request(f"tool_choice {tools.mode} constrains the output already; drop {field}", param=field)
    return tools.constraint, "tool_choice"


def tool_parser(server: ServerState, tools: ToolPlan) -> str | None:
    """The tool-call syntax to parse for tool_choice auto (None: the model family has none we know)."""
    if tools.mode != "auto":
        return None
    return parser_for(server.engine.info.model_config.family, server.config.tool_call_parser)


def chat_prompt(server: ServerState, body: ChatCompletionRequest) -> Prompt:
    messages = [template_message(message.template_input()) for message in body.messages]
    try:
        ids = server.tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt,
                                           tools=body.tools, **(body.chat_template_kwargs or {}))
    except ChatTemplateError as exc:  # NoChatTemplateError included
        raise bad_request(f"the chat template cannot format these messages: {exc}", param="messages") from None
    return Prompt(ids, "")


def template_message(message: dict) -> dict:
    """Chat templates read a tool call's arguments as an object; OpenAI sends them as JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [_template_call(call) for call in calls]}


def _template_call(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def chat_params(body: ChatCompletionRequest, defaults: Mapping[str, Any] | None = None,
                constraint: StructuredOutputsParams | None = None, parser: str | None = None) -> SamplingParams:
    params = sampling_params(body, max_tokens=body.max_new_tokens,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None, defaults=defaults,
                             structured_outputs=constraint)
    if parser == "mistral" and params.skip_special_tokens:  # [TOOL_CALLS] is a special token
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


class ChatView(ResponseView):
    object_name = "chat.completion"
    id_prefix = "chatcmpl"

    def __init__(self, server: ServerState, body: ChatCompletionRequest, prompts: list[Prompt],
                 tools: ToolPlan = ToolPlan("none"), parser: str | None = None):
        super().__init__(server, body, prompts)
        self.tools = tools
        self.parser = parser
        self._streams: dict[int, ToolCallStream] = {}  # choice -> auto parsing state
        self._named_calls: dict[int, ToolCall] = {}  # choice -> the named call being streamed
        self._held: dict[int, str] = {}  # choice -> its output so far (tool_choice required: parsed at the end)

    # ---- whole responses ------------------------------------------------------------------------------------
    def choice(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput) -> dict:
        content, calls = self.tool_calls(sample.text, sample.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return {"index": self.index(prompt_index, sample), "message": message,
                "logprobs": self._logprobs(sample, sample.logprobs),
                "finish_reason": finish_reason(sample.finish_reason, calls), "stop_reason": sample.stop_reason}

    def tool_calls(self, text: str, finish: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output. Constrained calls cut short by max_tokens stay content."""
        mode = self.tools.mode
        if mode == "named" and finish == "stop":
            return None, [ToolCall(self.tools.function, text)]
        if mode == "required" and finish == "stop":
            calls = calls_from_required(text)
            return (None, calls) if calls else (text, [])
        if mode == "auto" and self.parser is not None:
            content, calls = PARSERS[self.parser](text)
            return (content or None, calls) if calls else (text, [])
        return text, []

    # ---- streaming ------------------------------------------------------------------------------------------
    def opening_choices(self) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.body.n)]

    def delta_choices(self, prompt_index: int, output: RequestOutput, sample: CompletionOutput) -> list[dict]:
        index = self.index(prompt_index, sample)
        delta, calls = self._stream_delta(index, sample)
        choices = []
        if delta or sample.logprobs:
            choices.append({"index": index, "delta": delta or {"content": ""},
                            "logprobs": self._logprobs(sample, sample.logprobs), "finish_reason": None})
        if sample.finished:
            choices.append({"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": finish_reason(sample.finish_reason, calls),
                            "stop_reason": sample.stop_reason})
        return choices

    def _stream_delta(self, index: int, sample: CompletionOutput) -> tuple[dict, list]:
        """The chunk's delta for what `sample` gained, and (on its last chunk) the calls it made."""
        mode = self.tools.mode
        if mode == "named":
            return self._named_delta(index, sample)
        if mode == "required":
            self._held[index] = self._held.get(index, "") + sample.text
            if not sample.finished:
                return {}, []
            content, calls = self.tool_calls(self._held.pop(index), sample.finish_reason)
            return (_calls_delta(calls) if calls else {"content": content}), calls
        if mode == "auto" and self.parser is not None:
            stream = self._streams.setdefault(index, ToolCallStream(self.parser))
            content = stream.feed(sample.text)
            if not sample.finished:
                return ({"content": content} if content else {}), []
            rest, calls = stream.finish()
            delta = {"content": content + rest} if content + rest else {}
            return ({**delta, **_calls_delta(calls)} if calls else delta), calls
        return ({"content": sample.text} if sample.text else {}), []

    def _named_delta(self, index: int, sample: CompletionOutput) -> tuple[dict, list]:
        """The named function's call streams as it is generated: its name first, then argument fragments."""
        call = self._named_calls.get(index)
        if call is None and (sample.text or sample.finished):
            call = self._named_calls[index] = ToolCall(self.tools.function, "")
            delta = {"tool_calls": [{**call.as_openai(0), "function": {"name": call.name,
                                                                         "arguments": sample.text}}]}
        elif sample.text:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": sample.text}}]}
        else:
            delta = {}
        return delta, [call] if sample.finished and sample.finish_reason == "stop" else []

    def _logprobs(self, sample: CompletionOutput, entries) -> dict | None:
        if sample.logprobs is None:
            return None
        return chat_logprobs(entries, self.server.token_text)


def finish_reason(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _calls_delta(calls: list[ToolCall]) -> dict:
    return {"tool_calls": [call.as_openai(i) for i, call in enumerate(calls)]} if calls else {}
