"""``LeaseStore`` on Redis, for deployments where the scheduler and the compactor (or
several schedulers) are separate processes.

Each operation is one Lua script, so it is atomic on the server:

    acquire   EXISTS lease? -> nil; else advance the fencing counter and SET lease
              "owner token" PX ttl (one script: no window between token and lease)
    renew     compare owner and token, then PEXPIRE
    release   compare owner and token, then DEL
    pin       HINCRBY page-hash holder +1
    unpin     check every requested decrement first, then HINCRBY -n / HDEL at 0
              (counts never go negative; a bad call changes nothing)

Not redis-py's ``Lock``: its token is thread-local and it has no fencing. All keys of
one store share a hash tag (``{sglang-evict:<namespace>}``), so every script's keys
live in one slot and stay valid on Redis Cluster. Expiry is Redis' own (PX), so
``expires_at_ms`` in a returned lease is the client's estimate, for information.
An unreachable server raises ``LeaseStoreUnavailable``; callers must then move nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from compactor_service.leases import Lease, check_ttl_ms


class LeaseStoreUnavailable(RuntimeError):
    """The lease store cannot be reached: no lease can be granted or checked."""


# Fencing tokens must grow even across a Redis restart without persistence (a fresh
# INCR would start at 1 and collide with a stale holder's token): the counter is floored
# at the server's clock in microseconds.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return nil end
local now = redis.call('TIME')
local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
local token = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
if token < floor then token = floor end
local text = string.format('%.0f', token)  -- exact below 2^53; plain concatenation is not
redis.call('SET', KEYS[2], text)
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. text, 'PX', ARGV[2])
return text
"""
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""
_UNPIN = """
local holder = ARGV[1]
for i, key in ipairs(KEYS) do
  local have = tonumber(redis.call('HGET', key, holder) or '0')
  if have < tonumber(ARGV[i + 1]) then return i end
end
for i, key in ipairs(KEYS) do
  if redis.call('HINCRBY', key, holder, -tonumber(ARGV[i + 1])) == 0 then
    redis.call('HDEL', key, holder)
  end
end
return 0
"""


class RedisLeaseStore:
    def __init__(self, url: str, namespace: str = "default", timeout_s: float = 1.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis_errors = (redis.ConnectionError, redis.TimeoutError)
        # No client-side retries: an unreachable store must fail fast (callers pause
        # compaction and retry later), not stall a scheduler step on backoff.
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
            retry=Retry(NoBackoff(), 0),
        )
        self.tag = f"{{sglang-evict:{namespace}}}"
        self._scripts = {
            name: self.client.register_script(source)
            for name, source in (
                ("acquire", _ACQUIRE),
                ("renew", _RENEW),
                ("release", _RELEASE),
                ("unpin", _UNPIN),
            )
        }

    def _lease_key(self, resource: str) -> str:
        return f"{self.tag}:lease:{resource}"

    def _pin_key(self, page: int) -> str:
        return f"{self.tag}:pins:{int(page)}"

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._redis_errors as error:
            raise LeaseStoreUnavailable(
                f"lease store at {self.client.connection_pool.connection_kwargs.get('host')}:"
                f"{self.client.connection_pool.connection_kwargs.get('port')} is unreachable "
                f"({error}); no compaction may move KV until it is back"
            ) from error

    def acquire(self, resource: str, owner: str, ttl_ms: int) -> Lease | None:
        check_ttl_ms(ttl_ms)
        keys = [self._lease_key(resource), f"{self.tag}:fencing"]
        token = self._call(self._scripts["acquire"], keys=keys, args=[owner, ttl_ms])
        if token is None:
            return None
        return Lease(resource, owner, int(token), _now_ms() + ttl_ms)

    def renew(self, lease: Lease, ttl_ms: int) -> Lease | None:
        check_ttl_ms(ttl_ms)
        done = self._call(
            self._scripts["renew"],
            keys=[self._lease_key(lease.resource)],
            args=[f"{lease.owner} {lease.token}", ttl_ms],
        )
        return Lease(lease.resource, lease.owner, lease.token, _now_ms() + ttl_ms) if done else None

    def release(self, lease: Lease) -> bool:
        done = self._call(
            self._scripts["release"],
            keys=[self._lease_key(lease.resource)],
            args=[f"{lease.owner} {lease.token}"],
        )
        return bool(done)

    def is_current(self, resource: str, token: int) -> bool:
        value = self._call(self.client.get, self._lease_key(resource))
        return value is not None and value.rsplit(" ", 1)[1] == str(token)

    def pin(self, pages: Iterable[int], holder: str) -> None:
        counts = Counter(int(p) for p in pages)
        pipe = self.client.pipeline(transaction=True)
        for page, n in counts.items():
            pipe.hincrby(self._pin_key(page), holder, n)
        self._call(pipe.execute)

    def unpin(self, pages: Iterable[int], holder: str) -> None:
        counts = Counter(int(p) for p in pages)
        if not counts:
            return
        pages_in_order = list(counts)
        short = self._call(
            self._scripts["unpin"],
            keys=[self._pin_key(p) for p in pages_in_order],
            args=[holder, *(counts[p] for p in pages_in_order)],
        )
        if short:
            page = pages_in_order[int(short) - 1]
            raise ValueError(f"{holder!r} does not pin pages [{page}] that often")

    def pinned_by_others(self, pages: Iterable[int], holder: str) -> list[int]:
        pages = [int(p) for p in pages]
        pipe = self.client.pipeline(transaction=False)
        for page in pages:
            pipe.hkeys(self._pin_key(page))
        holders = self._call(pipe.execute)
        return [p for p, names in zip(pages, holders, strict=True) if set(names) - {holder}]

    def pinned(self, pages: Iterable[int]) -> list[int]:
        pages = [int(p) for p in pages]
        pipe = self.client.pipeline(transaction=False)
        for page in pages:
            pipe.hlen(self._pin_key(page))
        counts = self._call(pipe.execute)
        return [p for p, count in zip(pages, counts, strict=True) if count]


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000
