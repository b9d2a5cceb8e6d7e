"""Secrets the scheduler and the compactor take: the Redis URL (it may carry a password).

A secret never travels on a command line (``/proc/PID/cmdline`` is readable by every
user of the host) and is never printed or logged as it is:

* ``resolve_redis_url`` takes the URL from, in order, a flag value, a file (``--*-file``,
  e.g. a mounted Kubernetes Secret) or the ``SGLANG_EVICT_REDIS_URL`` environment
  variable;
* ``redact_url`` is what every message, log line and dry-run output shows instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

REDIS_URL_ENV = "SGLANG_EVICT_REDIS_URL"
REDACTED = "***"
REDIS_SCHEMES = ("redis", "rediss", "unix")
# user:password@ in any URL-looking text (for free-form messages such as exceptions).
_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^@/\s]*)@")


def redact_url(url: str | None) -> str | None:
    """``url`` with its password (or a bare ``:secret@`` user part) replaced by ``***``.

    >>> redact_url("redis://:hunter2@redis:6379/0")
    'redis://:***@redis:6379/0'
    >>> redact_url("redis://app:hunter2@redis:6379/0")
    'redis://app:***@redis:6379/0'
    """
    if url is None:
        return None
    return redact_text(url)


def redact_text(text: str) -> str:
    """Every ``scheme://user:password@`` in ``text`` with the password replaced."""

    def replace(match: re.Match) -> str:
        userinfo = match.group("userinfo")
        if ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            userinfo = f"{user}:{REDACTED}"
        elif userinfo:  # redis://secret@host: redis-py reads a lone user part as password
            userinfo = REDACTED
        return f"{match.group('scheme')}{userinfo}@"

    return _CREDENTIALS.sub(replace, text)


def check_redis_url(url: str, source: str) -> str:
    """``url`` if it is a Redis URL redis-py accepts, else ``ValueError`` naming
    ``source`` (the flag, file or variable) with the URL redacted."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a non-numeric port
    except ValueError as error:
        raise ValueError(f"{source}: malformed Redis URL {shown!r} ({error})") from None
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(
            f"{source}: {shown!r} is not a Redis URL; expected redis://[:PASSWORD@]HOST:PORT/DB "
            f"(or rediss:// for TLS, unix:///path/to/redis.sock)"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"{source}: Redis URL {shown!r} has no host")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"{source}: Redis URL {shown!r} has port {port}; allowed: 1-65535")
    path = parts.path.lstrip("/")
    if parts.scheme != "unix" and path and not path.isdigit():
        raise ValueError(f"{source}: Redis URL {shown!r} names database {path!r}; use a number")
    return url


def resolve_redis_url(
    url: str | None = None,
    url_file: str | None = None,
    *,
    flag: str = "--redis-url",
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The Redis URL from ``url`` (a flag), else ``url_file``, else ``$SGLANG_EVICT_REDIS_URL``;
    None when none is given. Validated (``check_redis_url``); errors never show the password."""
    if url and url_file:
        raise ValueError(f"give {flag} or {flag}-file, not both")
    if url:
        return check_redis_url(url, flag)
    if url_file:
        path = Path(url_file)
        try:
            text = path.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise ValueError(f"{flag}-file {url_file}: cannot read it ({error.strerror})") from None
        if not text:
            raise ValueError(f"{flag}-file {url_file} is empty")
        return check_redis_url(text, f"{flag}-file {url_file}")
    value = (os.environ if environ is None else environ).get(REDIS_URL_ENV)
    if value:
        return check_redis_url(value.strip(), f"${REDIS_URL_ENV}")
    return None
