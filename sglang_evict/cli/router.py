"""``sglang-evict router``: SGLang's own router (the ``sglang-router`` package) in front of
evicting replicas.

Each replica keeps its own KV pool, radix tree and eviction state; what makes several
of them serve like one is where a request lands. The router's cache-aware policy (the
default here) sends a request to the replica whose radix tree most likely holds its
prefix, so a conversation's next turn, or a program's forked branches, find their
prefix cached; round-robin spreads them and the radix cache misses.

Before it starts the router, the command checks every worker it is given: each must
answer ``/get_server_info`` within ``--wait-s`` and report the plugin's state there (a
replica started with plain ``python -m sglang.launch_server`` is refused by name).
Every flag not listed here goes to the router as written
(``python -m sglang_router.launch_router --help``). On Kubernetes the chart runs the
router with service discovery instead (docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
import urllib.error
import urllib.request

from sglang_evict.cli.flags import int_flag

# The router's policies this command offers (sglang-router 0.3.2's, less ``manual``,
# which needs a routing key per request).
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
DEFAULT_POLICY = "cache_aware"
DEFAULT_PORT = 30080
INSTALL_HINT = 'pip install "sglang-evict[router]"'


class WorkerRefused(ValueError):
    """A worker the router must not be started with, and why (one line)."""


def worker_state(url: str, timeout_s: float = 5.0) -> dict:
    """What ``url``'s SGLang server reports of the plugin in ``/get_server_info``.
    Raises ``OSError`` when the server does not answer, ``WorkerRefused`` when it answers
    without the plugin."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/get_server_info", timeout=timeout_s) as reply:
        info = json.loads(reply.read())
    if not isinstance(info, dict):
        raise ValueError(f"{url}/get_server_info is not SGLang's (not a JSON object)")
    states = info.get("internal_states") or [{}]
    state = states[0].get("sglang_evict") if isinstance(states[0], dict) else None
    if not isinstance(state, dict):
        raise WorkerRefused(
            f"worker {url} answers /get_server_info without the eviction plugin's state "
            "(plain SGLang, or not an SGLang server): start it with `sglang-evict serve`"
        )
    return state


def check_workers(urls: list[str], wait_s: float, interval_s: float = 1.0) -> None:
    """Wait up to ``wait_s`` for every worker to answer; ``ValueError`` naming the first
    that never did or that runs without the plugin."""
    deadline = time.monotonic() + wait_s
    pending = list(urls)
    errors: dict[str, str] = {}
    while pending:
        for url in list(pending):
            try:
                worker_state(url)
            except WorkerRefused:
                raise
            except (OSError, ValueError) as error:  # not up yet, or not SGLang
                errors[url] = str(getattr(error, "reason", error))
                continue
            pending.remove(url)
        if pending and time.monotonic() >= deadline:
            url = pending[0]
            raise ValueError(
                f"worker {url} did not answer /get_server_info within {wait_s:g} s "
                f"({errors.get(url, 'no answer')}); start it (`sglang-evict serve ... --port`) "
                "or raise --wait-s"
            )
        if pending:
            time.sleep(interval_s)


def router_command(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """The command starting SGLang's router over ``args.worker_urls`` (the flags this
    command owns are parsed by it, so ``rest`` never holds them)."""
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *args.worker_urls,
        "--policy",
        args.policy,
        "--host",
        args.host,
        "--port",
        str(args.port),
        *rest,
    ]


def run(args: argparse.Namespace, rest: list[str]) -> int:
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError(f"SGLang's router is not installed: {INSTALL_HINT}")
    for url in args.worker_urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--worker-urls takes http(s)://host:port URLs, got {url!r:.60}")
    command = router_command(args, rest)
    check_workers(args.worker_urls, args.wait_s)
    print(
        f"sglang-evict router: {len(args.worker_urls)} evicting worker(s), policy "
        f"{args.policy}, on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    if args.dry_run:
        print(shlex.join(command))
        return 0
    os.execv(command[0], command)
    return 1  # not reached


def add_router_command(commands) -> None:
    router = commands.add_parser(
        "router",
        help="SGLang's router (cache-aware) in front of evicting replicas; other flags go to it",
        description="Check that every worker runs sglang-evict (its /get_server_info reports "
        "the plugin), then start SGLang's router (python -m sglang_router.launch_router, "
        "from the sglang-router package: the router extra) over them. Cache-aware routing "
        "sends a request to the replica most likely to hold its prefix. Every flag not "
        "listed here is passed to the router.",
    )
    router.add_argument(
        "--worker-urls", nargs="+", required=True, metavar="URL", help="the replicas' URLs"
    )
    router.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY)
    router.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    router.add_argument("--port", type=int_flag(1, 65535), default=DEFAULT_PORT)
    router.add_argument(
        "--wait-s",
        type=int_flag(0),
        default=120,
        help="how long to wait for every worker to answer before giving up",
    )
    router.add_argument(
        "--dry-run", action="store_true", help="check the workers, print the command, start nothing"
    )
    router.set_defaults(handler=run, passes_through=True)
