"""`jaxserve generate`: offline generation from the command line, streamed to stdout."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from jaxserve.cli_args import add_config_flags, config_from_args
from jaxserve.config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutputsParams
from jaxserve.validation import validate_sampling_params

DEMO_MODEL = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "ignore_eos", "n", "min_tokens", "logprobs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(DEMO_MODEL),
                        help="a converted jaxserve checkpoint (default: the bundled demo model)")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text; repeat for several prompts, '-' reads one from stdin")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    structured = parser.add_argument_group("structured output (one of)")
    structured.add_argument("--json-schema", metavar="FILE",
                            help="a JSON Schema file: each output is JSON valid against it")
    structured.add_argument("--json-object", action="store_true", help="each output is a JSON object")
    structured.add_argument("--regex", help="each output matches this regular expression")
    structured.add_argument("--choice", action="append", help="each output is one of these strings; repeat")
    structured.add_argument("--grammar", metavar="FILE", help="a Lark or GBNF grammar file the outputs follow")
    parser.add_argument("--lora", metavar="NAME", default=None,
                        help="run every prompt with this LoRA adapter (a --lora-modules name; with --enable-lora)")
    sampling = parser.add_argument_group("sampling")
    add_config_flags(sampling, SamplingParams, skip=tuple(f for f in SamplingParams.__dataclass_fields__
                                                          if f not in SAMPLING_FLAGS))
    engine = parser.add_argument_group("engine")
    add_config_flags(engine, EngineConfig, skip=("seed",))  # --seed is the sampling seed here


def run(args: argparse.Namespace) -> int:
    from jaxserve.engine.llm import LLM
    from jaxserve.engine.multihost import follow_if_follower
    if not (Path(args.model) / "jaxserve.json").exists():
        print(f"error: {args.model} is not a jaxserve checkpoint; convert one with `jaxserve convert`", file=sys.stderr)
        return 1
    try:
        params = dataclasses.replace(config_from_args(SamplingParams, args), structured_outputs=_structured(args))
        validate_sampling_params(params)  # before loading the model; the prompts are checked when queued
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    llm = LLM(args.model, **_engine_options(args))
    steps = follow_if_follower(llm.engine.core)
    if steps is not None:  # a multi-host follower: it ran the leader's steps until the leader finished
        print(f"multi-host follower: ran the leader's {steps} steps", file=sys.stderr)
        return 0
    try:
        return _generate(llm, args, params)
    finally:
        llm.engine.close()  # multi-host leader: releases the followers


def _generate(llm, args: argparse.Namespace, params: SamplingParams) -> int:
    from jaxserve.lora import LoRARequest
    adapter = LoRARequest(args.lora) if args.lora else None
    prompts = [sys.stdin.read() if p == "-" else p for p in args.prompt]
    if args.chat:
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    if args.json or len(prompts) > 1 or params.n > 1:
        for output in llm.generate(prompts, params, lora_request=adapter):
            print(json.dumps({"prompt": output.prompt, "outputs": [
                {"text": o.text, "token_ids": list(o.token_ids), "finish_reason": o.finish_reason}
                for o in output.outputs]}))
        return 0
    for output in llm.generate_stream(prompts, params, lora_request=adapter):
        sys.stdout.write("".join(o.text for o in output.outputs))  # deltas; one sample here
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _structured(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The constraint the flags ask for (None: none). ValueError for an unreadable file."""
    given = {}
    if args.json_schema:
        try:
            given["json"] = json.loads(Path(args.json_schema).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--json-schema {args.json_schema}: {exc}") from None
    if args.json_object:
        given["json_object"] = True
    if args.regex:
        given["regex"] = args.regex
    if args.choice:
        given["choice"] = tuple(args.choice)
    if args.grammar:
        try:
            given["grammar"] = Path(args.grammar).read_text()
        except OSError as exc:
            raise ValueError(f"--grammar {args.grammar}: {exc}") from None
    return StructuredOutputsParams(**given) if given else None


def _engine_options(args) -> dict:
    return {k: v for k, v in vars(config_from_args(EngineConfig, args)).items()
            if v != EngineConfig.__dataclass_fields__[k].default}
