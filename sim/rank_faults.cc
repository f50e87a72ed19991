#include "sim/rank_faults.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/progress.h"
#include "sim/stack_pool.h"

namespace ranklab::sim {

namespace {

thread_local int tl_running_rank = -1;
thread_local bool tl_guarded = false;  // this thread runs a world's fibers now

// The guard pages of the world that runs now; one world runs at a time per process under the handler
// (a second concurrent world simply gets no names for its faults).
std::atomic<const StackPool*> g_pool{nullptr};
std::atomic<std::size_t> g_stack_bytes{0};

struct sigaction g_previous_segv;
std::once_flag g_installed;

void write_all(const char* text, std::size_t n) {
  while (n > 0) {
    ssize_t w = ::write(STDERR_FILENO, text, n);
    if (w <= 0) return;
    text += w;
    n -= static_cast<std::size_t>(w);
  }
}

void on_segv(int sig, siginfo_t* info, void* context) {
  const StackPool* pool = g_pool.load();
  const int rank = (pool != nullptr && info != nullptr) ? pool->guard_page_owner(info->si_addr) : -1;
  if (rank >= 0) {
    // The process is ending; what it printed goes out first (print() flushes per line, so this only
    // matters for output written otherwise).
    std::fflush(stdout);
    char text[512];
    const int n = std::snprintf(text, sizeof text,
                                "ranklab: error: rank %d: stack overflow: the fiber's stack of %zu KiB was "
                                "exceeded; raise it with --stack-kib N\n",
                                rank, g_stack_bytes.load() / 1024);
    if (n > 0) write_all(text, static_cast<std::size_t>(n) < sizeof text ? n : sizeof text - 1);
    _exit(1);
  }
  // Not ours: whatever handled SIGSEGV before handles it now; the fault happens again on return.
  if (g_previous_segv.sa_flags & SA_SIGINFO) {
    if (g_previous_segv.sa_sigaction != nullptr) {
      g_previous_segv.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous_segv.sa_handler != SIG_DFL && g_previous_segv.sa_handler != SIG_IGN) {
    g_previous_segv.sa_handler(sig);
    return;
  }
  signal(SIGSEGV, SIG_DFL);
}

void on_exit() {
  if (!tl_guarded || tl_running_rank < 0) return;
  // exit() from inside a rank would destroy the objects the other fibers still use and never return.
  die(fmt::format(
      "rank {} called exit() inside its program; a rank ends by returning (or throwing), not by ending the "
      "process, since the other ranks still run",
      tl_running_rank));
}

void install_once() {
  struct sigaction action {};
  action.sa_sigaction = on_segv;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &g_previous_segv);
}

// The handler runs on a stack of its own: the fiber's stack is the one that has no room left.
constexpr std::size_t kAltStackBytes = 64 * 1024;

}  // namespace

int running_rank() {
  return tl_running_rank;
}
void set_running_rank(int rank) {
  tl_running_rank = rank;
}

void die(const std::string& message) {
  Progress::erase_shown();
  std::fflush(stdout);
  std::fprintf(stderr, "ranklab: error: %s\n", message.c_str());
  std::fflush(stderr);
  _exit(1);
}

std::string stack_overflow_message(int rank, std::size_t stack_bytes) {
  return fmt::format(
      "rank {}: stack overflow: the fiber's stack of {} KiB was exceeded; raise it with --stack-kib N", rank,
      stack_bytes / 1024);
}

RankFaultGuard::RankFaultGuard(const StackPool* pool, std::size_t stack_bytes) {
  std::call_once(g_installed, install_once);
  tl_guarded = true;
  tl_running_rank = -1;
  g_stack_bytes = stack_bytes;
  g_pool = pool;
  // One alternate signal stack per thread that runs fibers, kept for the thread's life. Made after the
  // fiber scheduler (so its destructor runs before Boost.Fiber's at exit()).
  struct AltStack {
    AltStack() {
      void* p = mmap(nullptr, kAltStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return;
      stack_t ss{};
      ss.ss_sp = p;
      ss.ss_size = kAltStackBytes;
      if (sigaltstack(&ss, nullptr) == 0) {
        base = p;
      } else {
        munmap(p, kAltStackBytes);
      }
    }
    ~AltStack() {
      // exit() runs the calling thread's thread_local destructors first, newest first: this one comes
      // before Boost.Fiber's, whose teardown under running fibers would never return.
      on_exit();
      if (base == nullptr) return;
      stack_t ss{};
      ss.ss_flags = SS_DISABLE;
      sigaltstack(&ss, nullptr);
      munmap(base, kAltStackBytes);
    }
    void* base = nullptr;
  };
  thread_local AltStack alt;
  (void)alt;
}

RankFaultGuard::~RankFaultGuard() {
  tl_guarded = false;
  tl_running_rank = -1;
  g_pool = nullptr;
}

}  // namespace ranklab::sim
