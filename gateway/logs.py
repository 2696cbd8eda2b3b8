"""Logging setup: plain text or one JSON object per line, with the request id of the call being
served attached to every line logged while serving it.

The request id comes from the caller (``x-request-id`` gRPC metadata or HTTP header); the
transports put it in ``REQUEST_ID`` for the duration of the call and echo it back. It is never
generated here: minting an id per call would cost every caller for the few that log.

Events that operators filter on (load, ready, drain, unload, stopped) are logged with
``extra={"event": ..., "model": ..., "version": ...}``; the JSON formatter writes those keys as
fields, the text formatter leaves them in the message. Nothing here logs tensor data; URLs with
credentials are masked on the way out (``redis://user:***@host``), whoever logged them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
REQUEST_ID_KEY = "x-request-id"  # gRPC metadata key and HTTP header (case-insensitive there)
MAX_REQUEST_ID_CHARS = 128  # a client cannot make every log line arbitrarily long

# The attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "request_id"}
_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<secret>[^@/\s]+)@", re.I)


def clean_request_id(value: str | bytes | None) -> str:
    """The id as it may appear in logs and be echoed: printable ASCII, bounded length."""
    if not value:
        return ""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    value = value[:MAX_REQUEST_ID_CHARS]
    if not (value.isascii() and value.isprintable()):  # it is echoed as a header: keep it one
        value = "".join(c for c in value if c.isascii() and c.isprintable())
    return value


def adopt_request_id(value: str | bytes | None) -> str:
    """The caller's ``x-request-id`` (cleaned) as the id of every line logged for this call from
    here on, returned for the transport to echo. Every transport adopts it here, at the call's
    start; with none sent the id is cleared, so a stale one never outlives its call."""
    rid = clean_request_id(value)
    if rid or REQUEST_ID.get():
        REQUEST_ID.set(rid)
    return rid


def mask_secrets(text: str) -> str:
    return _CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = mask_secrets(super().format(record))
        rid = getattr(record, "request_id", "")
        return f"{text} [request_id={rid}]" if rid else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id (when serving one), the
    `extra=` fields, and exc (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": mask_secrets(record.getMessage()),
        }
        rid = getattr(record, "request_id", "")
        if rid:
            out["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exc"] = mask_secrets(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False)


def make_handler(fmt: str = "text", stream=None) -> logging.Handler:
    """A stream handler writing ``fmt`` ("text" or "json") lines with the request id attached."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_RequestIdFilter())
    return handler


def setup(level: str = "INFO", fmt: str = "text", stream=None) -> None:
    """Configure the root logger once for the process (replacing earlier handlers)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(make_handler(fmt, stream))
    root.setLevel(level.upper())
