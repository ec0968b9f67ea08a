"""Log output of the commands: quiet by default, one line per event, readable by people or by log shippers.

    configure_logging(level, format)   jaxserve's and uvicorn's loggers at `level`; every other library (absl,
                                       orbax, jax, ...) at WARNING unless `level` is debug; lines as text or as
                                       one JSON object each (--log-format json)
    progress(items, description)       a tqdm bar on a terminal; elsewhere (systemd, Kubernetes, CI) a log
                                       line every PROGRESS_LOG_SECONDS and one at the end, never a carriage
                                       return
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from typing import Iterable, Iterator, TextIO, TypeVar

from jaxserve.config import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")
OWN_LOGGERS = ("jaxserve", "uvicorn")  # at --log-level; everything else at LIBRARY_LEVEL
LIBRARY_LEVEL = logging.WARNING
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
NOISY_LIBRARIES = ("absl", "orbax", "jax", "etils", "tensorstore", "httpx", "httpcore")
PROGRESS_LOG_SECONDS = 10.0

log = logging.getLogger("jaxserve.progress")
T = TypeVar("T")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                 .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def check_log_options(level: str, format: str) -> None:
    """ConfigError naming the flag, for a level or format that is not supported."""
    if level not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    if format not in LOG_FORMATS:
        raise ConfigError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, not {format!r}")


class _Handler(logging.StreamHandler):
    """The handler configure_logging installs (a later call replaces it, and only it)."""


class _StderrHandler(_Handler):
    """Writes to whatever sys.stderr is when a record comes (as logging's last-resort handler does), not to the
    stream it was when configured: an embedding process (or a test runner) may replace and close that one."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def configure_logging(level: str = "info", format: str = "text", stream: TextIO | None = None) -> None:
    """Gives the root logger one handler writing to `stream` (default stderr), replacing an earlier call's."""
    check_log_options(level, format)
    handler = _Handler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JsonFormatter() if format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, _Handler)] + [handler]
    own = getattr(logging, level.upper())
    library = own if own == logging.DEBUG else max(own, LIBRARY_LEVEL)
    root.setLevel(library)  # what every logger without a level of its own inherits
    for name in OWN_LOGGERS:  # their records reach the root's handler whatever the root's level
        logging.getLogger(name).setLevel(own)
    for name in NOISY_LIBRARIES:  # in case a library sets a level of its own on import
        logging.getLogger(name).setLevel(library)


def progress(items: Iterable[T], description: str, total: int | None = None, unit: str = "it",
             stream: TextIO | None = None) -> Iterator[T]:
    """`items`, showing progress: a tqdm bar when `stream` (default stderr) is a terminal, else log lines."""
    stream = stream if stream is not None else sys.stderr
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if _is_terminal(stream):
        from tqdm import tqdm
        yield from tqdm(items, desc=description, total=total, unit=unit, leave=False, file=stream)
        return
    yield from _logged(items, description, total, unit)


def _logged(items: Iterable[T], description: str, total: int | None, unit: str) -> Iterator[T]:
    started = last = time.monotonic()
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= PROGRESS_LOG_SECONDS:
            log.info("%s: %s", description, _count(done, total, unit))
            last = now
    if done or total:  # nothing to do is not worth a line
        log.info("%s: %s in %.1fs", description, _count(done, total, unit), time.monotonic() - started)


def _count(done: int, total: int | None, unit: str) -> str:
    if total:
        return f"{done}/{total} {unit}s ({100 * done // total}%)"
    return f"{done} {unit}s"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
