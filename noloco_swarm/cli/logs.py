"""`--log-format json`: one JSON object per line on stderr, for running a peer as a service.

systemd's journal, Docker and Kubernetes log drivers keep a process's stderr line by line; a
multi-line traceback or a coloured, column-aligned line splits or garbles there. In JSON mode
every record (ours, hivemind's and p2pd's, which hivemind relays through `logging`, Python
warnings, and an uncaught exception with its traceback) becomes one line
`{"time": unix seconds, "level": ..., "logger": ..., "message": ..., "exception": ...}`.

Known limit: faulthandler's dump of a hung peer's threads (cli/join.py, EXIT_GRACE) is written by
C code straight to stderr, as plain text.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from types import TracebackType

LOG_FORMATS = ("text", "json")
# hivemind renames WARNING to "WARN" for its coloured lines; JSON readers get the standard names.
LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error"}


class JsonFormatter(logging.Formatter):
    """A log record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": round(record.created, 6),
            "level": LEVELS.get(record.levelno, "critical" if record.levelno > logging.ERROR else "debug"),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


def use_json_logs(level: int = logging.WARNING) -> None:
    """Send every log record, hivemind's included, to stderr as JSON lines, and uncaught
    exceptions too. Our own records from `level` up (WARNING, as in text mode); hivemind's from
    its HIVEMIND_LOGLEVEL (INFO by default), as in text mode."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")  # hivemind's records propagate to the root logger
    logging.getLogger("hivemind").setLevel(os.getenv("HIVEMIND_LOGLEVEL", "INFO").upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught


def _log_uncaught(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    logging.getLogger("noloco").critical("uncaught %s: %s", kind.__name__, error, exc_info=(kind, error, tb))
