"""`jaxserve serve`: load a checkpoint, compile its step shapes, serve the OpenAI-compatible API with uvicorn.

Flags: --model, then one per ServerConfig field and one per EngineConfig field (jaxserve.cli_args), so the help
lists exactly what the dataclasses hold.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from jaxserve.cli_args import add_config_flags, add_engine_flags, config_from_args, engine_config_from_args
from jaxserve.config import ConfigError, env_str, sampling_defaults
from jaxserve.server.config import ServerConfig

DEFAULT_MODEL = "checkpoints/demo"
API_KEY_ENV = "JAXSERVE_API_KEY"
RUNTIME_LORA_ENV = ("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

log = logging.getLogger("jaxserve.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="DIR",
                        help=f"a jaxserve checkpoint (from `jaxserve convert`) (default: {DEFAULT_MODEL}, the "
                             f"bundled demo model)")
    add_config_flags(parser.add_argument_group("server"), ServerConfig)
    add_engine_flags(parser.add_argument_group("engine"))


def server_config(args: argparse.Namespace) -> ServerConfig:
    runtime_lora = args.allow_runtime_lora_updating or any(
        (env_str(name) or "").lower() in ("1", "true") for name in RUNTIME_LORA_ENV)
    return config_from_args(ServerConfig, args, api_key=args.api_key or env_str(API_KEY_ENV) or None,
                            allow_runtime_lora_updating=runtime_lora)


def model_dir(args: argparse.Namespace) -> Path:
    """The checkpoint to serve; a missing directory is a user error with a way out."""
    path = Path(args.model or DEFAULT_MODEL)
    if path.is_dir():
        return path
    if args.model is None:
        raise ConfigError(f"no --model given and the bundled demo model {DEFAULT_MODEL} does not exist here "
                          f"(see checkpoints/README.md to build it), or serve your own: convert a Hugging Face "
                          f"model with `jaxserve convert HF_DIR OUT_DIR`, then `jaxserve serve --model OUT_DIR`")
    raise ConfigError(f"--model {args.model}: no such directory")


def run(args: argparse.Namespace) -> int:
    config = server_config(args)
    try:
        if config.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {config.log_level!r}")
        directory = model_dir(args)
        logging.basicConfig(level=config.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        engine_config = engine_config_from_args(args)
        defaults = sampling_defaults(directory, engine_config.generation_config)
        engine = start_engine(directory, engine_config, config)
    except (ConfigError, MemoryError, FileNotFoundError) as exc:
        print(f"jaxserve serve: error: {exc}", file=sys.stderr)
        return 1
    if engine is None:
        return 0  # a multi-host follower: it ran the leader's steps until the leader stopped
    try:
        serve(engine, config, args.model or DEFAULT_MODEL, defaults)
    finally:
        engine.stop()
    return 0


def start_engine(directory: Path, engine_config, config: ServerConfig):
    """An AsyncEngine, or a ReplicaRouter (the same interface) over --data-parallel-size replicas sharing the
    admission limit; None on a multi-host follower, after the leader stopped (jaxserve.engine.replicas)."""
    from jaxserve.engine.replicas import start_async_engine
    return start_async_engine(directory, engine_config, config.max_queued_requests)


def serve(engine, config: ServerConfig, model_path: str, sampling_defaults: dict | None = None) -> None:
    import uvicorn

    from jaxserve.server.app import build_app
    from jaxserve.server.lifecycle import DrainingServer
    from jaxserve.server.state import ServerState
    state = ServerState.build(engine, config, model_path, sampling_defaults)
    uvicorn_config = uvicorn.Config(build_app(state), host=config.host, port=config.port,
                                    log_level=config.log_level, access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=5)
    if not config.access_log:
        logging.getLogger("jaxserve.access").setLevel(logging.WARNING)
    log.info("serving %s as %s on http://%s:%d", model_path, state.model_name, config.host, config.port)
    if state.sampling_defaults:
        log.info("default sampling from generation_config.json: %s (--generation-config vllm ignores it)",
                 state.sampling_defaults)
    DrainingServer(uvicorn_config, state.lifecycle, config.drain_timeout).run()
