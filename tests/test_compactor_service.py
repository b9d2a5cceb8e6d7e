"""The compactor sidecar as a real second process over a shared-memory KV pool.

Every test starts ``python -m compactor_service`` on a Unix socket, maps a CPU pool in
shared memory (the same path a CPU scheduler uses) and talks gRPC to it.
"""

from __future__ import annotations

import os
import stat

import grpc
import pytest
import torch

from compactor_service.client import (
    CompactionSkipped,
    CompactorUnavailable,
    FallbackCompactor,
    GrpcCompactor,
)
from compactor_service.compactor import InProcessCompactor
from compactor_service.health import check_health
from compactor_service.plan import CompactionPlan, PlanError
from compactor_service.runtime_dir import DEFAULT_POOL_DIR
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.v1 import compactor_pb2_grpc as pb_grpc
from compactor_service.wire import plan_to_proto
from sglang_evict.passes.planner import plan_compaction
from sglang_evict_kernels import repack_kv_reference
from tests.compactor_process import CompactorProcess, make_pool

PAGE = 4
LAYERS, SLOTS, HEADS, HEAD_DIM = 2, 64, 2, 8


@pytest.fixture(scope="module")
def compactor(tmp_path_factory):
    """One compactor for the tests that do not stop or kill it."""
    process = CompactorProcess(tmp_path_factory.mktemp("compactor")).start()
    yield process
    process.stop()


@pytest.fixture
def pool():
    shared = make_pool()
    yield shared
    shared.close()


def snapshot(shared) -> list[torch.Tensor]:
    return [b.clone() for b in shared.k + shared.v]


def two_request_plans() -> list[CompactionPlan]:
    """Request A holds pages 2..4, request B pages 6..8 (12 entries each); both evict
    scattered tokens so survivors of their last page move into holes."""
    plans = []
    for first_page in (2, 6):
        row = torch.arange(first_page * PAGE, (first_page + 3) * PAGE, dtype=torch.int64)
        survivors = torch.tensor([0, 2, 3, 5, 6, 9, 11])
        plans.append(plan_compaction(row, survivors, page_size=PAGE, positions=torch.arange(12)))
    return plans


def test_socket_is_private_and_health_is_serving(compactor):
    mode = stat.S_IMODE(os.stat(compactor.socket).st_mode)
    assert mode == 0o600, oct(mode)
    assert stat.S_IMODE(os.stat(compactor.socket.parent).st_mode) == 0o700
    assert check_health(compactor.target)
    with grpc.insecure_channel(compactor.target) as channel:
        stats = pb_grpc.CompactorStub(channel).Stats(pb.StatsRequest(), timeout=5)
    assert stats.pools == 0 and stats.epoch_base > 0


def test_compact_moves_bytes_in_the_schedulers_memory_bit_exactly(compactor, pool):
    plans = two_request_plans()
    assert sum(p.num_moves for p in plans) > 0
    expected = snapshot(pool)
    src = torch.cat([p.src_slots for p in plans])
    dst = torch.cat([p.dst_slots for p in plans])
    repack_kv_reference(expected[:LAYERS], expected[LAYERS:], src, dst)
    client = GrpcCompactor(compactor.target, pool.layout, timeout_s=10)
    result = client.compact(plans)
    assert result.slots_moved == src.numel()
    assert result.bytes_moved == 2 * src.numel() * 2 * LAYERS * HEADS * HEAD_DIM * 2
    for got, want in zip(pool.k + pool.v, expected, strict=True):
        assert torch.equal(got, want)
    client.close()


def _bad_plan(kind: str, plans: list[CompactionPlan]) -> list[CompactionPlan]:
    a, _ = plans
    fields = dict(vars(a))
    if kind == "slot out of range":
        fields["src_slots"] = a.src_slots.clone()
        fields["src_slots"][0] = SLOTS + 5
        return [CompactionPlan(**fields)]
    if kind == "slot moved twice":
        fields["dst_slots"] = torch.cat([a.dst_slots, a.dst_slots[:1]])
        fields["src_slots"] = torch.cat([a.src_slots, torch.tensor([a.new_row[-1].item() + 1])])
        return [CompactionPlan(**fields)]
    if kind == "destination in another request's row":
        page = int(a.dst_slots[0]) // PAGE  # B claims the page A writes into
        empty = torch.zeros(0, dtype=torch.int64)
        row = torch.arange(page * PAGE, (page + 1) * PAGE, dtype=torch.int64)
        intruder = CompactionPlan(PAGE, row, torch.arange(PAGE), empty, empty, empty, empty)
        return [a, intruder]
    if kind == "page structure broken":
        fields["new_row"] = a.new_row.flip(0)
        return [CompactionPlan(**fields)]
    if kind == "page size differs from the pool's":
        fields["page_size"] = 1
        return [CompactionPlan(**fields)]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("slot out of range", "outside [0, 64)"),
        ("slot moved twice", "dst_slots repeats"),
        ("destination in another request's row", "held by several rows of the batch"),
        ("page structure broken", "page offset"),
        ("page size differs from the pool's", "page_size 1 != the pool's 4"),
    ],
)
def test_invalid_plans_are_refused_precisely_and_move_nothing(compactor, pool, kind, message):
    client = GrpcCompactor(compactor.target, pool.layout, timeout_s=10)
    client.register()
    before = snapshot(pool)
    with pytest.raises(PlanError, match="the compactor refused the pass") as refused:
        client.compact(_bad_plan(kind, two_request_plans()))
    assert message in str(refused.value)
    assert all(torch.equal(x, y) for x, y in zip(pool.k + pool.v, before, strict=True))
    client.close()


def test_unknown_pool_and_stale_epoch_get_their_status_codes(compactor, pool):
    client = GrpcCompactor(compactor.target, pool.layout, timeout_s=10)
    pool_id, epoch = client.register()
    before = snapshot(pool)
    plans = [plan_to_proto(p) for p in two_request_plans()]
    with grpc.insecure_channel(compactor.target) as channel:
        stub = pb_grpc.CompactorStub(channel)
        for request, code, text in (
            (pb.CompactRequest(pool_id="nope", epoch=epoch, plans=plans), "NOT_FOUND", "nope"),
            (
                pb.CompactRequest(pool_id=pool_id, epoch=epoch - 1, plans=plans),
                "FAILED_PRECONDITION",
                "stale",
            ),
        ):
            with pytest.raises(grpc.RpcError) as error:
                stub.Compact(request, timeout=5)
            assert error.value.code().name == code and text in error.value.details()
    assert all(torch.equal(x, y) for x, y in zip(pool.k + pool.v, before, strict=True))
    client.close()


def test_a_missing_shared_memory_file_is_refused_at_registration(compactor, pool):
    pool.close()  # the file is gone
    client = GrpcCompactor(compactor.target, pool.layout, timeout_s=10)
    with pytest.raises(ValueError, match=r"refused the pool \(NOT_FOUND\).*does not exist"):
        client.register()


def test_restarted_compactor_gives_a_new_epoch_and_the_client_re_registers(tmp_path, pool):
    process = CompactorProcess(tmp_path).start()
    try:
        client = GrpcCompactor(process.target, pool.layout, timeout_s=10)
        _, first_epoch = client.register()
        process.kill()
        with pytest.raises(CompactorUnavailable, match="UNAVAILABLE"):
            client.compact(two_request_plans())
        process.start()
        grpc.channel_ready_future(client._raw_channel).result(timeout=30)  # reconnected
        result = client.compact(two_request_plans())  # re-registers: unknown pool, then retry
        assert result.slots_moved > 0 and client.epoch > first_epoch
        client.close()
    finally:
        process.stop()


class SlowHandshakeProxy:
    """A Unix socket in front of the compactor's that waits ``delay_s`` after accepting
    a connection before it connects through: a sidecar slow to answer a connection, as
    a loaded host's is (its HTTP/2 SETTINGS frame comes late)."""

    def __init__(self, target_socket, delay_s: float) -> None:
        import socket
        import tempfile
        import threading

        self.dir = tempfile.mkdtemp(prefix="slow-")  # a socket path holds 107 bytes
        self.path = os.path.join(self.dir, "proxy.sock")
        self.target_socket, self.delay_s = str(target_socket), delay_s
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"unix:{self.path}"

    def _accept(self) -> None:
        import socket
        import threading
        import time

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            time.sleep(self.delay_s)
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.target_socket)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source, sink) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(2)
                except OSError:
                    pass

    def close(self) -> None:
        import shutil

        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_a_sidecar_slow_to_answer_a_connection_still_gets_the_pass(compactor, pool):
    """A connection the sidecar answers late (400 ms: a loaded host) is waited for
    within the call's deadline: the client registers and the pass moves its slots. With
    gRPC's minimum connect timeout cut to 100 ms (the channel option
    ``grpc.min_reconnect_backoff_ms``), registration failed at once with UNAVAILABLE
    and the scheduler completed its passes in-process from then on."""
    proxy = SlowHandshakeProxy(compactor.socket, delay_s=0.4)
    try:
        client = GrpcCompactor(proxy.target, pool.layout, timeout_s=10)
        result = client.compact(two_request_plans())
        assert result.slots_moved > 0 and proxy.connections >= 1
        client.close()
    finally:
        proxy.close()


def test_sigterm_drains_then_exits_zero_and_removes_the_socket(tmp_path):
    process = CompactorProcess(tmp_path).start()
    assert process.stop() == 0
    assert not process.socket.exists()
    messages = [e["msg"] for e in process.log_entries()]
    assert messages[-2:] == ["shutdown requested", "compactor stopped"]


# tgkill(2)'s number: the only way to send a signal to one thread of another process.
TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


@pytest.mark.skipif(TGKILL is None, reason="tgkill's syscall number is known for x86-64/arm64")
def test_sigterm_delivered_to_a_grpc_thread_still_drains_and_exits(tmp_path):
    """The kernel may hand a process's SIGTERM to any of its threads; Python runs the
    handler in the main thread only when that thread next runs bytecode, so a main
    thread asleep in an untimed wait never drains (kubelet's SIGTERM ignored until its
    SIGKILL). Sent here to a thread that is not the main one, as tgkill does."""
    import ctypes
    import signal
    import time

    process = CompactorProcess(tmp_path).start()
    pid = process.process.pid
    threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid]
    assert threads, "the serving compactor runs gRPC threads beside its main thread"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(TGKILL, pid, threads[-1], signal.SIGTERM) == 0
    start = time.monotonic()
    assert process.process.wait(15) == 0
    assert time.monotonic() - start < 10
    assert [e["msg"] for e in process.log_entries()][-2:] == [
        "shutdown requested",
        "compactor stopped",
    ]


def test_tcp_listener_only_when_asked(tmp_path):
    from tests.redis_server import free_port

    port = free_port()
    process = CompactorProcess(tmp_path, "--tcp", f"127.0.0.1:{port}").start()
    assert check_health(f"127.0.0.1:{port}")
    process.stop()
    default = CompactorProcess(tmp_path / "default").start()
    assert not check_health(f"127.0.0.1:{port}", timeout_s=0.5)
    default.stop()


def test_fallback_completes_the_pass_in_process_when_the_sidecar_dies(tmp_path, pool):
    process = CompactorProcess(tmp_path).start()
    expected = snapshot(pool)
    plans = two_request_plans()
    src = torch.cat([p.src_slots for p in plans])
    dst = torch.cat([p.dst_slots for p in plans])
    repack_kv_reference(expected[:LAYERS], expected[LAYERS:], src, dst)
    fallback = InProcessCompactor(pool.k, pool.v, page_size=PAGE)
    compactor = FallbackCompactor(
        GrpcCompactor(process.target, pool.layout, timeout_s=5), fallback, retry_interval_s=60
    )
    process.kill()
    result = compactor.compact(plans)
    assert compactor.fallback_passes == 1 and not compactor.sidecar_up
    assert result.kernel == "torch-reference"
    assert all(torch.equal(x, y) for x, y in zip(pool.k + pool.v, expected, strict=True))
    skipping = FallbackCompactor(
        GrpcCompactor(process.target, pool.layout, timeout_s=5),
        fallback,
        mode="skip",
        retry_interval_s=60,
    )
    skipping.compact(plans)  # the failure that marks the sidecar down completes in-process
    with pytest.raises(CompactionSkipped, match="pass skipped, nothing moved"):
        skipping.compact(plans)


def test_metrics_show_the_sidecar_down_and_count_fallbacks(tmp_path, pool):
    from prometheus_client import CollectorRegistry

    from sglang_evict import metrics as metric_names
    from sglang_evict.metrics import EvictionMetrics

    registry = CollectorRegistry()
    recorder = EvictionMetrics.create("knorm", registry=registry)
    nowhere = f"unix:{tmp_path / 'absent.sock'}"
    compactor = FallbackCompactor(
        GrpcCompactor(nowhere, pool.layout, timeout_s=1),
        InProcessCompactor(pool.k, pool.v, page_size=PAGE),
        retry_interval_s=60,
    )
    recorder.record_compactor(compactor)
    assert registry.get_sample_value(metric_names.COMPACTOR_UP) == 1
    compactor.compact(two_request_plans())
    compactor.compact(two_request_plans())
    recorder.record_compactor(compactor)
    recorder.record_compactor(compactor)  # counts each fallback once
    assert registry.get_sample_value(metric_names.COMPACTOR_UP) == 0
    fallbacks = metric_names.COMPACTOR_FALLBACKS_TOTAL
    assert registry.get_sample_value(fallbacks, {"mode": "inprocess"}) == 2


def test_a_pass_whose_caller_stopped_waiting_moves_nothing(pool):
    """Checked once the pass's turn has come, right before the kernel: a caller that
    gave up may be completing the pass in-process, so a late copy must not start."""
    from compactor_service.compactor import PassAbandoned
    from compactor_service.engine import CompactorEngine
    from compactor_service.shared_pool import PoolDirectory

    engine = CompactorEngine(pool_dir=PoolDirectory(DEFAULT_POOL_DIR))
    pool_id, epoch = engine.register_pool(pool.layout, "test")
    before = snapshot(pool)
    with pytest.raises(PassAbandoned, match="nothing moved"):
        engine.compact(pool_id, epoch, two_request_plans(), still_wanted=lambda: False)
    assert all(torch.equal(x, y) for x, y in zip(pool.k + pool.v, before, strict=True))
    assert engine.compact(pool_id, epoch, two_request_plans(), still_wanted=lambda: True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (not in CI)")
def test_gpu_pool_is_mapped_by_cuda_ipc_and_compacted_bit_exactly(compactor):
    """GPU only: the sidecar opens the scheduler's CUDA buffers by IPC handle once and
    its Triton repack writes them in place; the reply comes after its kernel finished."""
    from compactor_service.cuda_ipc import export_cuda_buffers

    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (SLOTS, HEADS, HEAD_DIM)
    k = [torch.randn(shape, device="cuda", generator=generator).bfloat16() for _ in range(2)]
    v = [torch.randn(shape, device="cuda", generator=generator).bfloat16() for _ in range(2)]
    plans = two_request_plans()
    expected_k, expected_v = [b.clone() for b in k], [b.clone() for b in v]
    src = torch.cat([p.src_slots for p in plans])
    dst = torch.cat([p.dst_slots for p in plans])
    repack_kv_reference(expected_k, expected_v, src.cuda(), dst.cuda())
    client = GrpcCompactor(compactor.target, export_cuda_buffers(k, v, PAGE), timeout_s=30)
    result = client.compact(plans)
    assert result.kernel == "triton" and result.slots_moved == src.numel()
    for got, want in zip(k + v, expected_k + expected_v, strict=True):
        assert torch.equal(got, want)
    client.close()
