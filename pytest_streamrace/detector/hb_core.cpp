// The happens-before core of hb.py in C++: the same rules, verdicts, pruning and bounds (hb.py's docstring is the
// model; each function here names its twin there). Built into the capture's extension (capture.py compiles this
// source and capture.cpp as one module; capture.cpp's PYBIND11_MODULE calls bind_core), so the capture can feed it
// without entering Python per op. hb_native.py is the Python face.
//
// Inside, streams and storages are integer ids and clocks dense vectors over stream ids, shared copy-on-write: a
// merge that adds nothing returns its first argument, so pointer identity here is dict identity in hb.py, and the
// strict twin of a clock is the same pointer while the two views agree. What the core only carries for its caller
// (an op's site, an access's tensor description, a stream's key, an implicit sync's site) is a Payload: a Python
// object from Python, a NativePayload from a C++ caller (capture.cpp's Feed). Races are found here and handed to a
// Sink as candidates, one batch per access or allocation; the caller names and deduplicates them (that reads frames:
// Python's job).
// Every call from Python comes with the GIL held. The capture's applier thread (applier.cpp) calls the C++ face
// without it: there nothing enters Python (the judge's candidates wait in `deferred_` for the next call with
// the GIL), a Python object it lets go is released later under the GIL (`drop`), and blocks come from its own free
// lists.

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

// hidden, as pybind11's own types are (a module's internals are its own)
#if defined(__GNUC__)
#define STREAMRACE_HIDDEN __attribute__((visibility("hidden")))
#else
#define STREAMRACE_HIDDEN
#endif

namespace STREAMRACE_HIDDEN streamrace_hb {

// Blocks of one size made and dropped once per op or access (an op, its site, an access's tensor), kept on a free
// list: malloc and free were a quarter of the detector's own instructions a step. One list per thread (the applier
// thread makes and drops them too; a block may end on another thread's list), bounded, given back to malloc as the
// thread ends.
template <size_t Size>
class FreeList {
 public:
  static void* take() {
    Local& l = local();
    if (l.head == nullptr) return ::operator new(Size);
    Block* block = l.head;
    l.head = block->next;
    --l.count;
    return block;
  }
  static void give(void* pointer) {
    Local& l = local();
    if (l.count >= kKept || l.gone) return ::operator delete(pointer);
    auto* block = static_cast<Block*>(pointer);
    block->next = l.head;
    l.head = block;
    ++l.count;
  }

 private:
  struct Block { Block* next; };
  static_assert(Size >= sizeof(Block), "a block holds the list's link");
  static constexpr size_t kKept = 4096;
  struct Local {
    Block* head = nullptr;
    size_t count = 0;
    bool gone = false;  // the thread is ending: what it drops from now on goes straight back to malloc
    ~Local() {
      gone = true;
      while (head != nullptr) {
        Block* next = head->next;
        ::operator delete(head);
        head = next;
      }
      count = 0;
    }
  };
  static Local& local() {
    thread_local Local list;
    return list;
  }
};

// A Python object let go of on a thread without the GIL (the applier's): released at the next `release_dropped`,
// which every entry that holds the GIL and applies records calls. With the GIL, at once.
inline std::mutex& dropped_mutex() {
  static auto* m = new std::mutex();  // never destroyed: it would outlive the interpreter
  return *m;
}
inline std::vector<PyObject*>& dropped() {
  static auto* objects = new std::vector<PyObject*>();
  return *objects;
}
inline std::atomic<bool>& any_dropped() {
  static std::atomic<bool> flag{false};
  return flag;
}

inline void drop(PyObject* object) {
  if (object == nullptr || !Py_IsInitialized()) return;
  if (PyGILState_Check()) {
    Py_DECREF(object);
    return;
  }
  std::lock_guard<std::mutex> guard(dropped_mutex());
  dropped().push_back(object);
  any_dropped().store(true, std::memory_order_relaxed);
}

inline void drop(py::object& object) { drop(object.release().ptr()); }

inline void release_dropped() {  // the GIL held
  if (!any_dropped().load(std::memory_order_relaxed)) return;
  std::vector<PyObject*> now;
  {
    std::lock_guard<std::mutex> guard(dropped_mutex());
    now.swap(dropped());
    any_dropped().store(false, std::memory_order_relaxed);
  }
  for (PyObject* object : now) Py_DECREF(object);
}

// A lock taken with the GIL released while another thread holds it: the holder may be a thread without the GIL (the
// applier), or one whose Python let this thread in, and either may need the GIL before it lets go.
template <class Mutex>
class GilFreeLock {
 public:
  explicit GilFreeLock(Mutex& m) : lock_(m, std::try_to_lock) {
    if (lock_.owns_lock()) return;
    std::optional<py::gil_scoped_release> release;
    if (PyGILState_Check()) release.emplace();
    lock_.lock();
  }

 private:
  std::unique_lock<Mutex> lock_;
};

// A class whose objects come from the free list of their size (derived classes of another size go to malloc).
template <class T>
struct Pooled {
  static void* operator new(size_t size) {
    return size == sizeof(T) ? FreeList<sizeof(T)>::take() : ::operator new(size);
  }
  static void operator delete(void* pointer, size_t size) {
    if (size == sizeof(T)) FreeList<sizeof(T)>::give(pointer);
    else ::operator delete(pointer);
  }
};

// The same for std::allocate_shared: the object and its count in one pooled block.
template <class T>
struct PoolAllocator {
  using value_type = T;
  PoolAllocator() = default;
  template <class U>
  PoolAllocator(const PoolAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(n == 1 ? FreeList<sizeof(T)>::take() : ::operator new(n * sizeof(T)));
  }
  void deallocate(T* pointer, size_t n) {
    if (n == 1) FreeList<sizeof(T)>::give(pointer);
    else ::operator delete(pointer);
  }
  template <class U>
  bool operator==(const PoolAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const PoolAllocator<U>&) const { return false; }
};

// What a C++ caller hands the core as a payload: reference-counted, turned into Python only when a report or a test
// reads it (an op's site named from its captured stack, a tensor's description).
struct NativePayload {
  std::atomic<int64_t> refs{0};
  virtual ~NativePayload() = default;
  virtual py::object to_python() = 0;
};

// What the core keeps for its caller and never reads: no payload (Python None), an owned Python object, or a C++
// caller's NativePayload (low bit set: both pointers are aligned).
class Payload {
 public:
  Payload() noexcept = default;
  static Payload of(py::handle h) {
    Payload p;
    if (h && !h.is_none()) {
      Py_INCREF(h.ptr());
      p.word_ = reinterpret_cast<uintptr_t>(h.ptr());
    }
    return p;
  }
  static Payload native(NativePayload* object) {  // takes a reference: a fresh object is owned from here on
    Payload p;
    object->refs.fetch_add(1, std::memory_order_relaxed);
    p.word_ = reinterpret_cast<uintptr_t>(object) | 1u;
    return p;
  }
  Payload(const Payload& o) noexcept : word_(o.word_) { acquire(); }
  Payload(Payload&& o) noexcept : word_(o.word_) { o.word_ = 0; }
  Payload& operator=(Payload o) noexcept {
    std::swap(word_, o.word_);
    return *this;
  }
  ~Payload() {
    if (is_object()) drop(object());
    else if (is_native() && native_object()->refs.fetch_sub(1, std::memory_order_acq_rel) == 1)
      delete native_object();
  }
  bool empty() const { return word_ == 0; }
  py::object to_python() const {
    if (word_ == 0) return py::none();
    if (is_object()) return py::reinterpret_borrow<py::object>(object());
    return native_object()->to_python();
  }

 private:
  void acquire() const {
    if (is_object()) Py_INCREF(object());
    else if (is_native()) native_object()->refs.fetch_add(1, std::memory_order_relaxed);
  }
  bool is_object() const { return word_ != 0 && (word_ & 1u) == 0; }
  bool is_native() const { return (word_ & 1u) != 0; }
  NativePayload* native_object() const { return reinterpret_cast<NativePayload*>(word_ & ~uintptr_t{1}); }
  PyObject* object() const { return reinterpret_cast<PyObject*>(word_); }
  uintptr_t word_ = 0;
};

// A vector clock: per stream id, the epoch known complete (missing components are 0). Never mutated once shared.
struct Clock {
  std::vector<int64_t> v;
  int64_t get(int32_t i) const { return static_cast<size_t>(i) < v.size() ? v[i] : 0; }
};
using ClockPtr = std::shared_ptr<const Clock>;

// hb._merge: clock ∨ other; clock itself when other adds nothing.
ClockPtr merge(const ClockPtr& clock, const ClockPtr& other) {
  const auto& x = clock->v;
  const auto& y = other->v;
  size_t i = 0, n = y.size();
  for (; i < n; ++i)
    if (y[i] > (i < x.size() ? x[i] : 0)) break;
  if (i == n) return clock;
  auto merged = std::make_shared<Clock>();
  merged->v = x;
  if (merged->v.size() < n) merged->v.resize(n, 0);
  for (i = 0; i < n; ++i)
    if (y[i] > merged->v[i]) merged->v[i] = y[i];
  return merged;
}

// clock with its own stream's component raised to epoch (hb._Stream._now); clock itself when already there.
ClockPtr with_own(const ClockPtr& clock, int32_t stream, int64_t epoch) {
  if (clock->get(stream) >= epoch) return clock;
  auto snap = std::make_shared<Clock>(*clock);
  if (snap->v.size() <= static_cast<size_t>(stream)) snap->v.resize(stream + 1, 0);
  snap->v[stream] = epoch;
  return snap;
}

// The stream keys of one core, for ops read from Python after the core is gone (a race outlives its session).
struct StreamKeys {
  std::vector<Payload> keys;
};

// hb.Op: one launch on a stream (or a free: strict is null). seq is the global launch order.
struct Op {
  int32_t stream = 0;
  int64_t epoch = 0, seq = 0;
  Payload site;
  ClockPtr clock, strict;
  std::shared_ptr<StreamKeys> keys;
  py::object clock_dict, strict_dict;  // the clocks as hb.py's dicts, built when read (`happens_before`, tests)
  Op() = default;
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;
  ~Op() {  // the last reference may go on the applier thread (a history entry replaced there)
    drop(clock_dict);
    drop(strict_dict);
  }
};
using OpPtr = std::shared_ptr<Op>;

// One remembered access: bytes [start, end) of its storage by op (hb.py's history tuple).
struct Rec {
  OpPtr op;
  int64_t start = 0, end = 0;
  bool write = false;
  Payload tensor;
};

struct Storage {  // hb._Storage
  int64_t nbytes = 0;
  int32_t alloc_stream = -1;  // -1: its allocation was not seen
  Payload alloc_site, tensor;
  std::vector<Rec> history;  // oldest first
  std::vector<int32_t> used_on;  // streams named by record_stream
};

// A block freed to a stream's pool while other streams' accesses were not ordered before the free.
struct Freed {
  int64_t storage;
  OpPtr free_op;
  std::vector<Rec> hazards;
  Payload alloc_site, tensor;
  int64_t nbytes;
};

struct StreamState {  // hb._Stream
  bool created = false;  // hb.py's `key in _streams`: an id may be known (an allocation's stream) before that
  int64_t epoch = 0;
  ClockPtr known, strict;
  int64_t host_seen = 0;
  std::vector<Freed> freed;
};

// What an event records: (now, now_strict), one pointer while the views agree.
struct Snapshot {
  ClockPtr now, strict;
};

enum Kind { RAW = 0, WAR = 1, WAW = 2, FREE = 3 };

// hb._Host: one host thread's clock, or the shared one. `stamp` is unique across the core's hosts and changes with
// the clock, so a stream knows whether it has merged it.
struct Host {
  ClockPtr known, strict;
  int64_t stamp = 0;
};

// hb.acting_thread: the thread on whose behalf the core is called (the calling one, unless an ActingFor says
// otherwise: the feed applies each record for the thread that recorded it).
thread_local int64_t acting_ident = 0;
thread_local bool acting_set = false;

inline int64_t acting_thread() {
  return acting_set ? acting_ident : static_cast<int64_t>(PyThread_get_thread_ident());
}

struct ActingFor {  // hb.acting_for
  explicit ActingFor(int64_t ident) : outer_ident(acting_ident), outer_set(acting_set) {
    acting_ident = ident;
    acting_set = true;
  }
  ~ActingFor() {
    acting_ident = outer_ident;
    acting_set = outer_set;
  }
  int64_t outer_ident;
  bool outer_set;
};

// An unordered pair (or, latent, one ordered only through an implicit host sync). For FREE, `later` is the free
// (start 0, end nbytes) and its tensor the allocation's description, when one was given.
struct Candidate {
  bool latent;
  int kind;
  Rec earlier;
  int64_t storage;
  Rec later;
  Payload alloc_site, hidden_by;  // hidden_by: the implicit sync's site; none found when empty
};

// Told the candidates of one access or allocation at a time (hb.py's `found`, collected per access).
struct Sink {
  virtual void judge(std::vector<Candidate>& batch) = 0;
  virtual ~Sink() = default;
};

struct Implicit {  // hb.py's _implicit entries: (seq, what the host learnt, the read-back's site)
  int64_t seq;
  ClockPtr learnt;
  Payload site;
};

constexpr size_t IMPLICIT_KEPT = 4096;  // hb.py: deque(maxlen=4096)

class Core {
 public:
  explicit Core(bool trace)
      : trace_(trace), empty_(std::make_shared<Clock>()), keys_(std::make_shared<StreamKeys>()) {
    shared_.known = shared_.strict = empty_;
    shared_.stamp = stamps_;
  }

  // streams

  // A new stream id for a key (not yet a stream hb.py would count: see `stream`).
  int32_t intern_stream(Payload key) {
    int32_t id = static_cast<int32_t>(streams_.size());
    streams_.emplace_back();
    streams_.back().known = streams_.back().strict = empty_;
    keys_->keys.push_back(std::move(key));
    return id;
  }
  const Payload& stream_key(int32_t id) const { return keys_->keys[id]; }
  bool created(int32_t id) const { return streams_[id].created; }
  void add_stream(int32_t id) { stream(id); }
  size_t stream_count() const { return order_.size(); }
  bool frees_can_race() const { return trace_ || order_.size() > 1; }
  bool trace() const { return trace_; }

  // ordering

  Snapshot snapshot(int32_t id) { return snapshot_of(id, stream(id)); }

  void wait_stream(int32_t waiter, int32_t target) {
    StreamState& w = stream(waiter);
    Snapshot snap = snapshot(target);
    learn(w, snap.now, snap.strict);
  }

  void wait_snapshot(int32_t id, const Snapshot* snap) {  // hb.wait_event: a never-recorded event is no wait
    StreamState& w = stream(id);
    if (snap != nullptr) learn(w, snap->now, snap->strict);
  }

  void synchronize_stream(int32_t id, const Payload& implicit) { host_learns(host(), snapshot(id), implicit); }
  void synchronize_snapshot(const Snapshot& snap, const Payload& implicit) { host_learns(host(), snap, implicit); }
  void synchronize_device(const Payload& implicit) {
    Host& h = host();
    for (size_t i = 0; i < order_.size(); ++i) {
      int32_t id = order_[i];
      host_learns(h, snapshot_of(id, streams_[id]), implicit);
    }
  }

  // host threads (hb.py's own_host, drop_host, release, acquire; handoffs are kept by hb_native.py as snapshots)

  void own_host() {
    auto inserted = hosts_.try_emplace(acting_thread());
    if (!inserted.second) return;
    Host& h = inserted.first->second;
    h.known = h.strict = empty_;
    h.stamp = ++stamps_;
  }
  void drop_host() { hosts_.erase(acting_thread()); }

  // What `held` (a handoff's snapshot, or none) holds once the calling thread releases into it.
  Snapshot release(const Snapshot* held) {
    const Host& h = host();
    if (held == nullptr) return {h.known, h.strict};
    ClockPtr now = merge(held->now, h.known);
    const bool same = held->strict == held->now && h.strict == h.known;
    return {now, same ? now : merge(held->strict, h.strict)};
  }
  void acquire(const Snapshot& held) { host_learns(host(), held, Payload()); }

  // work

  OpPtr launch(int32_t id, Payload site) {  // hb._launch
    StreamState& s = stream(id);
    const Host& h = host();
    if (s.host_seen != h.stamp) {
      learn(s, h.known, h.strict);
      s.host_seen = h.stamp;
    }
    s.epoch += 1;
    seq_ += 1;
    auto op = std::allocate_shared<Op>(PoolAllocator<Op>());
    op->stream = id;
    op->epoch = s.epoch;
    op->seq = seq_;
    op->site = std::move(site);
    op->clock = s.known;
    op->strict = s.strict;
    op->keys = keys_;
    if (trace_) timeline_.push_back(op);
    return op;
  }

  void access(const OpPtr& op, int64_t storage, int64_t start, int64_t end, bool write, Payload tensor,
              Sink& sink) {  // hb._access
    if (end <= start) return;
    Storage& st = storages_[storage];
    auto& history = st.history;
    if (history.empty()) {
      history.push_back({op, start, end, write, std::move(tensor)});
      return;
    }
    const int32_t stream = op->stream;
    const Clock& clock = *op->clock;
    const Clock* strict = op->strict.get();
    const bool two_views = strict != nullptr && op->strict != op->clock;
    std::vector<Rec>& kept = scratch_;  // becomes the history; the old one, emptied, the next access's scratch
    kept.clear();
    kept.reserve(history.size() + 2);
    for (Rec& rec : history) {
      if (rec.start < end && start < rec.end) {
        const Op& a = *rec.op;
        const bool same = a.stream == stream;
        bool ordered = same ? a.seq <= op->seq : clock.get(a.stream) >= a.epoch;
        if (ordered && two_views && !same && strict->get(a.stream) < a.epoch) {
          if (write || rec.write)
            batch_.push_back({true, kind(rec.write, write), rec, storage, {op, start, end, write, tensor},
                              st.alloc_site, hiding_sync(a, *op)});
          ordered = false;  // keep rec: later accesses may be latent races with it too (never races)
        } else if (!ordered && (write || rec.write)) {
          batch_.push_back({false, kind(rec.write, write), rec, storage, {op, start, end, write, tensor},
                            st.alloc_site, Payload()});
        }
        if (ordered && (write || (!rec.write && same))) {
          // dominated where they overlap: keep only rec's uncovered bytes (hb.py says why)
          if (rec.start < start) kept.push_back({rec.op, rec.start, start, rec.write, rec.tensor});
          if (end < rec.end) kept.push_back({rec.op, end, rec.end, rec.write, rec.tensor});
          continue;
        }
      }
      kept.push_back(std::move(rec));
    }
    kept.push_back({op, start, end, write, std::move(tensor)});
    history.swap(kept);
    kept.clear();
    flush(sink);
  }

  // memory

  void alloc(int64_t storage, int64_t nbytes, int32_t id, Payload site, Payload tensor, Sink& sink) {  // hb._alloc
    Storage fresh;
    fresh.nbytes = nbytes;
    fresh.alloc_stream = id;
    fresh.alloc_site = std::move(site);
    fresh.tensor = std::move(tensor);
    storages_[storage] = std::move(fresh);
    if (id < 0 || !streams_[id].created || streams_[id].freed.empty()) return;
    StreamState& s = streams_[id];
    const Host& h = host();
    if (s.host_seen != h.stamp) {
      learn(s, h.known, h.strict);
      s.host_seen = h.stamp;
    }
    ClockPtr now = merge(h.known, with_own(s.known, id, s.epoch));
    std::vector<Freed> freed;
    freed.swap(s.freed);  // each hazard is judged once: resolved (ordered) or reported here
    for (Freed& f : freed)
      for (Rec& a : f.hazards)
        if (now->get(a.op->stream) < a.op->epoch)
          batch_.push_back({false, FREE, a, f.storage, {f.free_op, 0, f.nbytes, true, f.tensor}, f.alloc_site,
                            Payload()});
    flush(sink);
  }

  void record_stream(int64_t storage, int32_t id) {
    Storage& st = storages_[storage];
    for (int32_t s : st.used_on)
      if (s == id) return;
    st.used_on.push_back(id);
  }

  void free(int64_t storage, Payload site) {  // hb.free
    auto found = storages_.find(storage);
    if (found == storages_.end()) return;
    Storage st = std::move(found->second);
    storages_.erase(found);
    if (st.alloc_stream < 0) return;
    const int32_t id = st.alloc_stream;
    seq_ += 1;
    std::vector<const Rec*> others;
    for (const Rec& rec : st.history) {
      int32_t s = rec.op->stream;
      if (s == id) continue;
      bool covered = false;
      for (int32_t u : st.used_on) covered = covered || u == s;
      if (!covered) others.push_back(&rec);
    }
    if (others.empty() && !trace_) return;
    StreamState& state = stream(id);
    ClockPtr safe = merge(host().known, with_own(state.known, id, state.epoch));  // ordered before any reuse
    std::vector<Rec> hazards;
    for (const Rec* rec : others)
      if (safe->get(rec->op->stream) < rec->op->epoch) hazards.push_back(*rec);
    auto op = std::allocate_shared<Op>(PoolAllocator<Op>());
    op->stream = id;
    op->epoch = state.epoch;
    op->seq = seq_;
    op->site = std::move(site);
    op->clock = safe;
    op->keys = keys_;
    if (trace_) timeline_.push_back(op);
    if (!hazards.empty())
      state.freed.push_back({storage, op, std::move(hazards), st.alloc_site, st.tensor, st.nbytes});
  }

  // results

  const std::vector<OpPtr>& timeline() const { return timeline_; }

  Payload alloc_site(int64_t storage) const {
    auto found = storages_.find(storage);
    return found == storages_.end() ? Payload() : found->second.alloc_site;
  }

  size_t history_size(int64_t storage) const {
    auto found = storages_.find(storage);
    return found == storages_.end() ? 0 : found->second.history.size();
  }

  size_t history_size() const {
    size_t n = 0;
    for (const auto& entry : storages_) n += entry.second.history.size();
    return n;
  }

 private:
  static int kind(bool earlier_write, bool write) { return write && earlier_write ? WAW : (write ? WAR : RAW); }

  StreamState& stream(int32_t id) {  // hb._stream: the stream counts from now on
    StreamState& s = streams_[id];
    if (!s.created) {
      s.created = true;
      order_.push_back(id);
    }
    return s;
  }

  Snapshot snapshot_of(int32_t id, const StreamState& s) const {  // hb._Stream.snapshot
    ClockPtr now = with_own(s.known, id, s.epoch);
    return {now, s.strict == s.known ? now : with_own(s.strict, id, s.epoch)};
  }

  static void learn(StreamState& s, const ClockPtr& snap, const ClockPtr& strict) {  // hb._Stream.learn
    const bool same = s.strict == s.known;
    s.known = merge(s.known, snap);
    if (same && strict == snap)
      s.strict = s.known;
    else
      s.strict = merge(s.strict, strict);
  }

  Host& host() {  // hb._host: the acting thread's own, else the shared one
    if (hosts_.empty()) return shared_;
    auto found = hosts_.find(acting_thread());
    return found == hosts_.end() ? shared_ : found->second;
  }

  void host_learns(Host& h, const Snapshot& snap, const Payload& implicit) {  // hb._host_learns
    const bool same = h.strict == h.known;
    ClockPtr merged = merge(h.known, snap.now);
    ClockPtr merged_strict;
    if (implicit.empty()) {
      merged_strict = same && snap.strict == snap.now ? merged : merge(h.strict, snap.strict);
    } else {
      merged_strict = h.strict;
      if (merged != h.known) {
        implicit_.push_back({seq_, snap.now, implicit});
        if (implicit_.size() > IMPLICIT_KEPT) implicit_.pop_front();
      }
    }
    if (merged != h.known || merged_strict != h.strict) {
      h.known = std::move(merged);
      h.strict = std::move(merged_strict);
      h.stamp = ++stamps_;
    }
  }

  // hb._hiding_sync: the first implicit sync between the two ops that taught the host the earlier one's epoch.
  Payload hiding_sync(const Op& earlier, const Op& later) const {
    for (const Implicit& e : implicit_)
      if (earlier.seq <= e.seq && e.seq < later.seq && e.learnt->get(earlier.stream) >= earlier.epoch) return e.site;
    return Payload();
  }

  void flush(Sink& sink) {
    if (batch_.empty()) return;
    std::vector<Candidate> batch;
    batch.swap(batch_);
    sink.judge(batch);
  }

  bool trace_;
  ClockPtr empty_;
  Host shared_;  // every thread's until it owns one: the program's main host
  std::unordered_map<int64_t, Host> hosts_;  // thread ident -> its own host
  int64_t stamps_ = 1, seq_ = 0;  // stamps_: the last stamp handed to a host (0: no stream has merged any)
  std::shared_ptr<StreamKeys> keys_;
  std::vector<StreamState> streams_;  // by id
  std::vector<int32_t> order_;  // created streams, in creation order (hb.py's dict order)
  std::unordered_map<int64_t, Storage> storages_;
  std::deque<Implicit> implicit_;
  std::vector<OpPtr> timeline_;
  std::vector<Candidate> batch_;
  std::vector<Rec> scratch_;  // `access`'s: no allocation per access once grown
};

// ---- the Python binding: keys to ids, payloads to objects, candidates to the Python judge

// Storage keys: data pointers (ints >= 0) are their own ids, so a C++ caller passing data pointers agrees with
// Python's keys without a table; any other key (tests' names) is interned to a negative id for the core's life.
// Stream keys are interned to dense ids (streams are never forgotten, as in hb.py).
class PyCore {
 public:
  PyCore(bool trace, py::object judge) : core_(trace), judge_(std::move(judge)) {}

  // One GIL-safe lock per core (hb.py's threading.Lock): the judge runs Python, which may let another thread in, and
  // the applier thread (no GIL) may hold it.
  class Guard {
   public:
    explicit Guard(std::mutex& m) : lock_(m) {}

   private:
    timers::Scope timed_{timers::kCore};  // first: timed from before the lock (timers.cpp)
    GilFreeLock<std::mutex> lock_;
  };

  int32_t stream_id(py::handle key) {
    PyObject* found = PyDict_GetItemWithError(stream_ids_.ptr(), key.ptr());
    if (found != nullptr) return static_cast<int32_t>(PyLong_AsLong(found));
    if (PyErr_Occurred()) throw py::error_already_set();
    int32_t id = core_.intern_stream(Payload::of(key));
    stream_ids_[key] = id;
    names_.push_back(py::none());
    return id;
  }

  int64_t storage_id(py::handle key) {
    int64_t id;
    if (known_storage(key, id)) return id;
    id = -static_cast<int64_t>(storage_keys_.size()) - 1;
    storage_keys_.push_back(py::reinterpret_borrow<py::object>(key));
    storage_ids_[key] = id;
    return id;
  }

  bool known_storage(py::handle key, int64_t& id) {  // storage_id without interning a key never seen
    if (PyLong_Check(key.ptr())) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(key.ptr(), &overflow);
      if (!overflow && v >= 0) return id = v, true;
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    }
    PyObject* found = PyDict_GetItemWithError(storage_ids_.ptr(), key.ptr());
    if (found == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (found == nullptr) return false;
    id = PyLong_AsLongLong(found);
    return true;
  }

  py::object storage_key(int64_t id) const {
    if (id >= 0) return py::int_(id);
    return storage_keys_[static_cast<size_t>(-id - 1)];
  }

  void created(int32_t id) {  // a stream counted from now on has hb.py's default name
    if (names_[id].is_none()) names_[id] = py::str(core_.stream_key(id).to_python());
  }

  // the API (hb.HappensBefore's, less what hb_native.py keeps in Python: events by key, races)

  void add_stream(py::handle key, py::object name) {
    Guard g(mutex_);
    int32_t id = stream_id(key);
    core_.add_stream(id);
    names_[id] = std::move(name);
  }

  // stream_name, stream_count, frees_can_race take no lock, as in hb.py: a storage's weakref callback asks
  // frees_can_race at any point, even inside this core's judge on the same thread.
  py::object stream_name(py::handle key) {
    PyObject* found = PyDict_GetItemWithError(stream_ids_.ptr(), key.ptr());
    if (found == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (found != nullptr) {
      int32_t id = static_cast<int32_t>(PyLong_AsLong(found));
      if (core_.created(id)) {
        created(id);
        return names_[id];
      }
    }
    return py::str(key);
  }

  size_t stream_count() const { return core_.stream_count(); }
  bool frees_can_race() const { return core_.frees_can_race(); }

  Snapshot snapshot(py::handle stream) {
    Guard g(mutex_);
    int32_t id = stream_id(stream);
    Snapshot s = core_.snapshot(id);
    created(id);
    return s;
  }

  void wait_snapshot(py::handle stream, const Snapshot* snap) {
    Guard g(mutex_);
    int32_t id = stream_id(stream);
    core_.wait_snapshot(id, snap);
    created(id);
  }

  void wait_stream(py::handle waiter, py::handle target) {
    wait_stream_id(locked_stream_id(waiter), locked_stream_id(target));
  }

  void synchronize_stream(py::handle stream, py::handle implicit) {
    Guard g(mutex_);
    int32_t id = stream_id(stream);
    core_.synchronize_stream(id, Payload::of(implicit));
    created(id);
  }

  void synchronize_snapshot(const Snapshot& snap, py::handle implicit) {
    Guard g(mutex_);
    core_.synchronize_snapshot(snap, Payload::of(implicit));
  }

  void synchronize_device(py::handle implicit) {
    Guard g(mutex_);
    core_.synchronize_device(Payload::of(implicit));
  }

  void own_host() {
    Guard g(mutex_);
    core_.own_host();
  }

  void drop_host() {
    Guard g(mutex_);
    core_.drop_host();
  }

  Snapshot release(const Snapshot* held) {
    Guard g(mutex_);
    return core_.release(held);
  }

  void acquire(const Snapshot& held) {
    Guard g(mutex_);
    core_.acquire(held);
  }

  OpPtr launch(py::handle stream, py::handle site) {
    Guard g(mutex_);
    return launch_unlocked(stream, site);
  }

  py::list access(const OpPtr& op, py::handle storage, int64_t start, int64_t end, bool write, py::handle tensor) {
    Guard g(mutex_);
    py::list out;
    Judge sink(this, &out);
    core_.access(op, storage_id(storage), start, end, write, Payload::of(tensor), sink);
    return out;
  }

  // hb.record: the per-op path. accesses: (storage, start, end, write, tensor); allocs: (storage, nbytes, tensor).
  py::tuple record(py::handle stream, py::handle site, py::handle accesses, py::handle allocs) {
    Guard g(mutex_);
    OpPtr op = launch_unlocked(stream, site);
    py::list out;
    Judge sink(this, &out);
    const int32_t id = op->stream;
    for_each_item(allocs, 3, [&](PyObject* const* item) {
      int64_t nbytes = PyLong_AsLongLong(item[1]);
      if (nbytes == -1 && PyErr_Occurred()) throw py::error_already_set();
      core_.alloc(storage_id(item[0]), nbytes, id, Payload::of(site), Payload::of(item[2]), sink);
    });
    for_each_item(accesses, 5, [&](PyObject* const* item) {
      int64_t start = PyLong_AsLongLong(item[1]), end = PyLong_AsLongLong(item[2]);
      if (PyErr_Occurred()) throw py::error_already_set();
      int write = PyObject_IsTrue(item[3]);
      if (write < 0) throw py::error_already_set();
      core_.access(op, storage_id(item[0]), start, end, write != 0, Payload::of(item[4]), sink);
    });
    return py::make_tuple(py::cast(op), std::move(out));
  }

  py::list alloc(py::handle storage, int64_t nbytes, py::handle stream, py::handle site, py::handle tensor) {
    Guard g(mutex_);
    py::list out;
    Judge sink(this, &out);
    core_.alloc(storage_id(storage), nbytes, stream_id(stream), Payload::of(site), Payload::of(tensor), sink);
    return out;
  }

  // The same for a C++ caller (capture.cpp's Feed): a stream's id, storages by data pointer, payloads of its own.
  struct Alloc {
    int64_t storage, nbytes;
    Payload tensor;
  };
  struct Touch {
    int64_t storage, start, end;
    bool write;
    Payload tensor;
  };
  // races: null on the applier thread (no GIL): the candidates wait for the next judge with the GIL (`deferred_`)
  void record(int32_t id, const Payload& site, const std::vector<Alloc>& allocs, const std::vector<Touch>& touches,
              py::list* races) {
    Guard g(mutex_);
    OpPtr op = core_.launch(id, site);
    created(id);
    Judge sink(this, races);
    for (const Alloc& a : allocs) core_.alloc(a.storage, a.nbytes, id, site, a.tensor, sink);
    for (const Touch& t : touches) core_.access(op, t.storage, t.start, t.end, t.write, t.tensor, sink);
  }

  void wait_stream_id(int32_t waiter, int32_t target) {  // by the ids of `locked_stream_id`
    Guard g(mutex_);
    core_.wait_stream(waiter, target);
    created(waiter);
    created(target);
  }

  int32_t locked_stream_id(py::handle key) {
    Guard g(mutex_);
    return stream_id(key);
  }

  // Whether the applier thread may use stream `id`: it counts already (`created` would make a Python name).
  bool ready(int32_t id) {
    Guard g(mutex_);
    return static_cast<size_t>(id) < names_.size() && !names_[id].is_none();
  }

  // The candidates found on the applier thread, judged now (the GIL held): their races appended to `races`.
  void judge_deferred(py::list& races) {
    Guard g(mutex_);
    Judge sink(this, &races);
    sink.flush();
  }

  py::object stream_key(int32_t id) const { return core_.stream_key(id).to_python(); }  // interned: never changes

  // Events by raw handle (the cuda model's cudaEvent_t): kept here, where the Feed records and waits on them without
  // Python, and where hb_native.py sends every int-keyed event (hb.py keeps int keys the same way: until recorded
  // again, never dropped). A never-recorded event is no wait, as in hb.wait_event.
  void record_event(int64_t event, int32_t id) {
    Guard g(mutex_);
    events_[event] = core_.snapshot(id);
    created(id);
  }

  void wait_event(int32_t id, int64_t event) {
    Guard g(mutex_);
    auto found = events_.find(event);
    core_.wait_snapshot(id, found == events_.end() ? nullptr : &found->second);
    created(id);
  }

  void record_event(int64_t event, py::handle stream) { record_event(event, locked_stream_id(stream)); }
  void wait_event(py::handle stream, int64_t event) { wait_event(locked_stream_id(stream), event); }

  py::object event_snapshot(int64_t event) {
    Guard g(mutex_);
    auto found = events_.find(event);
    return found == events_.end() ? py::object(py::none()) : py::cast(found->second);
  }

  void record_stream(int64_t storage, int32_t id) {
    Guard g(mutex_);
    core_.record_stream(storage, id);
  }

  void free(int64_t storage, Payload site) {
    Guard g(mutex_);
    core_.free(storage, std::move(site));
  }

  void record_stream(py::handle storage, py::handle stream) {
    Guard g(mutex_);
    core_.record_stream(storage_id(storage), stream_id(stream));
  }

  py::list free(py::handle storage, py::handle site) {
    Guard g(mutex_);
    int64_t id;
    if (known_storage(storage, id)) core_.free(id, Payload::of(site));
    return py::list();  // a free's hazards are judged at the next allocation (hb.py returns [] too)
  }

  py::list timeline() {
    Guard g(mutex_);
    py::list out;
    for (const OpPtr& op : core_.timeline()) out.append(py::cast(op));
    return out;
  }

  py::object alloc_site(py::handle storage) {
    Guard g(mutex_);
    int64_t id;
    return known_storage(storage, id) ? core_.alloc_site(id).to_python() : py::none();
  }

  size_t history_size(py::handle storage) {
    Guard g(mutex_);
    if (storage.is_none()) return core_.history_size();
    int64_t id;
    return known_storage(storage, id) ? core_.history_size(id) : 0;
  }

 private:
  // Candidates to Python, one batch per access: judge(batch) -> the races not reported before (hb._collect).
  // Under the core's lock. Without the GIL (the applier thread, `out` null) a batch waits in `deferred_`; with it,
  // the batches waiting are judged first, in the order found.
  struct Judge : Sink {
    Judge(PyCore* core, py::list* out) : core(core), out(out) {}
    void judge(std::vector<Candidate>& batch) override {
      if (out == nullptr) {
        core->deferred_.push_back(std::move(batch));
        batch.clear();
        return;
      }
      flush();
      judge_now(batch);
    }
    void flush() {
      if (core->deferred_.empty()) return;
      std::vector<std::vector<Candidate>> waiting;
      waiting.swap(core->deferred_);
      for (auto& batch : waiting) judge_now(batch);
    }
    void judge_now(std::vector<Candidate>& batch) {
      py::list items(batch.size());
      for (size_t i = 0; i < batch.size(); ++i) {
        Candidate& c = batch[i];
        items[i] = py::make_tuple(c.latent, c.kind, py::cast(c.earlier.op), core->storage_key(c.storage),
                                  c.earlier.start, c.earlier.end, c.earlier.write, c.earlier.tensor.to_python(),
                                  py::cast(c.later.op), c.later.start, c.later.end, c.later.write,
                                  c.later.tensor.to_python(), c.alloc_site.to_python(), c.hidden_by.to_python());
      }
      timers::Callout python;
      py::object found = core->judge_(items);
      for (auto race : found) out->append(race);
    }
    PyCore* core;
    py::list* out;
  };

  OpPtr launch_unlocked(py::handle stream, py::handle site) {
    int32_t id = stream_id(stream);
    OpPtr op = core_.launch(id, Payload::of(site));
    created(id);
    return op;
  }

  template <class F>
  static void for_each_item(py::handle items, Py_ssize_t width, F&& apply) {
    PyObject* seq = PySequence_Fast(items.ptr(), "streamrace: expected a sequence");
    if (seq == nullptr) throw py::error_already_set();
    py::object owned = py::reinterpret_steal<py::object>(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** all = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = all[i];
      if (PyTuple_CheckExact(item) && PyTuple_GET_SIZE(item) == width) {
        apply(&PyTuple_GET_ITEM(item, 0));
        continue;
      }
      PyObject* fields = PySequence_Fast(item, "streamrace: expected a tuple");
      if (fields == nullptr) throw py::error_already_set();
      py::object fields_owned = py::reinterpret_steal<py::object>(fields);
      if (PySequence_Fast_GET_SIZE(fields) != width) throw py::value_error("streamrace: wrong number of fields");
      apply(PySequence_Fast_ITEMS(fields));
    }
  }

  Core core_;
  py::object judge_;
  std::mutex mutex_;
  std::vector<std::vector<Candidate>> deferred_;  // found on the applier thread, for the next judge with the GIL
  py::dict stream_ids_, storage_ids_;
  std::vector<py::object> names_;  // by stream id: None until the stream counts
  std::vector<py::object> storage_keys_;  // interned storage keys, by -id - 1
  std::unordered_map<int64_t, Snapshot> events_;  // by raw handle
};

py::object clock_dict(const Op& op, const Clock& clock) {
  py::dict out;
  for (size_t i = 0; i < clock.v.size(); ++i)
    if (clock.v[i] > 0) out[op.keys->keys[i].to_python()] = clock.v[i];
  return std::move(out);
}

}  // namespace streamrace_hb

// The core's Python face, as the submodule `hb` of the extension module (capture.cpp's PYBIND11_MODULE calls this).
void bind_core(py::module_& m) {
  using namespace streamrace_hb;
  auto hb = m.def_submodule("hb", "the happens-before core (hb_core.cpp); hb_native.py is its Python face");
  // hb.acting_for's twin for this core: a context manager's enter and exit, by thread ident (None: the caller's own)
  hb.def("act_for", [](py::object ident) {
    if (ident.is_none()) {
      acting_set = false;
      return;
    }
    acting_ident = ident.cast<int64_t>();
    acting_set = true;
  });
  hb.def("acting", []() -> py::object { return acting_set ? py::object(py::int_(acting_ident)) : py::object(py::none()); });
  py::class_<Snapshot>(hb, "Snapshot");
  py::class_<Op, OpPtr>(hb, "Op")
      .def_property_readonly("stream", [](const Op& op) { return op.keys->keys[op.stream].to_python(); })
      .def_property_readonly("epoch", [](const Op& op) { return op.epoch; })
      .def_property_readonly("seq", [](const Op& op) { return op.seq; })
      .def_property_readonly("site", [](const Op& op) { return op.site.to_python(); })
      .def_property_readonly("clock",
                             [](Op& op) {
                               if (!op.clock_dict) op.clock_dict = clock_dict(op, *op.clock);
                               return op.clock_dict;
                             })
      .def_property_readonly("strict",
                             [](Op& op) -> py::object {
                               if (!op.strict) return py::none();
                               if (op.strict == op.clock) {
                                 if (!op.clock_dict) op.clock_dict = clock_dict(op, *op.clock);
                                 return op.clock_dict;
                               }
                               if (!op.strict_dict) op.strict_dict = clock_dict(op, *op.strict);
                               return op.strict_dict;
                             })
      .def("__repr__", [](const Op& op) {
        return py::str("Op(stream={!r}, epoch={}, seq={}, site={!r})")
            .format(op.keys->keys[op.stream].to_python(), op.epoch, op.seq, op.site.to_python());
      });
  py::class_<PyCore>(hb, "Core")
      .def(py::init<bool, py::object>(), py::arg("trace"), py::arg("judge"))
      .def("add_stream", &PyCore::add_stream, py::arg("stream"), py::arg("name"))
      .def("stream_name", &PyCore::stream_name, py::arg("stream"))
      .def_property_readonly("stream_count", &PyCore::stream_count)
      .def_property_readonly("frees_can_race", &PyCore::frees_can_race)
      .def("snapshot", &PyCore::snapshot, py::arg("stream"))
      .def("wait_snapshot", &PyCore::wait_snapshot, py::arg("stream"), py::arg("snapshot").none(true))
      .def("record_event", py::overload_cast<int64_t, py::handle>(&PyCore::record_event), py::arg("event"),
           py::arg("stream"))
      .def("wait_event", py::overload_cast<py::handle, int64_t>(&PyCore::wait_event), py::arg("stream"),
           py::arg("event"))
      .def("event_snapshot", &PyCore::event_snapshot, py::arg("event"))
      .def("wait_stream", &PyCore::wait_stream, py::arg("waiter"), py::arg("target"))
      .def("synchronize_stream", &PyCore::synchronize_stream, py::arg("stream"), py::arg("implicit") = py::none())
      .def("synchronize_snapshot", &PyCore::synchronize_snapshot, py::arg("snapshot"),
           py::arg("implicit") = py::none())
      .def("synchronize_device", &PyCore::synchronize_device, py::arg("implicit") = py::none())
      .def("own_host", &PyCore::own_host)
      .def("drop_host", &PyCore::drop_host)
      .def("release", &PyCore::release, py::arg("held").none(true))
      .def("acquire", &PyCore::acquire, py::arg("held"))
      .def("launch", &PyCore::launch, py::arg("stream"), py::arg("site"))
      .def("access", &PyCore::access, py::arg("op"), py::arg("storage"), py::arg("start"), py::arg("end"),
           py::arg("write"), py::arg("tensor"))
      .def("record", py::overload_cast<py::handle, py::handle, py::handle, py::handle>(&PyCore::record),
           py::arg("stream"), py::arg("site"), py::arg("accesses") = py::tuple(), py::arg("allocs") = py::tuple())
      .def("alloc", &PyCore::alloc, py::arg("storage"), py::arg("nbytes"), py::arg("stream"), py::arg("site"),
           py::arg("tensor") = py::none())
      .def("record_stream", py::overload_cast<py::handle, py::handle>(&PyCore::record_stream), py::arg("storage"),
           py::arg("stream"))
      .def("free", py::overload_cast<py::handle, py::handle>(&PyCore::free), py::arg("storage"), py::arg("site"))
      .def_property_readonly("timeline", &PyCore::timeline)
      .def("alloc_site", &PyCore::alloc_site, py::arg("storage"))
      .def("history_size", &PyCore::history_size, py::arg("storage") = py::none());
}
