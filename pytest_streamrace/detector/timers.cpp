// The detector's own timers, for benchmarks/profile_step.py: where the C++ time of a step goes, by part. Off unless
// `profile(True)` turns them on; off, a timed site costs one relaxed load and a branch, no clock read.
//
// Parts are timed exclusively: a part entered inside another stops the outer one's clock until it leaves, so a
// stack's walk inside an op's capture counts as "frames", not "capture", and the feed's calls into the core as
// "hb core", not "intake". Python that C++ calls back (a drain, a plan, a race's judge, the virtual model's node
// hooks) stops the clock too (`Callout`): its time is Python's, which the benchmark counts with cProfile. Totals are
// process-wide atomics (any thread's work counts); the part a thread is in is its own.

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <cstdint>

// hidden, as pybind11's own types are (a module's internals are its own)
namespace __attribute__((visibility("hidden"))) timers {

enum Part : int { kCapture, kFrames, kIntake, kCore, kModels, kParts, kCallout = kParts };
constexpr const char* kNames[kParts] = {"capture", "frames", "intake", "hb core", "models"};

std::atomic<bool> on{false};
std::atomic<uint64_t> total_ns[kParts], entries[kParts];
std::atomic<uint64_t> ops{0};  // op records the feed (or the Python path's drain) took

struct Now {  // the part this thread is in (-1: none) and since when
  int part = -1;
  uint64_t since = 0;
};
thread_local Now now_in;
thread_local bool untimed = false;  // a thread whose work is not the program's step's (the applier)

inline uint64_t clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The thread's current part stops at `t` (its time so far added), and `next` starts.
inline int switch_to(int next, uint64_t t) {
  Now& n = now_in;
  int outer = n.part;
  if (outer >= 0 && outer < kParts) total_ns[outer].fetch_add(t - n.since, std::memory_order_relaxed);
  n.part = next;
  n.since = t;
  return outer;
}

// A timed region: `part`'s clock runs while it is innermost.
class Scope {
 public:
  explicit Scope(int part) {
    if (__builtin_expect(on.load(std::memory_order_relaxed), 0)) enter(part);
  }
  ~Scope() {
    if (outer_ != kIdle) switch_to(outer_, clock_ns());
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  static constexpr int kIdle = -2;
  __attribute__((noinline)) void enter(int part) {
    if (untimed) return;
    if (part < kParts) entries[part].fetch_add(1, std::memory_order_relaxed);
    outer_ = switch_to(part, clock_ns());
  }
  int outer_ = kIdle;
};

// Python called from a timed part: no part's clock runs meanwhile.
struct Callout : Scope {
  Callout() : Scope(kCallout) {}
};

inline void count_op() {
  if (__builtin_expect(on.load(std::memory_order_relaxed), 0)) ops.fetch_add(1, std::memory_order_relaxed);
}

void reset() {
  for (int p = 0; p < kParts; ++p) {
    total_ns[p].store(0);
    entries[p].store(0);
  }
  ops.store(0);
}

void bind(pybind11::module_& m) {
  m.def("profile", [](bool value) {
    if (value) reset();
    on.store(value);
  }, pybind11::arg("on"), "The detector's timers on (counters zeroed) or off (counters kept).");
  m.def("clock_cost_ns", [] {  // one clock read's cost here, for the benchmark to take the timers' own cost out
    constexpr int kReads = 100000;
    uint64_t start = clock_ns();
    for (int i = 0; i < kReads; ++i) clock_ns();  // a call into the C library's clock: not optimized away
    return static_cast<double>(clock_ns() - start) / kReads;
  }, "The cost of one of the timers' clock reads, in ns (the mean of 100,000).");
  m.def("profile_counters", [](bool reset_after) {
    pybind11::dict out;
    for (int p = 0; p < kParts; ++p)
      out[kNames[p]] = pybind11::make_tuple(total_ns[p].load(), entries[p].load());
    out["ops"] = pybind11::make_tuple(0, ops.load());
    if (reset_after) reset();
    return out;
  }, pybind11::arg("reset") = false, "{part: (total ns, times entered)}, and \"ops\": (0, op records applied).");
}

}  // namespace timers
