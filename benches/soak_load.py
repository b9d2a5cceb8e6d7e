"""The soak's clients (``benches/soak.py``): what they send and what they count."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from sglang_evict.request_policy import report_of

SYSTEM_PROMPTS = (
    "You are a careful assistant for a library. Answer briefly and cite the shelf.",
    "You are a travel planner. Give the route, the time and one tip for each stop.",
    "You are a tutor in arithmetic. Show each step of the working before the result.",
)
QUESTIONS = (
    "Where are the maps of the northern coast kept?",
    "How do I get from the station to the old harbour before noon?",
    "What is 17 times 23, and how do you check it?",
    "Which books explain how bridges carry their load?",
    "Plan an afternoon walk through the market and the gardens.",
    "Why does carrying a digit work when adding by hand?",
)
CHAT_ANSWER_CHARS = 200
CHAT_MAX_TOKENS = 48
# Malformed or out-of-range policies and the words the 400's message must hold.
BAD_POLICIES = (
    ({"kv_budget_tokens": 1}, "kv_budget_tokens"),
    ({"kv_budget_tokens": 10**9}, "kv_budget_tokens"),
    ({"cadence_tokens": 0}, "cadence_tokens"),
    ({"scorer": "nosuch"}, "scorer"),
    ({"budget": 64}, "budget"),
    ({"kv_budget_tokens": "many"}, "kv_budget_tokens"),
    ("not an object", "custom_params.sglang_evict"),
)
# With the tier on (``Settings.tier_bits``), these too: more than the server's bound,
# and a part of a group.
BAD_TIER_POLICIES = (
    ({"tier_tokens": 10**6}, "tier_tokens"),
    ({"tier_tokens": 17}, "tier_tokens"),
    ({"tier_tokens": -16}, "tier_tokens"),
)


@dataclass
class Settings:
    minutes: float = 10.0
    model: str = "tiny"
    replicas: int = 1
    faults: bool = False
    kill_replica: bool = False
    concurrency: int = 12
    seed: int = 0
    budget_tokens: int = 64
    cadence_tokens: int = 16
    window_tokens: int = 16
    pool_tokens: int = 1024  # SGLang's --max-total-tokens: the pool holds few un-evicted
    page_size: int = 1
    cancel_share: float = 0.1
    bad_share: float = 0.08
    deadline_s: float = 300.0  # a request not ended by then never ends
    replay_samples: int = 6
    fault_interval_s: tuple[float, float] = (20.0, 60.0)
    max_rss_growth: float | None = None  # a violation above it (the 60-min goal: 0.05)
    # The quantized tier (--kv-tier-bits; None: none): a request's tier holds at most
    # ``tier_tokens`` (whole groups of ``tier_group_tokens``); requests ask for less.
    tier_bits: int | None = None
    tier_group_tokens: int = 16
    tier_tokens: int = 64
    out: str = "soak-out"

    @property
    def phase_s(self) -> dict[str, float]:
        total = self.minutes * 60
        return {"warm-up": 0.1 * total, "load": 0.45 * total, "faults": 0.45 * total}


@dataclass
class Phase:
    name: str
    started_s: float = 0.0
    completed: int = 0
    cancelled: int = 0
    expected_4xx: Counter = field(default_factory=Counter)
    unexpected_4xx: list = field(default_factory=list)
    status_5xx: list = field(default_factory=list)
    client_errors: list = field(default_factory=list)
    never_ended: int = 0
    ttft_s: list = field(default_factory=list)
    itl_s: list = field(default_factory=list)
    faults: list = field(default_factory=list)
    idle: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    def summary(self) -> dict:
        def pct(values, q):
            if not values:
                return None
            ordered = sorted(values)
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

        return {
            "name": self.name,
            "completed": self.completed,
            "cancelled_by_client": self.cancelled,
            "expected_4xx": dict(self.expected_4xx),
            "unexpected_4xx": self.unexpected_4xx[:20],
            "5xx": self.status_5xx[:20],
            "client_errors": self.client_errors[:20],
            "never_ended": self.never_ended,
            "ttft_p50_s": pct(self.ttft_s, 0.5),
            "ttft_p99_s": pct(self.ttft_s, 0.99),
            "itl_p50_s": pct(self.itl_s, 0.5),
            "itl_p99_s": pct(self.itl_s, 0.99),
            "faults": self.faults,
            "idle": self.idle,
            "metrics": self.metrics,
        }


def names(message: str, field_name: str) -> bool:
    """A refusal names the per-request policy and the field at fault."""
    return "custom_params.sglang_evict" in message and field_name in message


def random_policy(rng: random.Random, s: Settings) -> dict:
    """A valid per-request policy: only lowers what the server allows (docs/serving.md)."""
    floor = 4 + s.window_tokens + 1  # sinks + window + 1
    policy = {}
    if rng.random() < 0.5:
        policy["kv_budget_tokens"] = rng.randint(floor, s.budget_tokens)
    if rng.random() < 0.4:
        policy["cadence_tokens"] = rng.randint(1, s.cadence_tokens)
    if rng.random() < 0.4:
        policy["scorer"] = rng.choice(("streaming", "knorm"))
    if s.tier_bits is not None and rng.random() < 0.4:  # 0: this request keeps no tier
        policy["tier_tokens"] = s.tier_group_tokens * rng.randint(
            0, s.tier_tokens // s.tier_group_tokens
        )
    return policy


class Load:
    """The clients: one coroutine per in-flight request, ``concurrency`` at a time."""

    def __init__(self, url: str, s: Settings, rng: random.Random) -> None:
        self.url, self.s, self.rng = url, s, rng
        self.phase: Phase | None = None
        self.greedy_done: list[dict] = []  # completed, not cancelled: replay candidates
        self.chats: list[list[dict]] = []

    async def request(self, session) -> None:
        import aiohttp

        rng, s, phase = self.rng, self.s, self.phase
        kind = rng.choices(("generate", "completions", "chat", "bad"), (4, 3, 3, 0))[0]
        if rng.random() < s.bad_share:
            kind = "bad"
        cancel_after = rng.randint(2, 12) if rng.random() < s.cancel_share else None
        new_tokens = rng.choice((8, 16, 32, 96, 192))
        policy = random_policy(rng, s)
        path, body, expect = self._body(kind, new_tokens, policy)
        tokens: list = []
        started = time.monotonic()
        last = None
        try:
            async with asyncio.timeout(s.deadline_s):
                async with session.post(self.url + path, json=body) as reply:
                    if reply.status >= 500:
                        phase.status_5xx.append(
                            f"{reply.status} {path}: {await reply.text()}"[:300]
                        )
                        return
                    if reply.status >= 400:
                        text = await reply.text()
                        if expect is not None and names(text, expect):
                            phase.expected_4xx[expect] += 1
                        else:
                            phase.unexpected_4xx.append(f"{reply.status} {path}: {text}"[:300])
                        return
                    if expect is not None and not body.get("stream"):
                        phase.unexpected_4xx.append(f"{reply.status} {path}: accepted {expect}")
                        return
                    if not body.get("stream"):
                        payload = await reply.json()
                        phase.ttft_s.append(time.monotonic() - started)
                        phase.completed += 1
                        self._keep_for_replay(path, body, payload)
                        return
                    async for line in reply.content:
                        line = line.strip()
                        if not line.startswith(b"data:") or line == b"data: [DONE]":
                            continue
                        now = time.monotonic()
                        if last is None:
                            phase.ttft_s.append(now - started)
                        else:
                            phase.itl_s.append(now - last)
                        last = now
                        tokens.append(line)
                        if b'"error"' in line[:40]:
                            # A streamed /generate is refused in its first event: SGLang
                            # sends the 200 header before the request is validated.
                            text = line.decode(errors="replace")
                            if expect is not None and len(tokens) == 1 and names(text, expect):
                                phase.expected_4xx[expect] += 1
                            elif expect is not None:
                                phase.unexpected_4xx.append(f"{path}: {text}"[:300])
                            else:
                                phase.client_errors.append(text[:300])
                            return
                        if expect is not None:
                            phase.unexpected_4xx.append(f"{path}: streamed despite {expect}")
                            return
                        if cancel_after is not None and len(tokens) >= cancel_after:
                            phase.cancelled += 1
                            return  # leaving the block closes the connection mid-stream
                    phase.completed += 1
                    if kind == "chat":
                        self._extend_chat(body, tokens)
        except TimeoutError:
            phase.never_ended += 1
        except aiohttp.ClientError as error:
            phase.client_errors.append(f"{type(error).__name__} {path}: {error}"[:300])

    def _body(self, kind: str, new_tokens: int, policy: dict) -> tuple[str, dict, str | None]:
        rng = self.rng
        system = rng.choice(SYSTEM_PROMPTS)
        question = rng.choice(QUESTIONS)
        expect = None
        if kind == "bad":
            bad = BAD_POLICIES + (BAD_TIER_POLICIES if self.s.tier_bits is not None else ())
            policy, expect = rng.choice(bad)
            # sglang-router drops /generate's custom_params (docs/serving.md): behind it
            # a bad policy goes where clients are told to send policies, the OpenAI route.
            kind = "completions" if self.s.replicas > 1 else rng.choice(("generate", "completions"))
        custom = {"custom_params": {"sglang_evict": policy}} if policy != {} else {}
        if kind == "generate":
            stream = rng.random() < 0.5
            sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
            sampling.update(custom)
            return (
                "/generate",
                {"text": f"{system} {question}", "sampling_params": sampling, "stream": stream},
                expect,
            )
        if kind == "completions":
            return (
                "/v1/completions",
                {
                    "model": "default",
                    "prompt": f"{system} {question}",
                    "max_tokens": new_tokens,
                    "temperature": 0,
                    "stream": True,
                    **custom,
                },
                expect,
            )
        if self.chats and rng.random() < 0.6:  # a follow-up turn of an open conversation
            messages = self.chats.pop(rng.randrange(len(self.chats)))
            messages = [*messages, {"role": "user", "content": question}]
        else:
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
        return (
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": messages,
                "max_tokens": min(new_tokens, CHAT_MAX_TOKENS),
                "temperature": 0,
                "stream": True,
                **custom,
            },
            expect,
        )

    def _extend_chat(self, body: dict, chunks: list[bytes]) -> None:
        text = []
        for chunk in chunks:
            try:
                delta = json.loads(chunk[5:])["choices"][0].get("delta", {})
            except (ValueError, KeyError, IndexError):
                continue
            text.append(delta.get("content") or "")
        # Conversations stay well inside the context: at most 4 turns, each answer cut
        # to CHAT_ANSWER_CHARS (a random-weight model's text re-tokenizes longer).
        answer = "".join(text)[:CHAT_ANSWER_CHARS]
        if len(body["messages"]) < 8 and len(self.chats) < 16:
            self.chats.append([*body["messages"], {"role": "assistant", "content": answer}])

    def _keep_for_replay(self, path: str, body: dict, payload: dict) -> None:
        if path == "/generate" and "output_ids" in payload:
            report = report_of(payload.get("meta_info") or {})
            self.greedy_done.append(
                {"body": body, "output_ids": payload["output_ids"], "report": report}
            )

    async def run_for(self, seconds: float, concurrency: int) -> None:
        import aiohttp

        deadline = time.monotonic() + seconds
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            running: set[asyncio.Task] = set()
            while time.monotonic() < deadline:
                while len(running) < concurrency:
                    running.add(asyncio.create_task(self.request(session)))
                _, running = await asyncio.wait(
                    running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED
                )
            if running:  # the drain: nothing new, every request ends or hits its deadline
                await asyncio.wait(running)
