"""The `jaxserve` command. Each subcommand lives in its own module with `add_arguments(parser)` and `run(args)`;
modules are imported only when their subcommand runs, so `jaxserve --help` is instant."""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "convert": ("jaxserve.convert.command", "import a Hugging Face checkpoint into jaxserve's format"),
    "generate": ("jaxserve.engine.command", "generate text offline from a prompt"),
    "serve": ("jaxserve.server.command", "serve a model over an OpenAI-compatible HTTP API"),
    "estimate": ("jaxserve.estimate", "memory and speed estimate for a model on a GPU, before loading anything"),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA serving runtime for open-weight LLMs.")
    parser.add_argument("--version", action="version", version=f"jaxserve {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == load:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SUBCOMMANDS:
        command = None
    args = build_parser(load=command).parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 2
    return importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0


def _version() -> str:
    from jaxserve import __version__
    return __version__


if __name__ == "__main__":
    sys.exit(main())
