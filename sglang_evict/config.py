"""One eviction policy's configuration: frozen, validated once, shared by every layer.

The names follow the flags an SGLang user sees (``--kv-budget``, ``--kv-cadence``,
``--kv-sink-tokens``, ``--kv-protected-tokens``, ``--kv-window``, ``--kv-scorer``,
``--kv-compaction``) and the llama.cpp-style eviction vocabulary (sink tokens,
protected system-prompt tokens, recent window).

A pass runs for a request when its cached KV reaches ``kv_budget_tokens +
cadence_tokens``; afterwards the request holds at most ``kv_budget_tokens`` tokens
(more only when protected tokens alone exceed the budget, which the pass reports).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from compactor_service.runtime_dir import DEFAULT_POOL_DIR, DEFAULT_SOCKET
from compactor_service.secrets import check_redis_url, redact_url
from sglang_evict.admission import ADMISSIONS
from sglang_evict.passes.grouping import AUTO, AUTO_MAX_GROUP_STEPS
from sglang_evict.passes.planner import STRATEGIES as COMPACTION_STRATEGIES  # one definition

# Ranges a config must stay inside; errors quote them.
MAX_SINK_TOKENS = 1 << 16
MAX_PAGE_SIZE = 1 << 12
MAX_PASS_GROUP_STEPS = 1 << 12  # decode steps a due request may wait for its pass
MAX_QUERY_WINDOW_TOKENS = 1 << 12
# The pass CUDA graphs' memory pool, taken out of the KV pool (``sglang_evict.passes.graphs``).
# On an H200 the README's workload captured 12 pass shapes into 20 MiB (docs/performance.md,
# "The pass replayed as a CUDA graph"): the default holds about ten times that, under
# 0.3 % of an 80 GiB card.
DEFAULT_PASS_GRAPH_POOL_MIB = 256
MAX_PASS_GRAPH_POOL_MIB = 1 << 20
# SGLang's request-to-token rows and the plugin's position table are int32.
MAX_REQUEST_TOKENS = (1 << 31) - 1
COMPACTORS = ("inprocess", "grpc")
COMPACTOR_FALLBACKS = ("inprocess", "skip")  # compactor_service.client.FALLBACK_MODES
LEASE_STORES = ("inprocess", "redis", "none")
# The best calibration-free scorer a server runs (``srt.server_args.server_scorers``) on
# the real model (benches/quality/real: SmolLM2-135M-Instruct, 4-bit weights
# dequantised), by needle accuracy averaged over the evicting budgets 1/8, 1/4, 1/2:
# streaming 0.25, rkv 0.13, window 0.07, knorm 0.00, random 0.00.
# tests/test_cli_default_scorer.py derives it from that file
# (``sglang_evict.quality.real.report.best_scorer``) and fails when they differ.
DEFAULT_SCORER = "streaming"


def _require_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value} is out of range; allowed: {allowed}")


@dataclass(frozen=True)
class EvictionConfig:
    """Eviction policy for every request of one server.

    Attributes:
        kv_budget_tokens: tokens a request keeps after a pass (``--kv-budget``).
        cadence_tokens: a pass runs once the request holds ``kv_budget_tokens +
            cadence_tokens`` tokens (``--kv-cadence``); amortises the copy cost.
        sink_tokens: first logical positions always kept, the attention sinks
            (``--kv-sink-tokens``).
        protected_tokens: further leading positions always kept, e.g. the system
            prompt (``--kv-protected-tokens``).
        window_tokens: most recent tokens always kept (``--kv-window``).
        scorer: name of a registered scorer (``--kv-scorer``).
        scorer_params: keyword parameters of that scorer; validated by the scorer.
        evict_prompt: whether unshared prompt tokens may be evicted. Off by default:
            only generated tokens are candidates. Shared prefix tokens are never
            candidates, whatever this says.
        compaction: ``repack`` (order-preserving) or ``hole_fill`` (fewest copies,
            survivors tracked through a position map).
        page_size: the engine's KV page size in tokens (taken from the engine).
        query_window_tokens: how many of a request's latest queries (per layer) are kept
            for scorers that read queries (``window``, ``rkv``).
        query_slots: requests whose queries the ring keeps at once (``--kv-query-slots``;
            None: enough for every request bounded admission lets run that a pass may
            read, ``query_capture.default_slots``); at most one per request row. A
            request finding no free slot waits in the queue.
        compactor: ``inprocess`` (the embedded default) or ``grpc`` (the sidecar at
            ``compactor_socket``; ``--kv-compactor``).
        compactor_socket: the sidecar's Unix socket (``--kv-compactor-socket``; default
            ``compactor_service.health.DEFAULT_SOCKET``, the compactor's own default).
        compactor_address: ``HOST:PORT`` of a sidecar listening on TCP instead
            (``--kv-compactor-address``).
        compactor_tls_ca, compactor_tls_cert, compactor_tls_key: TLS to a TCP sidecar:
            the CA of its certificate and, for mutual TLS, this scheduler's certificate
            and key (``--kv-compactor-tls-ca/-cert/-key``, PEM files).
        compactor_fallback: ``inprocess`` or ``skip``: what a pass does when the sidecar
            cannot serve it (``--kv-compactor-fallback``; see
            ``compactor_service.client``).
        compactor_timeout_ms: deadline of one Compact call (``--kv-compactor-timeout-ms``).
        shm_dir: the pool directory a CPU pool shared with the sidecar is created in; the
            sidecar maps pool files from its own ``--pool-dir`` only, so both must name
            the same private directory (``--kv-compactor-pool-dir``; default
            ``/dev/shm/sglang-evict-<uid>``, see ``compactor_service.runtime_dir``).
        lease_store: ``inprocess`` (default), ``redis`` (``redis_url``) or ``none``: where
            pass leases and shared-page pins live (``--kv-lease-store``).
        redis_url: ``redis://[:password@]host:port/db`` of the Redis lease store
            (``--kv-redis-url``, ``--kv-redis-url-file`` or ``$SGLANG_EVICT_REDIS_URL``);
            a secret: the repr redacts it and ``to_json`` leaves it out.
        lease_ttl_ms: TTL of a pass's exclusive lease.
        lease_namespace: key namespace in the Redis store; schedulers sharing one Redis
            need distinct namespaces (page numbers are per pool) and their compactor
            takes the same one (``--lease-namespace``).
        request_max_budget_tokens, request_max_cadence_tokens: the largest budget and
            cadence a request may ask for itself (``--kv-request-max-budget``,
            ``--kv-request-max-cadence``; None: the server's own, so a request may only
            lower them). See ``sglang_evict.request_policy``.
        request_allow_disable: whether a request may turn eviction off for itself
            (``--kv-request-allow-disable``).
        admission: ``bounded`` (default): SGLang's admission reserves for an evicting
            request the KV it can still add under its budget, not the rest of its
            ``max_new_tokens``; ``sglang``: SGLang's own arithmetic, unchanged
            (``--kv-admission``; see ``sglang_evict.admission``).
        pressure_passes: when a decode step cannot allocate, compact the most
            evictable requests early before SGLang retracts any (default on;
            ``--kv-no-pressure-passes`` turns it off).
        pass_group_steps: passes run on every ``pass_group_steps``-th decode step
            only; a request that falls due in between waits for the next one (growing
            by up to ``pass_group_steps - 1`` more tokens, which bounded admission
            counts), so one pass serves every request due in the group. 1 (default):
            a pass at every step with a due request (``--kv-pass-group-steps``);
            ``"auto"``: the server chooses, up to ``pass_grouping.AUTO_MAX_GROUP_STEPS``
            (``sglang_evict.passes.grouping``).
        pass_cuda_graph: replay passes as CUDA graphs, one per bucketed pass shape
            (``sglang_evict.passes.graphs``); None (default): on where the KV pool is on
            a CUDA device, False: eager (``--kv-pass-cuda-graph`` / ``--no-...``).
        pass_graph_pool_mib: the most memory the pass graphs may hold; a server with
            pass graphs on takes it out of SGLang's KV pool, and shapes past it run
            eagerly (``--kv-pass-graph-pool-mib``; ``sglang_evict.passes.graphs``).
        tier_bits: the quantized tier's bits per element (2, 3, 4 or 8), or None (the
            default): no tier, a pass evicts what it does not keep (``--kv-tier-bits``).
            With a tier, what a pass would evict enters the request's tier in whole
            groups instead, and only a full tier gives groups up (``sglang_evict.tier``).
        tier_group_tokens: tokens quantized together, G (``--kv-tier-group``).
        tier_value_group_channels: channels sharing a value range, C
            (``--kv-tier-value-group``).
        tier_outlier_tokens: OTT's outlier tokens per group and KV head, kept in full
            precision (``--kv-tier-outliers``; none in the first two layers).
        tier_max_tokens: the most tokens one request's tier holds, a whole number of
            groups (``--kv-tier-tokens``).
        tier_pool_share: the share of the KV memory the tier's arena takes when the
            pool is sized (``--kv-tier-pool-share``; ``sglang_evict.tier.arena``).

    How per-head scores combine into one keep-set per request is a scorer parameter
    (``head_normalization``, ``head_reduction``; see ``sglang_evict.scorers.base``).
    """

    kv_budget_tokens: int
    cadence_tokens: int = 128
    sink_tokens: int = 4
    protected_tokens: int = 0
    window_tokens: int = 128
    scorer: str = DEFAULT_SCORER
    scorer_params: Mapping[str, Any] = field(default_factory=dict)
    evict_prompt: bool = False
    compaction: str = "hole_fill"
    page_size: int = 1
    query_window_tokens: int = 32
    query_slots: int | None = None
    compactor: str = "inprocess"
    compactor_socket: str = DEFAULT_SOCKET
    compactor_address: str | None = None
    compactor_tls_ca: str | None = None
    compactor_tls_cert: str | None = None
    compactor_tls_key: str | None = None
    compactor_fallback: str = "inprocess"
    compactor_timeout_ms: int = 1000
    shm_dir: str = DEFAULT_POOL_DIR
    lease_store: str = "inprocess"
    redis_url: str | None = None
    lease_ttl_ms: int = 5000
    lease_namespace: str = "default"
    request_max_budget_tokens: int | None = None
    request_max_cadence_tokens: int | None = None
    request_allow_disable: bool = False
    admission: str = "bounded"
    pressure_passes: bool = True
    pass_group_steps: int | str = 1
    pass_cuda_graph: bool | None = None
    pass_graph_pool_mib: int = DEFAULT_PASS_GRAPH_POOL_MIB
    tier_bits: int | None = None
    tier_group_tokens: int = 32  # the rule's choice (docs/quality.md)
    tier_value_group_channels: int = 32
    tier_outlier_tokens: int = 0
    tier_max_tokens: int = 4096
    tier_pool_share: float = 0.25
    _scorer: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require_int("cadence_tokens", self.cadence_tokens, 1)
        _require_int("sink_tokens", self.sink_tokens, 0, MAX_SINK_TOKENS)
        _require_int("protected_tokens", self.protected_tokens, 0)
        _require_int("window_tokens", self.window_tokens, 0)
        _require_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        _require_int("query_window_tokens", self.query_window_tokens, 1, MAX_QUERY_WINDOW_TOKENS)
        if self.query_slots is not None:
            _require_int("query_slots", self.query_slots, 1)
        always_kept = self.sink_tokens + self.protected_tokens + self.window_tokens
        _require_int("kv_budget_tokens", self.kv_budget_tokens, 1)
        if self.kv_budget_tokens <= always_kept:
            raise ValueError(
                f"kv_budget_tokens={self.kv_budget_tokens} leaves no room to choose: it must "
                f"exceed sink_tokens + protected_tokens + window_tokens = {always_kept} "
                f"({self.sink_tokens} + {self.protected_tokens} + {self.window_tokens}); "
                f"raise --kv-budget or lower --kv-window/--kv-sink-tokens/--kv-protected-tokens"
            )
        if not isinstance(self.evict_prompt, bool):
            raise ValueError(f"evict_prompt must be true or false, got {self.evict_prompt!r}")
        self._check_request_limits()
        if self.compaction not in COMPACTION_STRATEGIES:
            raise ValueError(
                f"unknown compaction {self.compaction!r}; known: {list(COMPACTION_STRATEGIES)}"
            )
        for name, value, known in (
            ("compactor", self.compactor, COMPACTORS),
            ("compactor_fallback", self.compactor_fallback, COMPACTOR_FALLBACKS),
            ("lease_store", self.lease_store, LEASE_STORES),
            ("admission", self.admission, ADMISSIONS),
        ):
            if value not in known:
                raise ValueError(f"unknown {name} {value!r}; known: {list(known)}")
        if not isinstance(self.pressure_passes, bool):
            raise ValueError(f"pressure_passes must be true or false, got {self.pressure_passes!r}")
        if self.pass_group_steps != AUTO:
            _require_int("pass_group_steps", self.pass_group_steps, 1, MAX_PASS_GROUP_STEPS)
        if self.pass_cuda_graph not in (None, True, False):
            raise ValueError(
                f"pass_cuda_graph must be true, false or unset (on for a CUDA pool), got "
                f"{self.pass_cuda_graph!r}"
            )
        _require_int("pass_graph_pool_mib", self.pass_graph_pool_mib, 1, MAX_PASS_GRAPH_POOL_MIB)
        _require_int("compactor_timeout_ms", self.compactor_timeout_ms, 1)
        self._check_compactor_transport()
        self._check_tier()
        _require_int("lease_ttl_ms", self.lease_ttl_ms, 1)
        if self.lease_store == "redis" and not self.redis_url:
            raise ValueError(
                "lease_store 'redis' needs a URL: set $SGLANG_EVICT_REDIS_URL or pass "
                "--kv-redis-url-file FILE (or --kv-redis-url redis://HOST:PORT)"
            )
        if self.redis_url is not None:
            if not isinstance(self.redis_url, str):
                raise ValueError(f"redis_url must be a string, got {type(self.redis_url)}")
            check_redis_url(self.redis_url, "redis_url")
        if not isinstance(self.scorer_params, Mapping):
            raise ValueError(f"scorer_params must be a mapping, got {type(self.scorer_params)}")
        # Freeze the parameters too: a frozen dataclass holding a mutable dict is not frozen.
        object.__setattr__(self, "scorer_params", MappingProxyType(dict(self.scorer_params)))
        # build_scorer validates the name and every parameter (and loads a stats file
        # once); scorers are frozen and stateless, so the one instance is shared.
        from sglang_evict.scorers import build_scorer

        object.__setattr__(self, "_scorer", build_scorer(self.scorer, self.scorer_params))

    def _check_tier(self) -> None:
        """The tier's flags, each refusal naming its flag (the head dim is checked
        against the model's when the manager starts: ``tier_format``)."""
        if self.tier_bits is None:
            return
        from sglang_evict_kernels.tier_format import SUPPORTED_BITS

        if isinstance(self.tier_bits, bool) or self.tier_bits not in SUPPORTED_BITS:
            raise ValueError(
                f"--kv-tier-bits {self.tier_bits!r}: the tier stores 2, 3, 4 or 8 bits"
            )
        g = self.tier_group_tokens
        _require_int("tier_group_tokens (--kv-tier-group)", g, 8, 1 << 12)
        if g & (g - 1):
            raise ValueError(f"--kv-tier-group {g}: a power of two of at least 8")
        c = self.tier_value_group_channels
        _require_int("tier_value_group_channels (--kv-tier-value-group)", c, 8, 128)
        if c & (c - 1):
            raise ValueError(f"--kv-tier-value-group {c}: a power of two of at least 8")
        _require_int("tier_outlier_tokens (--kv-tier-outliers)", self.tier_outlier_tokens, 0)
        if self.tier_outlier_tokens >= g // 2:
            raise ValueError(
                f"--kv-tier-outliers {self.tier_outlier_tokens}: below half a group "
                f"({g // 2} for --kv-tier-group {g})"
            )
        _require_int("tier_max_tokens (--kv-tier-tokens)", self.tier_max_tokens, 1)
        if self.tier_max_tokens < g or self.tier_max_tokens % g:
            raise ValueError(
                f"--kv-tier-tokens {self.tier_max_tokens}: the tier holds whole groups of "
                f"{g} tokens (--kv-tier-group); give a multiple of {g}, at least {g}"
            )
        share = self.tier_pool_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1:
            raise ValueError(
                f"--kv-tier-pool-share {share!r}: the share of the KV memory the tier's "
                f"arena takes, in (0, 1)"
            )

    def tier_format(self, head_dim: int, scale_dtype=None):
        """The tier's ``TierFormat`` for a model of ``head_dim`` (None: no tier); a head
        dim the kernels do not hold is refused naming ``--kv-tier-bits``."""
        if self.tier_bits is None:
            return None
        import torch

        from sglang_evict_kernels.tier_format import SUPPORTED_HEAD_DIMS, TierFormat

        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"--kv-tier-bits: the tier's kernels hold head dims {list(SUPPORTED_HEAD_DIMS)}; "
                f"this model's is {head_dim}: run it without --kv-tier-bits"
            )
        return TierFormat(
            bits=self.tier_bits,
            group_tokens=self.tier_group_tokens,
            value_group_channels=self.tier_value_group_channels,
            outlier_tokens=self.tier_outlier_tokens,
            head_dim=head_dim,
            scale_dtype=scale_dtype or torch.float16,
        )

    def _check_request_limits(self) -> None:
        for name, flag, value, default in (
            (
                "request_max_budget_tokens",
                "--kv-request-max-budget",
                self.request_max_budget_tokens,
                self.kv_budget_tokens,
            ),
            (
                "request_max_cadence_tokens",
                "--kv-request-max-cadence",
                self.request_max_cadence_tokens,
                self.cadence_tokens,
            ),
        ):
            if value is None:
                continue
            _require_int(name, value, 1, MAX_REQUEST_TOKENS)
            if value < default:
                raise ValueError(
                    f"{name}={value} ({flag}) is below the server's own {default}: a "
                    f"request's maximum cannot be below the default it starts from; allowed: "
                    f"[{default}, {MAX_REQUEST_TOKENS}]"
                )
        if not isinstance(self.request_allow_disable, bool):
            raise ValueError(
                f"request_allow_disable must be true or false, got {self.request_allow_disable!r}"
            )

    @property
    def request_max_budget(self) -> int:
        """The largest budget a request may ask for (``request_max_budget_tokens``)."""
        return self.request_max_budget_tokens or self.kv_budget_tokens

    @property
    def request_max_cadence(self) -> int:
        """The largest cadence a request may ask for (``request_max_cadence_tokens``)."""
        return self.request_max_cadence_tokens or self.cadence_tokens

    def _check_compactor_transport(self) -> None:
        if self.compactor_address is not None:
            from compactor_service.tls import parse_tcp_address

            parse_tcp_address(self.compactor_address, "--kv-compactor-address")
        tls = (self.compactor_tls_ca, self.compactor_tls_cert, self.compactor_tls_key)
        if any(tls) and self.compactor_address is None:
            raise ValueError(
                "--kv-compactor-tls-* apply to a TCP compactor: add --kv-compactor-address"
            )
        if (self.compactor_tls_cert or self.compactor_tls_key) and not self.compactor_tls_ca:
            raise ValueError(
                "--kv-compactor-tls-cert/-key need --kv-compactor-tls-ca (the CA of the "
                "compactor's certificate)"
            )
        if bool(self.compactor_tls_cert) != bool(self.compactor_tls_key):
            raise ValueError("--kv-compactor-tls-cert and --kv-compactor-tls-key go together")

    def __repr__(self) -> str:
        """The fields, with the Redis URL's password redacted."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}
        shown["scorer_params"] = dict(self.scorer_params)
        shown["redis_url"] = redact_url(self.redis_url)
        return f"EvictionConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def to_json(self) -> str:
        """The policy as the JSON object ``sglang-evict serve`` hands to SGLang's processes
        (``SGLANG_EVICT_CONFIG``). Page size is left out (each process takes it from its
        engine), and so is the Redis URL, a secret that travels in its own variable,
        ``$SGLANG_EVICT_REDIS_URL``, and is never printed."""
        import json

        fields = {
            name: getattr(self, name)
            for name, spec in self.__dataclass_fields__.items()
            if spec.init and name not in ("page_size", "redis_url")
        }
        fields["scorer_params"] = dict(self.scorer_params)
        return json.dumps(fields, sort_keys=True)

    @property
    def trigger_tokens(self) -> int:
        """KV length at which a request's pass runs."""
        return self.kv_budget_tokens + self.cadence_tokens

    @property
    def group_steps_bound(self) -> int:
        """The most decode steps a pass may wait (what bounded admission counts):
        ``pass_group_steps``, or with ``auto`` the largest group it may choose."""
        return AUTO_MAX_GROUP_STEPS if self.pass_group_steps == AUTO else self.pass_group_steps

    def make_scorer(self):  # -> Scorer; typed loosely to keep the import lazy
        """The configured scorer (built and validated once, at construction)."""
        return self._scorer
