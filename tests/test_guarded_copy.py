"""The guarded copy module (``sglang_evict_kernels.guarded_copy``): copies through a
shared mapping equal the descriptor path's bytes, and a file truncated under a mapping
makes a copy report the fault instead of killing the process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from compactor_service.shared_pool import PoolFile, create_shared_buffers
from sglang_evict_kernels import guarded_copy


@pytest.fixture(scope="module")
def module():
    loaded = guarded_copy.load()
    if loaded is None:
        pytest.skip(f"the guarded copy module did not build: {guarded_copy.why_not()}")
    return loaded


@contextlib.contextmanager
def mapped(module, path, data: np.ndarray):
    """``data`` written to ``path``, opened and mapped shared: ``(fd, addr)``."""
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    addr = module.map_shared(fd, data.size)
    try:
        yield fd, addr
    finally:
        module.unmap(addr, data.size)
        os.close(fd)


def test_runs_rows_in_and_rows_out_equal_numpy(module, tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    with mapped(module, tmp_path / "f", data) as (fd, addr):
        src, dst, lengths = [0, 4096, 9000], [20000, 30000, 40000], [100, 3000, 1]
        want = data.copy()
        for s, d, n in zip(src, dst, lengths, strict=True):
            want[d : d + n] = data[s : s + n]
        t = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        assert module.copy_runs(addr, data.size, t(src), t(dst), t(lengths))
        offsets = t([128, 0, 60000])
        out = torch.empty((3, 64), dtype=torch.uint8)
        assert module.gather_rows(addr, data.size, offsets, 64, out)
        got = np.frombuffer(os.pread(fd, data.size, 0), dtype=np.uint8)
        assert np.array_equal(got, want)
        assert np.array_equal(out.numpy(), np.stack([want[o : o + 64] for o in (128, 0, 60000)]))
        rows = torch.arange(128, dtype=torch.uint8).view(2, 64)
        assert module.scatter_rows(addr, data.size, t([64, 1024]), 64, rows)
        got = np.frombuffer(os.pread(fd, data.size, 0), dtype=np.uint8)
        assert np.array_equal(got[64:128], rows[0].numpy())
        with pytest.raises(RuntimeError, match="outside the mapping"):
            module.gather_rows(addr, data.size, t([data.size - 10]), 64, out[:1])


def test_copies_split_over_threads_equal_numpy(module, tmp_path):
    """Enough rows and runs for ATen's threads to share each copy (chunks of 256 KiB)."""
    data = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with mapped(module, tmp_path / "f", data) as (fd, addr):
            row = 384
            rng = np.random.default_rng(2)
            offsets = rng.choice((4 << 20) // row, 6000, replace=False).astype(np.int64) * row
            out = torch.empty((len(offsets), row), dtype=torch.uint8)
            assert module.gather_rows(addr, data.size, torch.from_numpy(offsets), row, out)
            assert np.array_equal(out.numpy(), np.stack([data[o : o + row] for o in offsets]))
            rows = torch.from_numpy(rng.integers(0, 256, out.shape, dtype=np.uint8))
            targets = offsets + (4 << 20)
            assert module.scatter_rows(addr, data.size, torch.from_numpy(targets), row, rows)
            want = data.copy()
            for o, r in zip(targets, rows.numpy(), strict=True):
                want[o : o + row] = r
            lengths = rng.integers(1, 2000, 3000).astype(np.int64)
            src = np.arange(3000, dtype=np.int64) * 2048  # below 6 MiB, runs apart
            dst = (6 << 20) + np.cumsum(np.concatenate([[0], lengths[:-1]]))  # packed, above
            keep = dst + lengths <= data.size
            src, dst, lengths = src[keep], dst[keep], lengths[keep]
            before = want.copy()
            for s, d, n in zip(src, dst, lengths, strict=True):
                want[d : d + n] = before[s : s + n]
            t = torch.from_numpy
            assert module.copy_runs(addr, data.size, t(src), t(dst), t(lengths))
            got = np.frombuffer(os.pread(fd, data.size, 0), dtype=np.uint8)
            assert np.array_equal(got, want)
    finally:
        torch.set_num_threads(threads)


def test_a_file_truncated_under_its_mapping_fails_the_copy_not_the_process(module, tmp_path):
    """In a child process (a real SIGBUS): the copy returns False, and a later SIGBUS
    outside any copy still ends the process as SIGBUS does."""
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from sglang_evict_kernels import guarded_copy
        m = guarded_copy.load()
        fd = os.open({str(tmp_path / "g")!r}, os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, 1 << 20)
        addr = m.map_shared(fd, 1 << 20)
        os.ftruncate(fd, 4096)
        out = torch.empty((1, 64), dtype=torch.uint8)
        offsets = torch.tensor([1 << 19], dtype=torch.int64)
        print("gather", m.gather_rows(addr, 1 << 20, offsets, 64, out), flush=True)
        runs = torch.tensor([1 << 19], dtype=torch.int64)
        print("copy", m.copy_runs(addr, 1 << 20, torch.tensor([0]), runs,
              torch.tensor([64])), flush=True)
        # Many chunks on ATen's threads: the faults land on worker threads too.
        torch.set_num_threads(2)
        n = 4096
        big = torch.arange(n, dtype=torch.int64) * 256
        rows = torch.empty((n, 256), dtype=torch.uint8)
        print("gather", m.gather_rows(addr, 1 << 20, big, 256, rows), flush=True)
        print("scatter", m.scatter_rows(addr, 1 << 20, big, 256, rows), flush=True)
        lengths = torch.full((n // 2,), 256, dtype=torch.int64)
        print("copy", m.copy_runs(addr, 1 << 20, big[: n // 2], big[n // 2 :], lengths),
              flush=True)
        print("alive", flush=True)
        signal.raise_signal(signal.SIGBUS)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    want = ["gather", "False", "copy", "False", "gather", "False", "scatter", "False"]
    assert result.stdout.split() == [*want, "copy", "False", "alive"], result.stderr
    assert result.returncode == -7  # SIGBUS: passed on to the default action


def test_a_pool_file_copies_the_same_bytes_mapped_as_through_its_descriptor(module, tmp_path):
    shared = create_shared_buffers(
        num_layers=2,
        num_slots=256,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.bfloat16,
        page_size=4,
        directory=tmp_path / "pools",
    )
    generator = torch.Generator().manual_seed(1)
    for buffer in shared.k + shared.v:
        buffer.copy_(torch.randn(buffer.shape, generator=generator).bfloat16())
    src = torch.tensor([200, 201, 202, 90, 17], dtype=torch.int64)
    dst = torch.tensor([3, 4, 5, 60, 120], dtype=torch.int64)
    slots = torch.tensor([255, 0, 17, 18, 90], dtype=torch.int64)
    results = []
    for through_mapping in (False, True):
        before = [b.clone() for b in shared.k + shared.v]
        fd = os.open(shared.layout.k_buffers[0].shm_path, os.O_RDWR)
        pool = PoolFile(fd, shared.layout)
        if not through_mapping:
            pool.mapping.ready = lambda: False  # the descriptor path
        assert pool.kernel == ("guarded-mapping" if through_mapping else "pread-pwrite")
        read = [pool.read_tokens(i, slots).clone() for i in range(4)]
        reused = torch.full_like(read[0], float("nan"))  # a buffer a caller reuses
        for i in (1, 3):
            assert pool.read_tokens(i, slots, out=reused) is reused
            assert torch.equal(reused, read[i])
        pool.copy_slots(src, dst)
        results.append(([b.clone() for b in shared.k + shared.v], read))
        pool.close()
        for buffer, saved in zip(shared.k + shared.v, before, strict=True):
            buffer.copy_(saved)
    (after_fd, read_fd), (after_map, read_map) = results
    assert all(torch.equal(a, b) for a, b in zip(after_fd, after_map, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(read_fd, read_map, strict=True))
    assert torch.equal(read_map[0], shared.k[0][slots])
    shared.close()


def test_a_dead_builds_lock_is_waited_for_while_fresh_then_removed(tmp_path, monkeypatch):
    """A build lock younger than ``stale_s`` is waited for (another process builds);
    an older one is removed (its build died), so no load waits forever."""
    from sglang_evict_kernels import _build

    lock = tmp_path / "lock"
    lock.touch()
    monkeypatch.setattr(
        "torch.utils.cpp_extension._get_build_directory", lambda name, verbose: str(tmp_path)
    )
    monkeypatch.setattr(_build, "POLL_S", 0.0)
    ages = []

    def clock_s():  # each look 20 s later: ages 30, 50, 70, 90, 110
        ages.append(30.0 + 20.0 * len(ages))
        return lock.stat().st_mtime + ages[-1]

    _build.clear_stale_lock("m", stale_s=100.0, clock_s=clock_s)
    assert not lock.exists() and ages[-1] == 110.0 and len(ages) == 5
    _build.clear_stale_lock("m", stale_s=100.0, clock_s=clock_s)  # no lock: returns at once


def test_a_built_module_loads_without_the_builders_lock(module):
    """Loading a built module takes no build lock: a lock left by a killed process
    (fresh or not) delays nothing."""
    from torch.utils.cpp_extension import _get_build_directory

    from sglang_evict_kernels import _build

    name = module.__name__
    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    open(lock, "w").close()
    try:
        loaded = _build.load_built(name)
        assert loaded is not None and loaded.__file__ == module.__file__
    finally:
        os.remove(lock)
    assert _build.load_built("sglang_evict_never_built_module") is None
    os.rmdir(_get_build_directory("sglang_evict_never_built_module", verbose=False))
