"""`jaxserve serve`: load a checkpoint, compile its step shapes, serve the OpenAI-compatible API with uvicorn.

Flags: --model, then one per ServerConfig field and one per EngineConfig field (jaxserve.cli_args), so the help
lists exactly what the dataclasses hold.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from jaxserve.cli_args import add_config_flags, add_engine_flags, config_from_args, engine_config_from_args
from jaxserve.config import ConfigError, env_str, sampling_defaults
from jaxserve.logs import configure_logging
from jaxserve.server.config import ServerConfig

DEFAULT_MODEL = "checkpoints/demo"
API_KEY_ENV = "JAXSERVE_API_KEY"
RUNTIME_LORA_ENV = ("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")

log = logging.getLogger("jaxserve.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="DIR",
                        help=f"a jaxserve checkpoint (from `jaxserve convert`) (default: {DEFAULT_MODEL}, the "
                             f"bundled demo model)")
    server = parser.add_argument_group("server")
    server.add_argument("--api-key", action="append", metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize; repeat for "
                             f"several keys (default: ${API_KEY_ENV})")
    add_config_flags(server, ServerConfig, skip=("api_key",))
    add_engine_flags(parser.add_argument_group("engine"))


def server_config(args: argparse.Namespace) -> ServerConfig:
    keys = tuple(args.api_key or ()) or (env_str(API_KEY_ENV),)
    runtime_lora = args.allow_runtime_lora_updating or any(
        (env_str(name) or "").lower() in ("1", "true") for name in RUNTIME_LORA_ENV)
    return config_from_args(ServerConfig, args, api_key=tuple(key for key in keys if key) or None,
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
        configure_logging(config.log_level, config.log_format)
        directory = model_dir(args)
        check_server_config(config)
        engine_config = engine_config_from_args(args)
        defaults = sampling_defaults(directory, engine_config.generation_config)
        engine = start_engine(directory, engine_config, config)
    except (ConfigError, MemoryError, FileNotFoundError) as exc:
        print(f"jaxserve serve: error: {exc}", file=sys.stderr)
        return 1
    if engine is None:
        return 0  # a multi-host follower: it ran the leader's steps until the leader stopped
    try:
        status = serve(engine, config, args.model or DEFAULT_MODEL, defaults)
    finally:
        engine.stop()
    exit_now(status)


def exit_now(status: int) -> None:
    """Ends the process once serving is over, skipping the interpreter's teardown: destroying XLA's clients takes
    seconds, and a supervisor (or a rolling update) should see the exit as soon as draining ends."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def check_server_config(config: ServerConfig) -> None:
    """What can be checked before the model loads: the API keys file, the limits."""
    from jaxserve.server.middleware import ApiKeys
    ApiKeys(config.api_key, config.api_key_file)  # raises ConfigError if the file cannot be read
    if config.max_prompts_per_request < 1:
        raise ConfigError("--max-prompts-per-request must be at least 1")
    if config.engine_restart < 0:
        raise ConfigError("--engine-restart must be >= 0")


def start_engine(directory: Path, engine_config, config: ServerConfig):
    """An AsyncEngine, or a ReplicaRouter (the same interface) over --data-parallel-size replicas sharing the
    admission limit; None on a multi-host follower, after the leader stopped (jaxserve.engine.replicas)."""
    from jaxserve.engine.replicas import start_async_engine
    return start_async_engine(directory, engine_config, config.max_queued_requests,
                              max_restarts=config.engine_restart, step_timeout=config.engine_step_timeout or None)


def uvicorn_config(app, config: ServerConfig):
    """uvicorn's settings for the app: connection timeouts from `config`, a short grace after draining."""
    import uvicorn

    from jaxserve.server.lifecycle import timed_protocol
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, log_config=None,
                          access_log=False, lifespan="off", http=timed_protocol(config.header_timeout),
                          timeout_keep_alive=config.timeout_keep_alive, timeout_graceful_shutdown=1)


def serve(engine, config: ServerConfig, model_path: str, sampling_defaults: dict | None = None) -> int:
    """Serves until a signal (exit status 0 after draining) or until the engine stops for good (1)."""
    from jaxserve.server.app import build_app
    from jaxserve.server.lifecycle import DrainingServer
    from jaxserve.server.state import ServerState
    state = ServerState.build(engine, config, model_path, sampling_defaults)
    if not config.access_log:
        logging.getLogger("jaxserve.access").setLevel(logging.WARNING)
    log.info("serving %s as %s on http://%s:%d", model_path, state.model_name, config.host, config.port)
    if state.sampling_defaults:
        log.info("default sampling from generation_config.json: %s (--generation-config vllm ignores it)",
                 state.sampling_defaults)
    server = DrainingServer(uvicorn_config(build_app(state), config), state.lifecycle, config.drain_timeout)
    engine.add_fatal_listener(server.engine_stopped)
    server.run()
    return server.exit_code
