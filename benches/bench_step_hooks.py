"""Host time the plugin's decode-step hooks cost the scheduler, per decode step, with
``--running`` requests in the batch and a number of them due: what SGLang's decode step
feels of eviction, all of it on the host, side by side in one run.

Each step runs what the two hooks run in a server (``sglang_evict.srt.hooks``): the
scan of the running requests for due passes, the batched pass replayed (a CUDA graph
per shape on a GPU; off CUDA the capture is emulated), the shrink of the batch's
lengths, the Prometheus metrics of the pass, and the decode positions. Rows:

    budget off     every request's eviction off (``{"enabled": false}``): the scan only
    evicting, 0    every request between two passes, compacted by an earlier one (no
                   pass this step; the positions carry their offsets)
    evicting, k    k of the requests due: one pass of k requests

Off CUDA the emulated replay runs the pass's device work on the host: ``outside ms``
leaves it out, the host's share around a real replay. ``pass ms`` is the part inside
``run_batch_pass`` (what the server's pass-duration histogram records); the rest is
the scan, the shrink, the metrics and the positions. Nothing is asserted about time.

    python3 benches/bench_step_hooks.py                      # CPU, one torch thread
    python3 benches/bench_step_hooks.py --device cuda        # GPU: host time, no synchronise
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path[:0] = [
    os.path.join(os.path.dirname(__file__), ".."),
    os.path.join(os.path.dirname(__file__), "..", "kernels"),
]

from bench_pass import (  # noqa: E402
    PROMPT_TOKENS,
    add_pool_arguments,
    fill_rows,
    replay_manager,
    setup,
    sync,
)

from sglang_evict.metrics import EvictionMetrics  # noqa: E402
from sglang_evict.passes.state import RequestState  # noqa: E402
from sglang_evict.request_policy import RequestPolicy  # noqa: E402
from sglang_evict.srt.active import Active  # noqa: E402
from sglang_evict.srt.hooks import (  # noqa: E402
    _after_forward_batch_init_new,
    compact_decode_batch,
)
from sglang_evict.srt.request_policy import POLICY_ATTR  # noqa: E402


class _KV:
    """A request's KV bookkeeping, under both supported releases' names."""

    def __init__(self, row: int, kv_len: int) -> None:
        self.req_pool_idx = row
        self.kv_committed_len = kv_len
        self.kv_allocated_len = kv_len
        self.cache_protected_len = PROMPT_TOKENS


class BenchReq:
    """The fields of SGLang's ``Req`` the hooks read (0.5.17 keeps three of them on the
    request itself, 0.5.23 on ``req.kv``: both are served)."""

    def __init__(self, row: int, kv_len: int, policy: RequestPolicy | None) -> None:
        self.rid = f"r{row}"
        self.kv = _KV(row, kv_len)
        self.decode_batch_idx = 2
        self.origin_input_ids = list(range(PROMPT_TOKENS))
        setattr(self, POLICY_ATTR, policy)

    req_pool_idx = property(lambda self: self.kv.req_pool_idx)
    cache_protected_len = property(lambda self: self.kv.cache_protected_len)

    @property
    def kv_committed_len(self) -> int:
        return self.kv.kv_committed_len

    @kv_committed_len.setter
    def kv_committed_len(self, value: int) -> None:
        self.kv.kv_committed_len = value


@dataclasses.dataclass
class BenchBatch:
    """The fields of SGLang's ``ScheduleBatch`` the hooks read and replace."""

    reqs: list
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    orig_seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens_sum: int | None = None


class _Decode:
    @staticmethod
    def is_decode() -> bool:
        return True


@dataclasses.dataclass
class BenchForwardBatch:
    """The fields of SGLang's decode ``ForwardBatch`` the positions hook reads."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor  # SGLang's: seq_lens - 1
    forward_mode: _Decode = dataclasses.field(default_factory=_Decode)


def time_steps(args, due: int, enabled: bool) -> tuple[float, float, float]:
    """Median host ms per decode step (hooks only), outside the pass's device body, and
    inside ``run_batch_pass``; ``due`` of ``args.running`` requests due."""
    config, pool, kv_len = setup(args, args.budget, args.running)
    manager = replay_manager(args, config, pool, kv_len, args.running, replayed=True)
    policy = None if enabled else dataclasses.replace(manager.default_policy, enabled=False)
    between = args.budget + args.cadence // 2  # after a pass, before the next is due
    in_body, in_pass = [0.0], [0.0]
    body, run_batch_pass = manager._device_pass, manager.run_batch_pass

    def timed(function, total):
        def wrapped(*a, **k):
            started = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                total[0] += time.perf_counter() - started

        return wrapped

    manager._device_pass = timed(body, in_body)
    manager.run_batch_pass = timed(run_batch_pass, in_pass)
    metrics = EvictionMetrics.create(config.scorer, registry=_fresh_registry())
    saved = Active.metrics, Active.manager
    Active.metrics, Active.manager = metrics, manager
    device = torch.device(args.device)
    steps, outside, passes = [], [], []
    try:
        for repeat in range(args.repeats + 2):  # the first two capture
            fill_rows(pool, args.running, kv_len, args.page_size, seed=repeat % 3)
            manager.states.clear()
            manager.offsets_by_row.zero_()
            if enabled:  # the requests between two passes were compacted by an earlier one
                for r in range(due, args.running):
                    manager.states[f"r{r}"] = RequestState(
                        r, between, args.cadence, PROMPT_TOKENS, PROMPT_TOKENS
                    )
                manager.offsets_by_row[due : args.running] = args.cadence
            reqs = [
                BenchReq(r, kv_len if r < due else between, policy) for r in range(args.running)
            ]
            lens = torch.tensor([r.kv.kv_committed_len for r in reqs], dtype=torch.int64)
            batch = BenchBatch(
                reqs=reqs,
                seq_lens=lens.to(device),
                seq_lens_cpu=lens.clone(),
                orig_seq_lens=lens.to(device, torch.int32),
                req_pool_indices=torch.arange(args.running, device=device),
            )
            manager.decode_steps = -1  # the next step opens a pass step (group of 1)
            in_body[0] = in_pass[0] = 0.0
            sync(args.device)
            start = time.perf_counter()
            results = compact_decode_batch(manager, batch)
            elapsed = time.perf_counter() - start
            seq_lens = batch.seq_lens + 1  # SGLang's own work (not timed): its +1, its
            forward_batch = BenchForwardBatch(  # ForwardBatch with positions seq_lens - 1
                batch.req_pool_indices, seq_lens, (seq_lens - 1).clamp(min=0)
            )
            start = time.perf_counter()
            _after_forward_batch_init_new(forward_batch)
            elapsed += time.perf_counter() - start
            sync(args.device)
            assert len(results) == (due if enabled else 0)
            if repeat >= 2:
                steps.append(elapsed)
                on_host = args.device != "cuda" or manager.graphs.replays == 0
                outside.append(elapsed - (in_body[0] if on_host else 0.0))
                passes.append(in_pass[0] - (in_body[0] if on_host else 0.0))
    finally:
        Active.metrics, Active.manager = saved
    return tuple(statistics.median(v) * 1e3 for v in (steps, outside, passes))


def _fresh_registry():
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--due", type=int, nargs="+", default=[0, 1, 4, 16, 64])
    parser.add_argument("--budget", type=int, default=1024)
    add_pool_arguments(parser)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a tiny run (checks the script)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.running, args.due, args.budget, args.cadence, args.repeats = 4, [0, 2], 256, 32, 2
    if any(d > args.running for d in args.due):
        parser.error(f"--due values must be at most --running ({args.running})")
    torch.set_num_threads(args.threads)
    print(
        f"device {args.device}, {args.threads} torch thread(s), {args.running} running "
        f"requests, budget {args.budget}, cadence {args.cadence}, page size "
        f"{args.page_size}, {args.strategy}, knorm; host ms per decode step (hooks only), "
        f"median of {args.repeats}"
    )
    if args.device != "cuda":
        print(
            "(off CUDA the emulated replay runs the device body on the host: 'outside ms' "
            "leaves it out, the host's share around a real replay)"
        )
    print(f"{'mode':<13} {'due':>4} {'step ms':>9} {'outside ms':>11} {'pass ms':>9}")
    rows = [("budget off", 0, False)] + [("evicting", d, True) for d in args.due]
    for mode, due, enabled in rows:
        step_ms, outside_ms, pass_ms = time_steps(args, due, enabled)
        print(
            f"{mode:<13} {due:>4} {step_ms:>9.3f} {outside_ms:>11.3f} {pass_ms:>9.3f}", flush=True
        )


if __name__ == "__main__":
    main()
