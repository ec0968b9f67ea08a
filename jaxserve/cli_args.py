"""Command-line flags generated from frozen config dataclasses, so a new config field is a new flag with no other edit.

    add_engine_flags(parser)                      every EngineConfig field: --max-num-seqs N, ...
    engine_config_from_args(args)                 EngineConfig(max_num_seqs=N, ...)
    add_config_flags(parser, AnyConfig)           the same for any frozen config dataclass
    config_from_args(AnyConfig, args)

A field's flag is its name with dashes; its help text is the comment after the field in the class body (or an
entry of ENGINE_FLAG_HELP where EngineConfig has none), plus the default unless the text states it. Types follow the annotations: bool (a --flag/--no-flag pair), int, float, str, optional forms of those,
and tuple[int, ...] (comma-separated: --decode-buckets 1,2,4,8).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import tokenize
import types
import typing
from typing import Any, Callable


# Help for EngineConfig fields whose comment is missing or says too little for a --help line. A field with neither
# fails tests/test_server_units.py, so a new engine option cannot ship without help.
ENGINE_FLAG_HELP = {
    "max_num_seqs": "most sequences in one step's batch",
    "max_num_batched_tokens": "token budget of one step (prompt chunks and decode tokens together)",
    "page_size": "tokens per KV-cache page",
    "kv_cache_fraction": "fraction of the device memory free after the weights for the KV cache and the step "
                         "executables' measured temporaries, when --kv-cache-memory is not given",
    "kv_cache_memory": "bytes for the KV cache itself (default: what --kv-cache-fraction leaves after the "
                       "step temporaries)",
    "enable_prefix_caching": "reuse the KV pages of prompt prefixes seen before",
    "decode_buckets": "decode batch-size ladder (default: powers of two up to --max-num-seqs)",
    "prefill_token_buckets": "prefill token-count ladder (default: powers of four from 16 up to "
                             "--max-num-batched-tokens; with the CPU attention kernel powers of two from 64)",
    "prefill_seq_buckets": "prefill sequence-count ladder, each S paired with every token bucket T >= S (default: "
                           "one S = min(T, --max-num-seqs) per token bucket)",
    "context_buckets": "context-length ladder in tokens, rounded to pages (default: powers of four from 16 pages "
                       "up to --max-model-len; one rung with Pallas attention)",
    "compilation_cache_dir": "JAX's persistent compilation cache; \"\" disables it (default: $JAXSERVE_CACHE_DIR, "
                             "else ~/.cache/jaxserve/xla)",
    "xla_optimization_level": "XLA backend optimisation level (default: XLA's; tests use 0 to compile fast)",
    "decode_burst": "decode steps run back to back in one executable call (a decode burst) while every running "
                    "sequence decodes, nothing waits, none has a grammar and at most --decode-burst-max-batch run: "
                    "the host's work is paid once per call; tokens then stream that many at a time (1: off; "
                    "default: 8 with the CPU kernels, else 1; off with speculative decoding and across hosts)",
    "seed": "seed of the per-request seeds given to requests that bring none",
    "tensor_parallel_size": "devices to shard the model over (tensor parallelism)",
    "data_parallel_size": "model replicas (data parallelism)",
    "generation_config": "where the default sampling of requests that leave a field unset comes from, as vLLM's "
                         "flag: auto (the default): the model's generation_config.json (its temperature, top_p, "
                         "top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens); vllm: jaxserve's "
                         "built-in defaults (temperature 1, top_p 1, ...); or a folder holding a "
                         "generation_config.json",
}


def add_engine_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    from jaxserve.config import EngineConfig
    add_config_flags(parser, EngineConfig, help_overrides=ENGINE_FLAG_HELP)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any):
    from jaxserve.config import EngineConfig
    return config_from_args(EngineConfig, args, **overrides)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_class: type, *,
                     skip: tuple[str, ...] = (), help_overrides: dict[str, str] | None = None) -> None:
    """One flag per dataclass field (except those in `skip`). Defaults come from the dataclass."""
    hints = typing.get_type_hints(config_class)
    comments = field_comments(config_class)
    overrides = help_overrides or {}
    for field in dataclasses.fields(config_class):
        if field.name in skip:
            continue
        help_text = overrides.get(field.name, comments.get(field.name, ""))
        _add_field_flag(parser, field, hints[field.name], help_text)


def config_from_args(config_class: type, args: argparse.Namespace, **overrides: Any):
    """The dataclass with every field that has a flag in `args` set from it; `overrides` win."""
    names = {f.name for f in dataclasses.fields(config_class)}
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}  # nargs flags
    return config_class(**{**values, **overrides})


def _add_field_flag(parser, field: dataclasses.Field, annotation: Any, help_text: str) -> None:
    default = _field_default(field)
    base = _base_type(annotation)
    if "default" not in help_text:
        help_text = f"{help_text} (default: {_format_default(default)})".strip()
    help_text = help_text.replace("%", "%%")
    if base is bool:
        parser.add_argument(flag_name(field.name), dest=field.name, default=default,
                            action=argparse.BooleanOptionalAction, help=help_text)
        return
    if field.metadata.get("nargs"):  # a list of words, space-separated as vLLM's --lora-modules a=DIR b=DIR
        parser.add_argument(flag_name(field.name), dest=field.name, default=default, nargs=field.metadata["nargs"],
                            metavar=field.metadata.get("metavar", field.name.upper()), help=help_text)
        return
    parser.add_argument(flag_name(field.name), dest=field.name, default=default, type=_parser_for(base),
                        metavar=_metavar(field.name, base), help=help_text)


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `tuple[int, ...] | None` -> tuple[int, ...]."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        raise TypeError(f"cannot make a flag for the union {annotation}")
    return annotation


def _parser_for(base: Any) -> Callable[[str], Any]:
    if typing.get_origin(base) is tuple:
        item = typing.get_args(base)[0]
        return lambda text: _comma_list(text, item)
    if base in (int, float, str):
        return base
    raise TypeError(f"cannot make a flag for type {base}")


def _comma_list(text: str, item_type: type) -> tuple:
    try:
        return tuple(item_type(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {item_type.__name__}s, got {text!r}") from None


def _metavar(name: str, base: Any) -> str:
    if typing.get_origin(base) is tuple:
        return "N,N,..." if typing.get_args(base)[0] is int else "NAME,NAME,..."
    return {int: "N", float: "X"}.get(base, name.upper())


def _format_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if value == "":
        return '""'
    return str(value)


def field_comments(config_class: type) -> dict[str, str]:
    """The `# comment` after each field in the class body: `name: type = default  # comment` -> {name: comment}."""
    try:
        source = inspect.getsource(config_class)
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    line_field: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.start[1] == 4 and token.start[0] not in line_field:
            line_field[token.start[0]] = token.string
        elif token.type == tokenize.COMMENT and token.start[0] in line_field:
            comments[line_field[token.start[0]]] = token.string.lstrip("#").strip()
    return comments
