// Copies through a shared file's mapping that a truncation cannot turn into a crash.
//
// The compactor serves many clients' pools from one process. Reading or writing a file
// mapping past the end of a file its client truncated raises SIGBUS, which would kill
// the compactor and every other client's pool with it; a system call per row instead
// (pread/pwrite) costs more than the copy. So every copy here runs under a guard: the
// calling thread arms a sigjmp_buf, and the SIGBUS handler, for a fault on a thread
// whose guard is armed, jumps back out of the copy, which then reports the fault (the
// caller drops the pool). A SIGBUS anywhere else goes to the handler that was installed
// before (Python's faulthandler, or the default action). Bounds are checked against
// the mapped size before any byte is touched.
//
// A copy runs on ATen's intra-op threads (as the tier's quantizer beside it does), each
// chunk under its own thread's guard (``guarded_for``): a fault on one thread stops that
// chunk, the others finish theirs, and the call reports the fault.
//
// Held to the descriptor path (shared_pool.PoolFile's pread/pwrite) byte for byte by
// tests/test_guarded_copy.py.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include <sys/mman.h>

namespace sglang_evict_guard {
namespace {

// volatile, and fenced where it is set: the compiler must not drop or move the stores
// around the copies (it sees no read of them; the signal handler reads them).
thread_local sigjmp_buf* volatile armed = nullptr;

inline void arm(sigjmp_buf* env) {
  armed = env;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

inline void disarm() {
  std::atomic_signal_fence(std::memory_order_seq_cst);
  armed = nullptr;
}
struct sigaction previous_action;
std::once_flag installed;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (armed != nullptr) {
    sigjmp_buf* target = armed;
    armed = nullptr;
    siglongjmp(*target, 1);
  }
  // Not ours: hand it to whoever handled SIGBUS before.
  if (previous_action.sa_flags & SA_SIGINFO) {
    if (previous_action.sa_sigaction != nullptr) {
      previous_action.sa_sigaction(sig, info, context);
      return;
    }
  } else if (previous_action.sa_handler != SIG_IGN && previous_action.sa_handler != SIG_DFL &&
             previous_action.sa_handler != nullptr) {
    previous_action.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);
  raise(SIGBUS);
}

void install() {
  std::call_once(installed, [] {
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &previous_action) != 0) {
      throw std::runtime_error("sigaction(SIGBUS) failed");
    }
  });
}

void check_offsets(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dtype() == torch::kInt64 && t.dim() == 1 &&
                  t.is_contiguous(),
              name, " must be a contiguous 1-D int64 CPU tensor");
}

// Chunks of about this many bytes a thread.
constexpr int64_t kChunkBytes = 256 << 10;

// ``body(begin, end)`` over [begin, end) under this thread's guard; a SIGBUS inside it
// sets ``faulted``. ``body`` touches memory only (no allocation, nothing with a
// destructor): the jump back skips whatever it was doing.
template <typename Body>
void run_guarded(int64_t begin, int64_t end, const Body& body, std::atomic<bool>& faulted) {
  sigjmp_buf env;
  if (sigsetjmp(env, 1) != 0) {
    faulted.store(true);  // the handler jumped back: disarmed already
    return;
  }
  arm(&env);
  body(begin, end);
  disarm();
}

// ``body`` over [0, n) in chunks of about ``kChunkBytes`` (``bytes_per_item`` each) on
// ATen's intra-op threads, each chunk guarded; false when any chunk faulted.
template <typename Body>
bool guarded_for(int64_t n, int64_t bytes_per_item, const Body& body) {
  std::atomic<bool> faulted{false};
  const int64_t grain = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, bytes_per_item));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    if (!faulted.load(std::memory_order_relaxed)) {
      run_guarded(begin, end, body, faulted);
    }
  });
  return !faulted.load();
}

}  // namespace

// Map ``length`` bytes of ``fd`` shared (read and write); returns the address.
int64_t map_shared(int64_t fd, int64_t length) {
  TORCH_CHECK(length > 0, "map_shared: length must be positive");
  void* addr = mmap(nullptr, static_cast<size_t>(length), PROT_READ | PROT_WRITE, MAP_SHARED,
                    static_cast<int>(fd), 0);
  TORCH_CHECK(addr != MAP_FAILED, "mmap failed: ", std::strerror(errno));
  install();
  return reinterpret_cast<int64_t>(addr);
}

void unmap(int64_t addr, int64_t length) {
  munmap(reinterpret_cast<void*>(addr), static_cast<size_t>(length));
}

// Within one mapping: for each run i, ``lengths[i]`` bytes from ``src[i]`` to ``dst[i]``
// (byte offsets; runs never overlap one another). Returns false on a SIGBUS (the file
// shrank under the copy: part of it may have landed).
bool copy_runs(int64_t addr, int64_t mapped_bytes, torch::Tensor src, torch::Tensor dst,
               torch::Tensor lengths) {
  check_offsets(src, "src");
  check_offsets(dst, "dst");
  check_offsets(lengths, "lengths");
  const int64_t n = src.numel();
  TORCH_CHECK(dst.numel() == n && lengths.numel() == n, "src, dst and lengths differ in length");
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  const int64_t* l = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(l[i] >= 0 && s[i] >= 0 && d[i] >= 0 && s[i] + l[i] <= mapped_bytes &&
                    d[i] + l[i] <= mapped_bytes,
                "copy_runs: run ", i, " lies outside the mapping");
  }
  char* base = reinterpret_cast<char*>(addr);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    total += l[i];
  }
  return guarded_for(n, n ? std::max<int64_t>(1, total / n) : 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memmove(base + d[i], base + s[i], static_cast<size_t>(l[i]));
    }
  });
}

// Rows of ``row_bytes`` at byte ``offsets`` of the mapping into ``out`` (uint8
// [n, row_bytes]). Returns false on a SIGBUS.
bool gather_rows(int64_t addr, int64_t mapped_bytes, torch::Tensor offsets, int64_t row_bytes,
                 torch::Tensor out) {
  check_offsets(offsets, "offsets");
  const int64_t n = offsets.numel();
  TORCH_CHECK(out.device().is_cpu() && out.dtype() == torch::kUInt8 && out.is_contiguous() &&
                  out.numel() == n * row_bytes,
              "out must be a contiguous uint8 CPU tensor of n * row_bytes");
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(o[i] >= 0 && o[i] + row_bytes <= mapped_bytes, "gather_rows: row ", i,
                " lies outside the mapping");
  }
  const char* base = reinterpret_cast<const char*>(addr);
  char* dst = reinterpret_cast<char*>(out.data_ptr<uint8_t>());
  return guarded_for(n, row_bytes, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(dst + i * row_bytes, base + o[i], static_cast<size_t>(row_bytes));
    }
  });
}

// ``rows`` (uint8 [n, row_bytes]) written at byte ``offsets`` of the mapping. Returns
// false on a SIGBUS.
bool scatter_rows(int64_t addr, int64_t mapped_bytes, torch::Tensor offsets, int64_t row_bytes,
                  torch::Tensor rows) {
  check_offsets(offsets, "offsets");
  const int64_t n = offsets.numel();
  TORCH_CHECK(rows.device().is_cpu() && rows.dtype() == torch::kUInt8 && rows.is_contiguous() &&
                  rows.numel() == n * row_bytes,
              "rows must be a contiguous uint8 CPU tensor of n * row_bytes");
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(o[i] >= 0 && o[i] + row_bytes <= mapped_bytes, "scatter_rows: row ", i,
                " lies outside the mapping");
  }
  char* base = reinterpret_cast<char*>(addr);
  const char* src = reinterpret_cast<const char*>(rows.data_ptr<uint8_t>());
  return guarded_for(n, row_bytes, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(base + o[i], src + i * row_bytes, static_cast<size_t>(row_bytes));
    }
  });
}

}  // namespace sglang_evict_guard

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("map_shared", &sglang_evict_guard::map_shared, "mmap a file shared (address)");
  m.def("unmap", &sglang_evict_guard::unmap, "munmap a mapping of map_shared");
  m.def("copy_runs", &sglang_evict_guard::copy_runs, "runs copied within a mapping, guarded");
  m.def("gather_rows", &sglang_evict_guard::gather_rows, "rows read from a mapping, guarded");
  m.def("scatter_rows", &sglang_evict_guard::scatter_rows, "rows written to a mapping, guarded");
}
