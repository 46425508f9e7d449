// The applier thread: a session's captured records applied to the C++ core beside the program, not on its thread.
//
// Applying a record (its storages' tables, its site, the core's clocks and histories) cost the stepping thread more
// than capturing it: on a launch-bound step on an H200 host about twice the capture's time (docs/validation.md's cost
// breakdown). A step is host-bound, so that time was the step's. Here one thread per process applies what the
// capture queues, every millisecond while a feed is attached (sooner when `kWakeEvery` records wait), holding the
// feed's lock (`Tables::mutex`) as a drain does, so records are applied once and in order whoever applies them.
//
// It never takes the GIL, so it cannot deadlock against the program's threads: a record that needs Python (a host
// sync's rule, a queued op's model, a stream or process group the model has not named yet, a followed thread's origin,
// host memory) stops it, and that record and those after it wait for the next drain (`Feed::apply`, with the GIL),
// which every Python edge of the models already makes before it touches the core. What it finds for Python waits as
// well: the core's candidates for the judge (`PyCore::deferred_`), notes, the Python objects it lets go
// (`streamrace_hb::drop`).
//
// The tracker attaches a feed where a core can be spared (models: `tracker.applier_wanted`) and detaches it before the
// session's last drain and before a confirmation forces an order. The thread outlives sessions (idle, waiting) so a
// test does not pay for starting one. Across fork(), the parent waits for it to finish the batch in hand (else a child
// would inherit a lock it holds), and the child, which has no such thread, applies inline.
#include <condition_variable>
#include <pthread.h>
#include <thread>

namespace applier {
namespace {

struct State {
  std::mutex m;
  std::condition_variable woken, idle;
  feed::Feed* feed = nullptr;  // attached
  feed::Feed* busy = nullptr;  // the one being applied now
  bool poked = false, started = false, forking = false;
};

State& state() {
  static auto* s = new State();  // never destroyed: the thread may still wait on it as the process exits
  return *s;
}

void loop() {
  here = true;
  timers::untimed = true;  // off the program's thread: not part of the breakdown of its step
  State& s = state();
  std::unique_lock<std::mutex> lock(s.m);
  for (;;) {
    if (s.feed == nullptr || s.forking)
      s.woken.wait(lock, [&] { return s.feed != nullptr && !s.forking; });
    else
      s.woken.wait_for(lock, std::chrono::milliseconds(1), [&] { return s.poked || s.forking || !s.feed; });
    s.poked = false;
    if (s.feed == nullptr || s.forking) continue;
    feed::Feed* f = s.busy = s.feed;
    lock.unlock();
    try {
      f->apply_native();
    } catch (...) {  // a record it could not apply went unchecked with a note (Feed::applied); nothing else throws
    }
    lock.lock();
    s.busy = nullptr;
    s.idle.notify_all();
  }
}

void before_fork() {
  State& s = state();
  s.m.lock();
  s.forking = true;
  // the batch in hand (microseconds; bounded, should it wait for a lock a thread that wants the GIL holds)
  for (int i = 0; s.busy != nullptr && i < 1000; ++i) {
    s.m.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(500));
    s.m.lock();
  }
}

void after_fork_parent() {
  State& s = state();
  s.forking = false;
  s.m.unlock();
  s.woken.notify_one();
}

void after_fork_child() {  // no applier thread here: the child's drains apply everything
  State& s = state();
  s.forking = false;
  s.started = false;
  s.feed = s.busy = nullptr;
  attached.store(false, std::memory_order_relaxed);
  stalled.store(false, std::memory_order_relaxed);
  s.m.unlock();
}

}  // namespace

void wake() {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.m);
    s.poked = true;
  }
  s.woken.notify_one();
}

}  // namespace applier

// Attach this feed to the applier thread (started on first use), or detach it, returning once the thread is out of it.
void feed::Feed::use_applier(bool on) {
  applier::State& s = applier::state();
  if (on) {
    std::lock_guard<std::mutex> lock(s.m);
    if (!s.started) {
      static bool fork_handlers = pthread_atfork(applier::before_fork, applier::after_fork_parent,
                                                 applier::after_fork_child) == 0;
      (void)fork_handlers;
      std::thread(applier::loop).detach();
      s.started = true;
    }
    s.feed = this;
    applier::stalled.store(stalled_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    applier::attached.store(true, std::memory_order_relaxed);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(s.m);
    if (s.feed == this) {
      s.feed = nullptr;
      applier::attached.store(false, std::memory_order_relaxed);
      applier::stalled.store(false, std::memory_order_relaxed);
    }
    if (s.busy != this) return;
  }
  // the thread may wait for the core's lock, held by a thread that wants the GIL: released while waiting
  std::optional<py::gil_scoped_release> release;
  if (PyGILState_Check()) release.emplace();
  std::unique_lock<std::mutex> lock(s.m);
  s.idle.wait(lock, [&] { return s.busy != this; });
}
