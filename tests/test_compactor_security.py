"""One test per security point of the compactor, against a real server process:
no pickle on the wire, only pool files of its private pool directory are mapped, CUDA
pools need CUDA, and insecure directories are refused at start-up."""

from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from compactor_service.cuda_ipc import HANDLE_TYPE_CUDA_MALLOC, HANDLE_VERSION, MEM_HANDLE_BYTES
from compactor_service.shared_pool import (
    PoolLayout,
)
from compactor_service.v1 import compactor_pb2 as pb
from compactor_service.wire import layout_to_proto
from tests.compactor_process import ROOT, CompactorProcess, call, make_pool

LAYERS, SLOTS, HEADS, HEAD_DIM, PAGE = 2, 64, 2, 8, 4


@pytest.fixture(scope="module")
def pool_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("security") / "pools"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture(scope="module")
def compactor(tmp_path_factory, pool_dir):
    process = CompactorProcess(tmp_path_factory.mktemp("compactor"), pool_dir=str(pool_dir))
    yield process.start()
    process.stop()


@pytest.fixture
def pool(pool_dir):
    shared = make_pool(str(pool_dir))
    yield shared
    shared.close()


def register(compactor, layout: PoolLayout | pb.PoolLayout | bytes):
    if isinstance(layout, PoolLayout):
        layout = layout_to_proto(layout)
    if isinstance(layout, bytes):
        request = pb.RegisterPoolRequest(client_id="security").SerializeToString()
        request += b"\x0a" + _varint(len(layout)) + layout  # field 1: the layout bytes
    else:
        request = pb.RegisterPoolRequest(layout=layout, client_id="security")
    return call(compactor.target, "RegisterPool", request)


def _varint(value: int) -> bytes:
    out = b""
    while True:
        byte, value = value & 0x7F, value >> 7
        out += bytes([byte | (0x80 if value else 0)])
        if not value:
            return out


def with_file(layout: PoolLayout, path: str) -> PoolLayout:
    def moved(handles):
        return tuple(replace(h, shm_path=path) for h in handles)

    return replace(layout, k_buffers=moved(layout.k_buffers), v_buffers=moved(layout.v_buffers))


class _Evil:
    """Unpickling this object creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _cuda_layout(mem_handle: bytes) -> pb.PoolLayout:
    buffer_bytes = SLOTS * HEADS * HEAD_DIM * 2
    handle = pb.BufferHandle(
        cuda=pb.CudaIpcBuffer(
            mem_handle=mem_handle, storage_offset_bytes=0, storage_size_bytes=buffer_bytes
        )
    )
    return pb.PoolLayout(
        num_layers=LAYERS,
        num_slots=SLOTS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        page_size=PAGE,
        device=pb.DEVICE_CUDA,
        k_buffers=[handle] * LAYERS,
        v_buffers=[handle] * LAYERS,
    )


def _old_wire_layout(payload: bytes) -> bytes:
    """A CUDA layout in the early wire format: each buffer's export as opaque bytes in
    BufferHandle field 3."""
    handle = b"\x1a" + _varint(len(payload)) + payload
    entry = _varint(len(handle)) + handle
    layout = _cuda_layout(b"")
    del layout.k_buffers[:]
    del layout.v_buffers[:]
    raw = layout.SerializeToString()
    for tag in (b"\x4a", b"\x52"):  # fields 9 (k_buffers) and 10 (v_buffers)
        raw += (tag + entry) * LAYERS
    return raw


def test_a_pickle_payload_is_refused_and_never_unpickled(compactor, tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Evil(marker))
    pickle.loads(payload)  # the payload works: unpickling it creates the marker
    assert marker.exists()
    marker.unlink()
    attempts = {
        "field 3 of a buffer handle": register(compactor, _old_wire_layout(payload)),
        "cuda.mem_handle": register(compactor, _cuda_layout(payload)),
    }
    plan = pb.Plan(**{f"{name}_le64": payload for name in ("new_row", "src_slots")})
    attempts["plan arrays"] = call(
        compactor.target, "Compact", pb.CompactRequest(pool_id="p", plans=[plan])
    )
    for method in ("RegisterPool", "Compact", "Heartbeat", "UnregisterPool", "Stats"):
        attempts[f"{method} body"] = call(compactor.target, method, payload)
    for where, (code, details, _) in attempts.items():
        if where != "Stats body":  # Stats has no field: its body parses or not, nothing else
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), where
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (where, details)
    assert "field 3" not in attempts["field 3 of a buffer handle"][1]
    assert "needs its cuda export" in attempts["field 3 of a buffer handle"][1]
    assert f"expected {MEM_HANDLE_BYTES}" in attempts["cuda.mem_handle"][1]
    assert not marker.exists()


def test_no_compactor_module_can_unpickle():
    """No module of the compactor imports pickle (or a module that unpickles on load)."""
    banned = {"pickle", "cPickle", "dill", "cloudpickle", "multiprocessing.reduction"}
    for path in sorted((ROOT / "compactor_service").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not banned & set(names), f"{path.name} imports {names}"


def test_the_proto_carries_cuda_ipc_handles_as_explicit_fields():
    cuda = pb.CudaIpcBuffer.DESCRIPTOR.fields_by_name
    assert {name: field.type for name, field in cuda.items()} == {
        "mem_handle": cuda["mem_handle"].TYPE_BYTES,
        "storage_offset_bytes": cuda["storage_offset_bytes"].TYPE_UINT64,
        "storage_size_bytes": cuda["storage_size_bytes"].TYPE_UINT64,
        "tensor_offset": cuda["tensor_offset"].TYPE_UINT64,
    }
    handle = pb.BufferHandle.DESCRIPTOR
    assert handle.fields_by_name["cuda"].message_type is pb.CudaIpcBuffer.DESCRIPTOR
    assert 3 not in handle.fields_by_number and "cuda_ipc" not in handle.fields_by_name
    for name in ("num_slots", "num_kv_heads", "head_dim", "dtype", "device_index"):
        assert name in pb.PoolLayout.DESCRIPTOR.fields_by_name


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_a_cuda_pool_is_refused_on_a_host_without_cuda(compactor):
    well_formed = bytes([HANDLE_VERSION, HANDLE_TYPE_CUDA_MALLOC]) + bytes(64)
    code, details, _ = register(compactor, _cuda_layout(well_formed))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no CUDA device" in details


def _victim(tmp_path: Path, size: int) -> Path:
    victim = tmp_path / "ordinary-file"
    victim.write_bytes(b"precious" * (size // 8))
    return victim


def _refusal_setup(case: str, pool, pool_dir: Path, tmp_path: Path) -> tuple[str, Path | None]:
    """(shm_path to register, a file whose bytes must not change)."""
    size = pool.layout.file_bytes
    name = "sglang-evict-kv-1-0123456789ab"
    victim = _victim(tmp_path, size)
    if case == "ordinary file outside the pool directory":
        return str(victim), victim
    if case == "path escaping the pool directory":
        return f"{pool_dir}/../{victim.parent.name}/{victim.name}", victim
    if case == "symlink in the pool directory":
        (pool_dir / name).symlink_to(victim)
        return str(pool_dir / name), victim
    if case == "hard link in the pool directory":
        os.link(pool.path, pool_dir / name)
        return str(pool_dir / name), pool.path
    if case == "file not named as a pool file":
        (pool_dir / "notes.txt").write_bytes(bytes(size))
        return str(pool_dir / "notes.txt"), pool_dir / "notes.txt"
    if case == "file of someone else":
        (pool_dir / name).write_bytes(bytes(size))
        os.chown(pool_dir / name, 65534, 65534)
        return str(pool_dir / name), pool_dir / name
    if case == "file of the wrong size":
        (pool_dir / name).write_bytes(bytes(size + 4096))
        return str(pool_dir / name), pool_dir / name
    if case == "directory":
        (pool_dir / name).mkdir()
        return str(pool_dir / name), None
    if case == "missing file":
        return str(pool_dir / name), None
    raise AssertionError(case)


FILE_REFUSALS = {
    "ordinary file outside the pool directory": ("PERMISSION_DENIED", "not in the compactor"),
    "path escaping the pool directory": ("PERMISSION_DENIED", "not in the compactor"),
    "symlink in the pool directory": ("PERMISSION_DENIED", "cannot be opened"),
    "hard link in the pool directory": ("PERMISSION_DENIED", "has 2 links"),
    "file not named as a pool file": ("PERMISSION_DENIED", "is not a pool file"),
    "file of someone else": ("PERMISSION_DENIED", "owned by uid 65534"),
    "file of the wrong size": ("INVALID_ARGUMENT", "needs exactly"),
    "directory": ("INVALID_ARGUMENT", "is a directory"),
    "missing file": ("NOT_FOUND", "does not exist"),
}


@pytest.mark.parametrize("case", sorted(FILE_REFUSALS))
def test_only_pool_files_of_the_pool_directory_are_mapped(
    case, compactor, pool, pool_dir, tmp_path
):
    if case == "file of someone else" and os.geteuid() != 0:
        pytest.skip("creating a file of another uid needs root")
    shm_path, protected = _refusal_setup(case, pool, pool_dir, tmp_path)
    before = protected.read_bytes() if protected else None
    try:
        code, details, _ = register(compactor, with_file(pool.layout, shm_path))
    finally:
        for leftover in pool_dir.glob("sglang-evict-kv-1-*"):
            leftover.rmdir() if leftover.is_dir() else leftover.unlink()
        (pool_dir / "notes.txt").unlink(missing_ok=True)
    expected_code, expected_text = FILE_REFUSALS[case]
    assert code.name == expected_code and expected_text in details, details
    if protected is not None and protected.exists():
        assert protected.read_bytes() == before
    # The pool's real file maps: the refusal is the case's, not the layout's.
    code, _, reply = register(compactor, pool.layout)
    assert code == grpc.StatusCode.OK
    registered = pb.RegisterPoolResponse.FromString(reply)
    request = pb.UnregisterPoolRequest(pool_id=registered.pool_id, epoch=registered.epoch)
    assert call(compactor.target, "UnregisterPool", request)[0] == grpc.StatusCode.OK


def _start(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compactor_service", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"},
    )


INSECURE_DIRECTORIES = {
    "socket directory writable by others": ("--socket", 0o777, None, "chmod 700"),
    "socket directory writable by its group": ("--socket", 0o770, None, "chmod 700"),
    "socket directory of another user": ("--socket", 0o700, 65534, "owned by uid 65534"),
    "pool directory writable by others": ("--pool-dir", 0o777, None, "chmod 700"),
    "pool directory of another user": ("--pool-dir", 0o700, 65534, "owned by uid 65534"),
}


@pytest.mark.parametrize("case", sorted(INSECURE_DIRECTORIES))
def test_an_insecure_directory_is_refused_at_start(case, tmp_path):
    flag, mode, owner, fix = INSECURE_DIRECTORIES[case]
    if owner is not None and os.geteuid() != 0:
        pytest.skip("a directory of another uid needs root")
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(mode)
    if owner is not None:
        os.chown(directory, owner, owner)
    flags = {"--socket": str(tmp_path / "sock" / "c.sock"), "--pool-dir": str(tmp_path / "pools")}
    flags[flag] = str(directory / "c.sock") if flag == "--socket" else str(directory)
    result = _start(*(item for pair in flags.items() for item in pair))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert flag in lines[0] and fix in lines[0] and str(directory) in lines[0]
    assert not (directory / "c.sock").exists()


def test_a_symlinked_socket_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    result = _start("--socket", str(tmp_path / "link" / "c.sock"), "--pool-dir", str(real))
    assert result.returncode == 2 and "symlink" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
