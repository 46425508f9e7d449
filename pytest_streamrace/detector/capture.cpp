#include <torch/csrc/utils/pybind.h>  // pybind11 and torch's type casters
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/dispatch/ObservedOperators.h>
#include <ATen/SequenceNumber.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/Storage.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <algorithm>
#include <cstring>
#include <limits>
#include <atomic>
#include <deque>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <typeindex>
#include <unordered_map>
#include <unordered_set>
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h>  // PyFrameObject's fields (f_lasti), read directly before Python 3.11's accessors
#elif PY_VERSION_HEX < 0x030E0000 && __has_include(<torch/csrc/dynamo/cpython_includes.h>)  // (torch 2.5 on)
#include <torch/csrc/dynamo/cpython_includes.h>  // _PyInterpreterFrame, F_CODE, PREV_INSTR: as torch's dynamo reads them
#define STREAMRACE_INTERPRETER_FRAMES 1
#endif

// The one function of torch/csrc/jit/python/pybind_utils.h used here, declared as it is there: that header (all of the
// JIT's Python glue) was a fifth of the build.
namespace torch::jit {
TORCH_PYTHON_API py::object toPyObject(c10::IValue ivalue);
}

namespace {

// A Python stack as its frames' code objects and instruction offsets (in bytes), innermost first, down to the test
// harness's first frame; named only when read. Named here, not by torch's symbolizer: that one imports Inductor (two
// seconds) the first time it runs. A stack holds its code objects (so no other can take one of their addresses while
// `known_stacks` keys on them), released with the GIL: at once where it is held, else by the next stack taken.
using Frames = std::vector<std::pair<const void*, int>>;
std::mutex release_mutex;
auto* to_release = new std::vector<const void*>();  // never freed: it would outlive the interpreter
std::atomic<bool> releasing{false};

struct Stack {
  Frames code;
  explicit Stack(const Frames& frames) : code(frames) {
    for (auto& frame : code) Py_INCREF(reinterpret_cast<PyObject*>(const_cast<void*>(frame.first)));
  }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  ~Stack() {
    if (!Py_IsInitialized()) return;  // the interpreter is gone, and its code objects with it
    if (PyGILState_Check()) {
      for (auto& frame : code) Py_DECREF(reinterpret_cast<PyObject*>(const_cast<void*>(frame.first)));
      return;
    }
    std::lock_guard<std::mutex> guard(release_mutex);
    for (auto& frame : code) to_release->push_back(frame.first);
    releasing = true;
  }
  py::list frames() const {  // innermost first: (file, line, function)
    py::list out;
    for (auto& [pointer, offset] : code) {
      auto* c = reinterpret_cast<PyCodeObject*>(const_cast<void*>(pointer));
      out.append(py::make_tuple(py::reinterpret_borrow<py::object>(c->co_filename), PyCode_Addr2Line(c, offset),
                                py::reinterpret_borrow<py::object>(c->co_name)));
    }
    return out;
  }
};

void release_stacks() {  // the GIL held
  if (!releasing) return;
  std::vector<const void*> now;
  {
    std::lock_guard<std::mutex> guard(release_mutex);
    now.swap(*to_release);
    releasing = false;
  }
  for (const void* code : now) Py_DECREF(reinterpret_cast<PyObject*>(const_cast<void*>(code)));
}

// held (host memory only): the storage, first seen here, kept alive until drained (see `hold`)
using Shape = c10::SmallVector<int64_t, 5>;  // inline: no allocation per access
struct Span { int64_t storage = 0, start = 0, end = 0, nbytes = -1; c10::Storage held; Shape shape;
              c10::ScalarType dtype = c10::ScalarType::Undefined; bool write = false;
              bool host = false; };  // host: a host storage's (host_op)
// An op's reads and writes (inline for most ops), and its fresh outputs (one for most); functions take either.
using Spans = c10::SmallVectorImpl<Span>;
using Accesses = c10::SmallVector<Span, 3>;
using Outputs = c10::SmallVector<Span, 1>;

// "float", "long", ...: as a tensor's description names its dtype (hb.TensorInfo). Called with the GIL held.
py::str dtype_name(c10::ScalarType dtype) {
  static auto* names = new std::unordered_map<int, py::object>();  // never freed: outlives the interpreter
  auto& name = (*names)[static_cast<int>(dtype)];
  if (!name) name = py::str(torch_compat::dtype_name(dtype));
  return name;
}

// A queued op the feed applies by a fixed rule (tracker.fixed_rules; models.collectives' on_op for a collective
// torch's C++ issued): launched on the stream one argument names (the model's `rule_stream`, asked once per group),
// ordered after the issuing stream and the issuing stream after it, reading and writing the tensors of the arguments
// listed (by the root's rank, for the root-dependent ones).
struct Rule {
  enum Access : uint8_t { kRead, kWrite, kRootReads, kRootWrites };
  const char* name = nullptr;  // interned: the sites made with it outlive the plan
  size_t stream_arg = 0;
  int64_t root_arg = -1;
  std::vector<std::pair<size_t, Access>> tensors;
};

// What to do with an op, decided once (by the tracker's plan) per op overload.
// queued: a modelled namespace's op (collectives), queued for the Python model as it returns; at_issue: queued before it
// runs where torch's C++ issues it (c10d: the events the backend records inside it then order after it)
struct Plan { bool below_autograd = false, record = false, queued = false, at_issue = false, fresh = false,
                   writes_output = false, copy = false, keep_args = false, sync = false;
              std::vector<std::pair<size_t, bool>> args; std::string overload; std::optional<Rule> rule;
              std::vector<std::pair<std::string, bool>> names; };  // keep_args: (name, keyword-only) per argument

// An op's record, or (`what`) a storage's free, a CUDA event recorded or waited on, or a modelled namespace's op (a
// c10d op torch's C++ issued, before it ran; any other, as it returned), in order with the ops.
enum class What : uint8_t { kOp, kFree, kEventRecord, kEventWait, kQueuedStart, kQueuedEnd };
struct Record {
  What what = What::kOp; const char* op = nullptr; int64_t stream = 0; bool in_node = false;
  Accesses accesses; Outputs fresh; std::shared_ptr<Stack> stack;
  int64_t handle = 0;  // a free's storage, an event's handle
  // the autograd sequence number: in forward, of the node the op may create; in backward, of the node running it
  int64_t seq = -1; const char* node = nullptr;  // the node's name, interned (`node_name`)
  // a stream the host waited for inside this op (a read-back: a copy to the host, t[mask]). Not 0 for none: 0 is a
  // stream's key too (the legacy default stream's handle, the virtual default stream)
  std::optional<int64_t> synced;
  bool sync = false;  // the op is a host sync's (tracker.host_syncs): the tracker judges whether it applies
  int64_t touched = 0;  // tensors of the modelled device among its arguments and fresh outputs, empty ones included
  int device = -1;  // on a GPU: the device of its first GPU tensor argument, whose current stream the op runs on
  int64_t device_args = 0, hosts = 0;  // device tensors among its arguments; host storages (host_party) it touches
  // a copy_'s, where host storages exist (host_op): whether it copies into one, from one, and asked not to block
  bool copy_into_host = false, copy_from_host = false, non_blocking = false;
  std::shared_ptr<const Plan> plan; std::vector<c10::IValue> args;  // the arguments, where the plan keeps them
  std::vector<c10::IValue> outputs;  // a queued collective's, as it returned
  // the thread that recorded it: the core applies its launch, syncs and frees with that thread's host clock
  int64_t thread = 0;
  // the op's place among the ops captured on its thread in this session (1, 2, ...; 0: not an op's): with the thread,
  // what names this op in another run of the same program (a confirmation's forced run, `forcing`)
  int64_t ordinal = 0;
};

// Records come from a pool and go back to it once applied (`fresh_record`, `give_back`): an op's record is written
// once, where it is built, and handed over as a pointer. Moved from the op into the queue, and made and destroyed on
// the op's thread, a record (most of a kilobyte) cost about a tenth of the capture's instructions on the launch-bound
// step (benchmarks/instructions.py); made and destroyed by the applier, it is off the program's thread too.
struct Recycle {
  void operator()(Record* r) const noexcept;
};
using Held = std::unique_ptr<Record, Recycle>;
using Batch = std::vector<Held>;

struct Pending : at::ObserverContext {
  Held record; std::shared_ptr<const Plan> plan; std::vector<c10::IValue> inputs; const char* op = nullptr;
  int64_t ordinal = 0;  // Record::ordinal, for queued ops too
  std::vector<at::Tensor> leaves;  // the virtual model's (node_streams::leaves_of)
  static void* operator new(size_t size);  // from the thread's spares (`Here`): one is made and dropped per op
  static void operator delete(void* pointer, size_t size);
};

std::mutex mutex;  // records and plans
Batch records;
Batch spare;  // an emptied buffer of records kept for the next one: no regrowth per drain

// The records so far, for a drain; `records` starts again on the spare buffer.
Batch take_records() {
  Batch taken;
  std::lock_guard<std::mutex> guard(mutex);
  taken.swap(records);
  records.swap(spare);
  return taken;
}

// The pool: records cleared, for any thread's next ones (a thread takes `kPoolBatch` at a time, `fresh_record`). At
// most `kPoolMost` kept: the rest of a burst goes back to malloc.
std::mutex pool_mutex;
auto* pool = new std::vector<Record*>();  // never freed: a thread's exit may give records back after static teardown
constexpr size_t kPoolBatch = 32, kPoolMost = 4096;

void clear(Record* r) {  // as made; what it held let go (a storage may die, and queue its free)
  r->~Record();
  new (r) Record();
}

void to_pool(Record* const* from, size_t n) {
  std::lock_guard<std::mutex> guard(pool_mutex);
  for (size_t i = 0; i < n; ++i) {
    if (pool->size() < kPoolMost) pool->push_back(from[i]);
    else delete from[i];
  }
}

// One record let go of without being queued (an op that launched nothing, a session's leftovers).
void Recycle::operator()(Record* r) const noexcept {
  clear(r);
  to_pool(&r, 1);
}

// A drained buffer back as the spare, its records to the pool. Emptied first, outside the lock: a storage a record
// held may die and queue its free.
void give_back(Batch& drained) {
  thread_local std::vector<Record*> back;
  back.clear();
  for (auto& held : drained) {
    Record* r = held.release();
    if (r == nullptr) continue;
    clear(r);
    back.push_back(r);
  }
  drained.clear();
  to_pool(back.data(), back.size());
  std::lock_guard<std::mutex> guard(mutex);
  if (drained.capacity() > spare.capacity()) spare.swap(drained);
}
// keyed by the op's name, which lives in its schema; shared with the ops running one, as `enable` clears the map
std::unordered_map<const char*, std::shared_ptr<const Plan>> plans;
// The plans outlive a session where the next one asks with the same key (the tracker's `_plans_key`: the backend and
// every other input of its plan) and no op was defined or removed since the map was last emptied (`ops_changes`: a
// removed op's schema name, the map's key, may be reused by an op defined later): asking Python again for every
// distinct op (a few microseconds each) was part of every test's fixed cost. An empty key keeps nothing.
std::string plans_key;  // the key the map's plans were made under; empty: none kept
uint64_t plans_epoch = 0;  // `ops_changes` when the map was emptied
// Every thread, or (host memory: the virtual model, whose fallback is a dispatch mode) the threads that mode would see:
// the enabling thread and those the tracker marks (`observe`: Python threads started in a session). A mark is the
// capture's own thread-local: threads that inherit torch's thread-local state from a marked one (at::launch's, a
// backend's workers inside an op) are not marked.
bool every_thread = true;
std::atomic<bool> on{false};
// Whether the capture may enter Python: a session is on and the interpreter is not finalizing. From the end of the
// atexit handlers on (a followed child's last drain ran there), a thread that takes the GIL, unless it is the one
// finalizing, is ended by pthread_exit, and that unwind through torch's noexcept frames is std::terminate ("terminate
// called without an active exception", SIGABRT); after finalization there is no interpreter to enter. Checked where
// the capture starts work and again where it would take the GIL.
bool live() { return on.load() && Py_IsInitialized(); }
bool cuda = false;
// An op was defined since the kernel entry last looked (the dispatcher's listener says so): the next captured op's
// start hooks it, so an op a test defines inside a session is captured in that session.
std::atomic<bool> ops_added{false};
std::atomic<uint64_t> ops_changes{0};  // ops defined or removed in this process (the same listener)
// Python callables, kept by pointer: a static py::object would be released after the interpreter is gone.
py::object* plan_fn = nullptr;
py::object* drain_fn = nullptr;  // applies the records, called every `kDrainEvery` records

std::atomic<uint64_t> generation{0};  // a session's: what a thread set in an earlier one no longer holds

// What the capture keeps per thread, in one place: a dlopen'ed library reaches each thread-local variable through a
// call (__tls_get_addr), so an entry reads this once. Trivially destructible: readable through the thread's exit.
struct Caches;
struct Here {
  bool observed = false;  // this thread's ops are captured where not every thread's are (`observe`)
  int depth = 0;  // ops below autograd running on this thread
  bool paused = false;  // this thread's work is modelled by hand (set_recording): others still record
  bool draining = false;
  Record* in_flight = nullptr;  // the record of the op this thread is running, until on_end pushes it
  // > 0 while Python issues a collective on this thread (`set_issuing`), in this session (`generation`)
  int issuing = 0;
  uint64_t issuing_generation = 0;
  // Host memory (the virtual model). The current stream is the model's: a small int per stream that Python sets per
  // thread (`set_stream`); 0, the default stream, on a thread that never set one in this session (`generation`).
  int64_t stream = 0;
  uint64_t stream_generation = 0;
  // The kernel entry's autograd number as this thread last saw it, in this session (`moved_seq`)
  int64_t seen_seq = -1;
  uint64_t seen_seq_generation = 0;
  // The ops captured on this thread so far, in this session (`Record::ordinal`), and the last one's, for the records a
  // queued op makes as it starts and as it ends
  int64_t ordinal = 0, last_ordinal = 0;
  uint64_t ordinal_generation = 0;
  // Pending records' blocks, for the next ops on this thread (one at a time but for nesting: a few suffice); given
  // back to malloc when the thread ends (`Reaper`), or at once after that
  void* spare[4] = {};
  int spares = 0;
  Record* cached[kPoolBatch] = {};  // records from the pool, for this thread's next ones (`fresh_record`)
  size_t cached_count = 0;
  bool reaper_armed = false, gone = false;
  int8_t collective_worker = -1;  // `in_collective_worker`, once known (-1: not asked yet)
  int64_t thread_id = 0;  // PyThread_get_thread_ident(), once asked (a thread keeps its ident, in a forked child too)
  Caches* caches = nullptr;  // this thread's caches (`caches_of`), made on first use, freed by the `Reaper`
};
thread_local Here here;
void free_caches(Here& h);  // below, with the caches

// Whether this thread is a c10d backend's worker (gloo's "pt_gloo_runloop"): the ops it runs are a collective's own
// work (gloo stages a CUDA tensor's collective through pinned host memory on a pooled stream of its own and copies
// the result back there), which the collectives model stands for as one access on the group's communication stream,
// ordered by the work's wait(). Their copies are not the program's: recorded, they race with that modelled access.
bool in_collective_worker(Here& h) {
  if (h.collective_worker < 0) {
    char name[16] = {};
#ifdef __linux__
    h.collective_worker = prctl(PR_GET_NAME, name, 0, 0, 0) == 0 && std::strncmp(name, "pt_gloo", 7) == 0;
#else
    h.collective_worker = 0;
#endif
  }
  return h.collective_worker > 0;
}

struct Reaper {  // made on a thread once it keeps a spare or a pooled record: gives them back as the thread ends
  ~Reaper() {
    Here& h = here;
    h.gone = true;
    while (h.spares > 0) ::operator delete(h.spare[--h.spares]);
    to_pool(h.cached, h.cached_count);
    h.cached_count = 0;
    free_caches(h);
  }
};

void arm_reaper(Here& h) {
  if (h.reaper_armed) return;
  h.reaper_armed = true;
  thread_local Reaper reaper;
  (void)reaper;
}

// A cleared record for this thread's next op, free or event: from the thread's records, refilled from the pool.
Held fresh_record(Here& h) {
  if (h.cached_count == 0 && !h.gone) {
    std::lock_guard<std::mutex> guard(pool_mutex);
    size_t n = std::min(kPoolBatch, pool->size());
    std::copy(pool->end() - n, pool->end(), h.cached);
    pool->resize(pool->size() - n);
    h.cached_count = n;
  }
  Record* r;
  if (h.cached_count > 0) {
    r = h.cached[--h.cached_count];
    arm_reaper(h);
  } else {
    r = new Record();
  }
  if (h.thread_id == 0) h.thread_id = static_cast<int64_t>(PyThread_get_thread_ident());
  r->thread = h.thread_id;
  return Held(r);
}

Held fresh_record() { return fresh_record(here); }

void* Pending::operator new(size_t size) {
  Here& h = here;
  if (size == sizeof(Pending) && h.spares > 0) return h.spare[--h.spares];
  return ::operator new(size);
}

void Pending::operator delete(void* pointer, size_t size) {
  Here& h = here;
  if (size != sizeof(Pending) || h.gone || h.spares == 4) return ::operator delete(pointer);
  arm_reaper(h);
  h.spare[h.spares++] = pointer;
}
}  // namespace

// The applier thread (applier.cpp): a session's feed attached. It wakes every millisecond; a thread that pushed
// `kWakeEvery` records since it last took them wakes it sooner (a futex call on that thread: a few a second at most on
// a training step, where the millisecond's wake takes the records first).
namespace applier {
constexpr size_t kWakeEvery = 128;
std::atomic<bool> attached{false};
std::atomic<bool> stalled{false};  // the attached feed's applier left a record for a drain
void wake();
thread_local bool here = false;  // this thread is the applier: nothing it runs may enter Python
}  // namespace applier

namespace {

// Frees: the tracker learns them through a weak reference to the storage, made when it first gets the storage. A
// storage first seen by a record is held by it until drained (so its address is not reused before the tracker
// watches it); `known` are the addresses handed over and not freed since (`mark_free`). Records hold their storages,
// so a drain is forced every `kDrainEvery` of them.
std::mutex known_mutex;
std::unordered_set<int64_t> known;
constexpr size_t kDrainEvery = 256;

// Stacks seen before, by their frames' (code, instruction) pairs: a training loop takes the same few hundred stacks
// again and again, and a hit costs a walk of the frames, without the traceback's allocations and references. Each
// entry's stack holds its code objects, so no other code object can take one of their addresses. Bounded (emptied
// when full); never freed (it would outlive the interpreter). Guarded by `frames_mutex`, with the harness cache below.
struct KnownStack { Frames frames; std::shared_ptr<Stack> stack; };
auto* known_stacks = new std::unordered_map<size_t, KnownStack>();
constexpr size_t kKnownStacks = 4096;
std::mutex frames_mutex;

// Whether a code object is pytest's or pluggy's, as frames.py's `_kind` tells the test harness: no frame beneath it
// is ever named (frames._user_only stops there), so a stack's identity ends with it and the walk need not go on
// through the harness's thirty-odd frames. Cached per code object, which the cache keeps alive so that its address is
// not reused; bounded. `kinds_known` answers from the cache alone (no GIL needed); `harness` fills it (the GIL held).
auto* kinds = new std::unordered_map<PyCodeObject*, bool>();

const bool* kinds_known(PyCodeObject* code) {
  auto found = kinds->find(code);
  return found == kinds->end() ? nullptr : &found->second;
}

bool harness(PyCodeObject* code) {
  if (const bool* known = kinds_known(code)) return *known;
  if (kinds->size() >= 4096) {
    for (auto& entry : *kinds) Py_DECREF(entry.first);
    kinds->clear();
  }
  const char* file = PyUnicode_Check(code->co_filename) ? PyUnicode_AsUTF8(code->co_filename) : nullptr;
  if (file == nullptr) PyErr_Clear();
  std::string name = file != nullptr ? file : "";
  bool is_harness = false;
  for (const char* dir : {"/_pytest/", "/pluggy/", "\\_pytest\\", "\\pluggy\\"})
    is_harness = is_harness || name.find(dir) != std::string::npos;
  Py_INCREF(code);
  kinds->emplace(code, is_harness);
  return is_harness;
}

size_t mixed(size_t hash, const void* code, int lasti) {  // a frame into a stack's hash
  return (hash ^ (reinterpret_cast<size_t>(code) + static_cast<size_t>(lasti))) * 1099511628211ULL;
}

void add_frame(Frames& out, size_t& hash, const void* code, int lasti) {
  out.emplace_back(code, lasti);
  hash = mixed(hash, code, lasti);
}

// One of this thread's latest stacks, and whether its walk stopped at the harness (else at the thread's first frame).
struct Recent { std::shared_ptr<Stack> stack; bool to_harness = false; };

// A plan this thread used, by op name, as of `plans_made` (`plan_for`).
struct CachedPlan { const char* name = nullptr; uint64_t made = 0; std::shared_ptr<const Plan> plan; };
constexpr size_t kCachedPlans = 256;

// What an op's capture looks up per thread, behind the one thread-local `here` (each further thread-local of a
// dlopen'ed library is a call to find, several per op): the thread's latest stacks (`stack_here`: two a set, the set
// by the stack's innermost frames) and its plans (`plan_for`).
constexpr size_t kRecentSets = 32, kRecentWays = 2;
struct Caches {
  Recent recent[kRecentSets * kRecentWays];
  CachedPlan plans[kCachedPlans];
};

Caches* caches_of(Here& h) {  // null once the thread is ending (its `Reaper` ran)
  if (h.caches == nullptr && !h.gone) {
    h.caches = new Caches();
    arm_reaper(h);
  }
  return h.caches;
}

void free_caches(Here& h) {
  delete h.caches;
  h.caches = nullptr;
}

#ifdef STREAMRACE_INTERPRETER_FRAMES
// The calling thread's Python frames, innermost first, down to the test harness's first, and their hash, read from the
// interpreter's own frames: no frame object is made for them (PyEval_GetFrame would make one per new frame, each op).
// Without the GIL (`fill` false) this reads only the thread's own frames, which do not change while it runs this C++
// inside an op it called, and the harness cache: false when a code object is not in it yet. `frames_mutex` is held.
_PyInterpreterFrame* top_frame(PyThreadState* thread) {
#if PY_VERSION_HEX >= 0x030D0000
  return thread->current_frame;
#else
  return thread->cframe->current_frame;
#endif
}

int offset_in(_PyInterpreterFrame* frame, PyCodeObject* code) {  // of its current instruction, in bytes
  return static_cast<int>((PREV_INSTR(frame) - _PyCode_CODE(code)) * sizeof(_Py_CODEUNIT));
}

bool walk_frames(PyThreadState* thread, Frames& out, size_t& hash, bool fill) {
  out.clear();
  hash = 0;
  for (_PyInterpreterFrame* frame = top_frame(thread); frame != nullptr; frame = frame->previous) {
    if (_PyFrame_IsIncomplete(frame)) continue;  // a frame that has not started yet, or the C stack's shim
    PyCodeObject* code = F_CODE(frame);
    const bool* known = kinds_known(code);
    if (known == nullptr && !fill) return false;
    bool last = known != nullptr ? *known : harness(code);
    add_frame(out, hash, code, offset_in(frame, code));
    if (last) break;
  }
  return true;
}

// Whether the calling thread is where `recent` was taken: the same (code, offset) pairs, down to where that walk
// stopped. Reads only this thread's own frames and `recent`'s codes (which its stack holds): no lock, no GIL.
bool same_frames(PyThreadState* thread, const Recent& recent) {
  const Frames& code = recent.stack->code;
  size_t i = 0;
  for (_PyInterpreterFrame* frame = top_frame(thread); frame != nullptr; frame = frame->previous) {
    if (_PyFrame_IsIncomplete(frame)) continue;
    if (i == code.size()) return false;  // deeper than the stack, which ended at its thread's first frame
    PyCodeObject* c = F_CODE(frame);
    if (code[i].first != c || code[i].second != offset_in(frame, c)) return false;
    if (++i == code.size() && recent.to_harness) return true;
  }
  return i == code.size();
}
#else
// The same through frame objects (before Python 3.11, and on versions whose frames this does not know). The GIL and
// `frames_mutex` are held.
bool walk_frames(PyThreadState*, Frames& out, size_t& hash, bool) {
  out.clear();
  hash = 0;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // a new reference, dropped at once: the frame holds it
#if PY_VERSION_HEX >= 0x030B0000
    int lasti = PyFrame_GetLasti(frame);  // in bytes
#else
    int lasti = frame->f_lasti * static_cast<int>(sizeof(_Py_CODEUNIT));
#endif
    bool last = harness(code);
    Py_DECREF(code);
    add_frame(out, hash, code, lasti);
    if (last) {
      Py_DECREF(frame);
      break;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // a new reference
    Py_DECREF(frame);
    frame = back;
  }
  return true;
}
#endif

// Whether a walk's frames stopped at the harness, not at their thread's first frame. `frames_mutex` is held.
bool ends_at_harness(const Frames& frames) {
  if (frames.empty()) return false;
  const bool* known = kinds_known(static_cast<PyCodeObject*>(const_cast<void*>(frames.back().first)));
  return known != nullptr && *known;
}

// The stack of the calling thread's frames from `known_stacks`, made and kept there if new.
Recent known_stack(PyThreadState* thread) {
  thread_local Frames frames;
  size_t hash = 0;
#ifdef STREAMRACE_INTERPRETER_FRAMES
  {
    std::lock_guard<std::mutex> guard(frames_mutex);
    if (walk_frames(thread, frames, hash, false)) {
      auto found = known_stacks->find(hash);
      if (found != known_stacks->end() && found->second.frames == frames)
        return {found->second.stack, ends_at_harness(frames)};
    }
  }
#endif
  if (!Py_IsInitialized()) return {nullptr, false};
  py::gil_scoped_acquire gil;
  bool to_harness;
  {
    std::lock_guard<std::mutex> guard(frames_mutex);
    walk_frames(thread, frames, hash, true);
    to_harness = ends_at_harness(frames);
    auto found = known_stacks->find(hash);
    if (found != known_stacks->end() && found->second.frames == frames) return {found->second.stack, to_harness};
  }
  release_stacks();
  auto s = std::make_shared<Stack>(frames);
  std::lock_guard<std::mutex> guard(frames_mutex);
  if (known_stacks->size() >= kKnownStacks) known_stacks->clear();
  (*known_stacks)[hash] = KnownStack{frames, s};
  return {s, to_harness};
}

#ifdef STREAMRACE_INTERPRETER_FRAMES
// The set of this thread's recent stacks where the calling thread's stack would be: by its two innermost frames'
// (code, offset) pairs, which tell most sites apart (a compiled graph's launches, each from a line of its own).
size_t recent_set(PyThreadState* thread) {
  size_t hash = 0;
  int seen = 0;
  for (_PyInterpreterFrame* frame = top_frame(thread); frame != nullptr && seen < 2; frame = frame->previous) {
    if (_PyFrame_IsIncomplete(frame)) continue;
    PyCodeObject* c = F_CODE(frame);
    hash = mixed(hash, c, offset_in(frame, c));
    ++seen;
  }
  return (hash ^ (hash >> 29)) % kRecentSets;
}
#endif

// None on a thread with no Python thread state (a C++ worker): it has no frames to take, and taking them would create
// and drop a thread state per op; and where the interpreter's frames are read, on one that runs no Python now.
// A training step takes the same few dozen stacks again and again (a compiled graph's launches, each from a line of
// its own; a loop's layers from the same lines): this thread's recent stacks, in sets by their innermost frames, the
// latest of a set first, are tried by comparing frames, without the harness lookups, the hash or the lock of
// `known_stacks`. A stack seen before is found there without the GIL where the interpreter's frames can be read; a new
// one takes the GIL.
std::shared_ptr<Stack> stack_here(Here& h) {
  timers::Scope timed(timers::kFrames);
  if (!Py_IsInitialized()) return nullptr;  // its thread states may be gone already
  PyThreadState* thread = PyGILState_GetThisThreadState();
  if (thread == nullptr) return nullptr;
#ifdef STREAMRACE_INTERPRETER_FRAMES
  // (the autograd engine's device thread in a backward: one empty stack for all its ops would have each record move
  // that stack's count between this core and the applier's)
  if (top_frame(thread) == nullptr) return nullptr;
  Caches* caches = caches_of(h);
  if (caches == nullptr) return known_stack(thread).stack;
  Recent* set = caches->recent + recent_set(thread) * kRecentWays;
  for (size_t i = 0; i < kRecentWays && set[i].stack; ++i)
    if (same_frames(thread, set[i])) {
      std::rotate(set, set + i, set + i + 1);
      return set[0].stack;
    }
  std::move_backward(set, set + kRecentWays - 1, set + kRecentWays);
  set[0] = known_stack(thread);
  return set[0].stack;
#else
  (void)h;
  return known_stack(thread).stack;
#endif
}

std::shared_ptr<Stack> stack_here() { return stack_here(here); }

bool reaches_kernel(const c10::OperatorHandle& op) {  // what reaches the dispatch mode: no decomposition above it
  using K = c10::DispatchKey;
  for (K key : {K::CUDA, K::CPU, K::CompositeExplicitAutograd, K::CompositeExplicitAutogradNonFunctional})
    if (op.hasKernelForDispatchKey(key)) return true;
  return false;
}

const char* interned(const std::string& text) {  // on any thread; never freed
  static std::mutex texts_mutex;
  static auto* texts = new std::unordered_set<std::string>();
  std::lock_guard<std::mutex> guard(texts_mutex);
  return texts->insert(text).first->c_str();
}

// Autograd nodes' names by node class (`node_name`)
std::mutex names_mutex;
auto* names_by_class = new std::unordered_map<std::type_index, const char*>();

Rule rule_of(py::handle spec) {  // (name, stream argument, root argument or -1, [(argument, access)])
  auto t = spec.cast<py::tuple>();
  Rule rule;
  rule.name = interned(t[0].cast<std::string>());
  rule.stream_arg = t[1].cast<size_t>();
  rule.root_arg = t[2].cast<int64_t>();
  for (auto item : t[3].cast<py::list>()) {
    auto pair = item.cast<py::tuple>();
    auto access = pair[1].cast<std::string>();
    rule.tensors.push_back({pair[0].cast<size_t>(), access == "r" ? Rule::kRead : access == "w" ? Rule::kWrite
                                                    : access == "root reads" ? Rule::kRootReads : Rule::kRootWrites});
  }
  return rule;
}

// An op as the kernel entry (kernel_entry.cpp) hands it over, below autograd. `name` is the schema's, alive as long as
// the op (plans key on it); `inputs` are the call's arguments, valid until the op runs.
struct OpCall {
  const char* name;
  c10::ArrayRef<c10::IValue> inputs;
  const c10::OperatorHandle& op;
};

std::shared_ptr<const Plan> planned(const OpCall& call) {
  {
    std::lock_guard<std::mutex> guard(mutex);
    auto found = plans.find(call.name);
    if (found != plans.end()) return found->second;
  }
  const c10::OperatorName& name = call.op.operator_name();
  auto made = std::make_shared<Plan>();
  Plan& plan = *made;
  plan.below_autograd = reaches_kernel(call.op);
  plan.copy = name.name == "aten::copy_";
  plan.overload = name.overload_name;
  if (plan.below_autograd) {
    if (!Py_IsInitialized()) return nullptr;
    py::gil_scoped_acquire gil;
    if (plan_fn == nullptr) return nullptr;
    timers::Callout python;
    py::object got = (*plan_fn)(name.name, name.overload_name);
    py::object rule = py::none();
    if (py::isinstance<py::tuple>(got) && py::len(got) == 2 && py::isinstance<py::str>(got.cast<py::tuple>()[0])) {
      rule = got.cast<py::tuple>()[1];  // ("queued at issue", a fixed rule)
      got = got.cast<py::tuple>()[0];
    }
    if (py::isinstance<py::str>(got)) {
      auto how = got.cast<std::string>();
      plan.queued = true;
      plan.at_issue = how == "queued at issue";
      if (!rule.is_none()) plan.rule = rule_of(rule);
    } else if (!got.is_none()) {
      auto t = got.cast<py::tuple>();
      for (auto item : t[0].cast<py::list>()) {
        auto pair = item.cast<py::tuple>();
        plan.args.push_back({pair[0].cast<size_t>(), pair[1].cast<bool>()});
      }
      plan.fresh = t[1].cast<bool>();
      plan.writes_output = t[2].cast<bool>();
      plan.record = true;
      plan.keep_args = t[3].cast<bool>();  // a host sync that depends on them (host memory)
      plan.sync = t[4].cast<bool>();
      if (plan.keep_args)
        for (const auto& a : call.op.schema().arguments()) plan.names.push_back({a.name(), a.kwarg_only()});
    }
  }
  std::lock_guard<std::mutex> guard(mutex);
  return plans.emplace(call.name, std::move(made)).first->second;
}

// This thread's plans by op name, from the map as of `plans_made` (`clear_all` moves it on): a hit takes no lock.
std::atomic<uint64_t> plans_made{1};

std::shared_ptr<const Plan> plan_for(Here& h, const OpCall& call) {
  Caches* caches = caches_of(h);
  if (caches == nullptr) return planned(call);
  uint64_t made = plans_made.load(std::memory_order_acquire);
  CachedPlan& slot = caches->plans[(reinterpret_cast<uintptr_t>(call.name) >> 3) % kCachedPlans];
  if (slot.name == call.name && slot.made == made) return slot.plan;
  auto plan = planned(call);
  if (plan != nullptr) slot = CachedPlan{call.name, made, plan};
  return plan;
}

bool on_device(const at::Tensor& t) { return cuda ? t.device().is_cuda() : t.device().is_cpu(); }

// Host storages (host_party.py): host memory a stream's copy touches, by data pointer, marked by the tracker. An op
// whose tensors are host storages and no device memory is the host's: recorded on its thread's host timeline (the
// stream `kHostStream`, which the feed turns into that thread's timeline). Code that marks none pays a relaxed load.
constexpr int64_t kHostStream = std::numeric_limits<int64_t>::min();
std::mutex hosts_mutex;
std::unordered_set<int64_t> host_storages;
std::atomic<bool> any_hosts{false};

bool is_host_storage(const at::Tensor& t) {
  if (!any_hosts.load(std::memory_order_relaxed) || !t.device().is_cpu() || !t.has_storage()) return false;
  auto key = reinterpret_cast<int64_t>(t.storage().data());
  std::lock_guard<std::mutex> guard(hosts_mutex);
  return host_storages.count(key) > 0;
}

}  // namespace
void queue_free(int64_t ptr);  // below: a free queued in order with the ops
void hook_ops(bool expand, bool session_start);  // kernel_entry.cpp
namespace {

// Host memory: the default CPU allocator's deleter (taken in `enable`), and ours, which a storage from that allocator
// gets when first recorded: its free is then queued from C++ as it happens, in order with the ops, without a Python
// storage object, a weak reference or a Python callback per storage. The deleter stays after the session (the
// extension is never unloaded); outside a session it only frees.
c10::DeleterFnPtr cpu_deleter = nullptr;
bool reporting_frees = false;  // the tracker learns host frees (track_frees), and `cpu_deleter` is known
void freed_on_host(void* data) {
  if (live()) queue_free(reinterpret_cast<int64_t>(data));
  cpu_deleter(data);
}

// Whether the storage's free reaches `freed_on_host` (from now on). Not for other allocators' storages (pinned, shared,
// numpy's, copy-on-write), whose context is not the plain data pointer: those are held and watched (`hold`).
bool frees_reported(const at::Tensor& t) {
  auto& data = t.storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks();
  if (data.get_deleter() == &freed_on_host) return true;
  return reporting_frees && data.get_context() == data.get() &&
         data.compare_exchange_deleter(cpu_deleter, &freed_on_host);
}

// Host memory: a storage whose address the tracker does not watch yet is held by the record (see `known`).
void hold(Span& span, const at::Tensor& t) {
  {
    std::lock_guard<std::mutex> guard(known_mutex);
    if (!known.insert(span.storage).second) return;
  }
  span.held = t.storage();
}

void add(Record& r, Spans& out, const at::Tensor& t, bool write, bool fresh) try {
  if (!t.defined()) return;
  const auto* impl = t.unsafeGetTensorImpl();
  // a Python scalar boxed for the kernel; a tensor subclass nested in a list argument (whose op is not recorded)
  if (impl->is_wrapped_number() || impl->key_set().has(c10::DispatchKey::Python)) return;
  bool host = is_host_storage(t);
  if (host) {
    ++r.hosts;
  } else if (on_device(t)) {
    ++r.touched;
    if (!fresh) ++r.device_args;
    if (cuda && r.device < 0) r.device = t.get_device();
  } else {
    return;  // not the modelled device (host memory under cuda)
  }
  if (!t.has_storage() || t.numel() == 0) return;
  int64_t size = t.element_size(), start = t.storage_offset() * size, last = 0;
  if (t.is_contiguous()) last = t.numel() - 1;
  else for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  auto key = reinterpret_cast<int64_t>(t.storage().data());
  if (key == 0) return;
  Span& span = out.emplace_back();
  span.storage = key;
  span.start = start;
  span.end = start + (last + 1) * size;
  span.write = write;
  span.dtype = t.scalar_type();
  if (fresh) span.nbytes = static_cast<int64_t>(t.storage().nbytes());
  span.shape.assign(t.sizes().begin(), t.sizes().end());  // in place: a Shape moved is its dims copied
  span.host = host;
  if (!cuda && !frees_reported(t)) hold(span, t);
} catch (const std::exception&) {
  return;  // no plain storage to read (functionalization wrappers and the like)
}

void add_value(Record& r, Spans& out, const c10::IValue& v, bool write, bool fresh) {
  if (v.isTensor()) add(r, out, v.toTensor(), write, fresh);
  else if (v.isTensorList()) for (const at::Tensor& t : v.toTensorList()) add(r, out, t, write, fresh);
  else if (v.isList()) for (const auto& e : v.toListRef()) if (e.isTensor()) add(r, out, e.toTensor(), write, fresh);
}

bool is_subclass(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const auto& t = v.toTensor();
  return t.defined() && t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python);
}

// An op on a tensor subclass (DTensor, FSDP2's sharded parameters): its own dispatch runs the op on the plain tensors
// that hold the bytes — those are recorded, as under the dispatch mode, so the outer op neither records nor nests.
bool on_subclass(const OpCall& call) {
  for (const auto& v : call.inputs) {
    if (is_subclass(v)) return true;
    if (v.isList()) for (const auto& e : v.toListRef()) if (is_subclass(e)) return true;
  }
  return false;
}

// x.copy_(y) where both are views of the same bytes: ATen returns before launching anything (no access).
bool copies_onto_itself(const OpCall& call) {
  auto inputs = call.inputs;
  if (inputs.size() < 2 || !inputs[0].isTensor() || !inputs[1].isTensor()) return false;
  const auto& a = inputs[0].toTensor();
  const auto& b = inputs[1].toTensor();
  return a.defined() && b.defined() && a.is_alias_of(b) && a.storage_offset() == b.storage_offset() &&
         a.sizes().equals(b.sizes()) && a.strides().equals(b.strides()) && a.scalar_type() == b.scalar_type() &&
         a.is_conj() == b.is_conj() && a.is_neg() == b.is_neg();
}

// A copy from the device into pageable host memory: CUDA returns from it only once it is done, non_blocking or not,
// and torch reports no synchronize for a non-blocking one (host_sync.py's "copy_" rule, where arguments are seen).
bool into_pageable_host(const OpCall& call) {
  auto inputs = call.inputs;
  if (inputs.size() < 2 || !inputs[0].isTensor() || !inputs[1].isTensor()) return false;
  const auto& dst = inputs[0].toTensor();
  const auto& src = inputs[1].toTensor();
  return dst.defined() && src.defined() && src.is_cuda() && dst.device().is_cpu() && !dst.is_pinned();
}

// An op's values as Python objects: its arguments as a tuple; its outputs as the op returns them (one, or a tuple).
py::tuple values_object(const std::vector<c10::IValue>& values) {
  py::tuple out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = torch::jit::toPyObject(values[i]);
  return out;
}

py::object outputs_object(const std::vector<c10::IValue>& outputs) {  // None for none (a queued op's start)
  if (outputs.empty()) return py::none();
  if (outputs.size() == 1) return torch::jit::toPyObject(outputs[0]);
  return values_object(outputs);
}

py::object stack_object(const Record& r) { return r.stack ? py::cast(r.stack) : py::object(py::none()); }

// A queued collective's arguments to tracker._queued: (name, overload, args, outputs or None, phase, stream, stack,
// ordinal).
py::tuple queued_call(const Record& r, py::object stream) {
  return py::make_tuple(r.op, r.plan->overload, values_object(r.args), outputs_object(r.outputs),
                        r.what == What::kQueuedStart ? "start" : "end", std::move(stream), stack_object(r),
                        r.ordinal);
}

// The virtual model's stream on this thread (its small int; 0, the default stream, where none was set this session).
int64_t stream_now() {
  const Here& h = here;
  return h.stream_generation == generation.load(std::memory_order_relaxed) ? h.stream : 0;
}

// This thread's current stream as records key it: the CUDA stream's handle, or the virtual model's small int. On a GPU,
// `device`'s current stream, where the op has a tensor there (a kernel runs on its tensors' device, under a guard
// for it, on that device's current stream), else the current device's (asking which device is current is a call into
// the CUDA runtime per op, which the tensor's device saves).
int64_t current_stream(int device = -1) {
  if (!cuda) return stream_now();
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Device on = device >= 0 ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device))
                               : impl->getDevice();
  return reinterpret_cast<int64_t>(torch_compat::stream_handle(impl->getStream(on)));
}

// Below autograd, the node an op made is already numbered: the first recording op on this thread to see the number
// moved on since the last one made node (number - 1), as the dispatch mode reads it (tracker._site); -1 for the others
// and for the thread's first op in a session (its number may be older than the session).
int64_t moved_seq(Here& h) {
  uint64_t now_generation = generation.load(std::memory_order_relaxed);
  int64_t last = h.seen_seq_generation == now_generation ? h.seen_seq : -1;
  auto now = static_cast<int64_t>(at::sequence_number::peek());
  h.seen_seq = now;
  h.seen_seq_generation = now_generation;
  return now != last && last >= 0 && now > 0 ? now - 1 : -1;
}

// A node's name, interned: a node class names all its nodes alike (the generated ones return a literal; the default
// is the class's), so it is asked once per class, not per op (a std::string made per backward op, most too long to be
// stored inline), and read where the applier makes the site. But for a Python autograd Function's node (PyNode), whose
// name is its Python class's: asked every time, outside the lock (it takes the GIL, which a thread waiting for the
// lock may hold). The names of a process's node classes are few; never freed.
const char* node_name(torch::autograd::Node* node) {
  std::type_index type(typeid(*node));
  {
    std::lock_guard<std::mutex> guard(names_mutex);
    auto found = names_by_class->find(type);
    if (found != names_by_class->end()) return found->second;
  }
  const char* name = interned(node->name());
  if (std::strstr(type.name(), "PyNode") == nullptr) {
    std::lock_guard<std::mutex> guard(names_mutex);
    names_by_class->emplace(type, name);
  }
  return name;
}

// Whether an autograd node runs on this thread; if so the record takes its number and name (backward sites).
bool in_node(Record& r) {
  auto node = torch::autograd::get_current_node();
  if (node == nullptr) return false;
  r.in_node = true;
  r.seq = static_cast<int64_t>(node->sequence_nr());
  r.node = node_name(node.get());
  return true;
}

void queue_modelled(const char* op, std::shared_ptr<const Plan> plan, std::vector<c10::IValue> args,
                   std::vector<c10::IValue> outputs, What what);  // below

// The next op's place on this thread in this session (`Record::ordinal`).
int64_t next_ordinal(Here& h) {
  uint64_t now = generation.load(std::memory_order_relaxed);
  if (h.ordinal_generation != now) {
    h.ordinal = 0;
    h.ordinal_generation = now;
  }
  h.last_ordinal = ++h.ordinal;
  return h.ordinal;
}

bool issuing() {  // Python issues the collective this thread runs
  const Here& h = here;
  return h.issuing > 0 && h.issuing_generation == generation.load(std::memory_order_relaxed);
}

// Whether an op that touches host storages is the host's own (tracker._host_side says why): on a GPU, one that
// touches no device memory; on the virtual backend, any but a copy between the device and a host storage (into device
// memory from one; into one from device memory where non_blocking asks for it). Its accesses are then the host
// storages' alone (a host op's other CPU tensors stand for host data), and its fresh outputs none of the device's.
bool host_op(Record& r) {
  bool host;
  if (cuda) {
    host = r.device_args == 0 && r.touched == 0;
  } else if (r.op == nullptr || std::strcmp(r.op, "aten::copy_") != 0 || r.device_args == 0) {
    host = true;
  } else {
    host = r.copy_into_host && !(r.non_blocking && !r.copy_from_host);
  }
  if (!host) return false;
  if (!cuda) {
    auto kept = std::remove_if(r.accesses.begin(), r.accesses.end(), [](const Span& s) { return !s.host; });
    r.accesses.erase(kept, r.accesses.end());
    r.fresh.clear();
  }
  return true;
}

std::unique_ptr<at::ObserverContext> on_start(const OpCall& call) {
  timers::Scope timed(timers::kCapture);
  Here& h = here;
  if (h.depth > 0 || h.paused || !live() || (cuda && in_collective_worker(h))) return nullptr;
  if (ops_added.load(std::memory_order_relaxed)) hook_ops(!cuda, false);
  auto plan = plan_for(h, call);
  if (plan == nullptr || !plan->below_autograd) return nullptr;
  if (on_subclass(call) || (plan->copy && copies_onto_itself(call))) return nullptr;
  ++h.depth;
  auto pending = std::make_unique<Pending>();
  pending->plan = plan;
  pending->ordinal = next_ordinal(h);
  if (!cuda) node_streams::leaves_of(call.inputs, pending->leaves);
  if (plan->queued) {
    pending->inputs.assign(call.inputs.begin(), call.inputs.end());
    pending->op = call.name;
    if (plan->at_issue && !issuing()) queue_modelled(call.name, plan, pending->inputs, {}, What::kQueuedStart);
  }
  if (plan->record) {
    pending->record = fresh_record(h);
    Record& r = *pending->record;
    r.op = call.name;
    r.ordinal = pending->ordinal;
    r.sync = plan->sync;
    if (!in_node(r)) r.seq = moved_seq(h);
    auto inputs = call.inputs;
    r.accesses.reserve(plan->args.size());
    for (const auto& [index, write] : plan->args)
      if (index < inputs.size()) add_value(r, r.accesses, inputs[index], write, false);
    r.stream = current_stream(r.device);
    if (plan->keep_args) {
      r.plan = plan;
      r.args.assign(inputs.begin(), inputs.end());
    }
    r.stack = stack_here(h);
    if (cuda && plan->copy && into_pageable_host(call)) r.synced = r.stream;
    if (!cuda && plan->copy && any_hosts.load(std::memory_order_relaxed) && inputs.size() >= 2 &&
        inputs[0].isTensor() && inputs[1].isTensor()) {
      r.copy_into_host = is_host_storage(inputs[0].toTensor());
      r.copy_from_host = is_host_storage(inputs[1].toTensor());
      r.non_blocking = inputs.size() > 2 && inputs[2].isBool() && inputs[2].toBool();
    }
    h.in_flight = &r;
  }
  return pending;
}

// Host memory: the tracker applies the records now, on this thread (their storages are held until then).
void drain_now() {
  Here& h = here;
  if (h.draining) return;
  if (!live()) return;
  py::gil_scoped_acquire gil;
  if (drain_fn == nullptr || !on.load()) return;
  py::object fn = *drain_fn;  // a reference of our own: `disable` may release the stored one meanwhile
  h.draining = true;
  bool was_paused = h.paused;
  h.paused = true;  // whatever the tracker runs is not the program's
  timers::Callout python;
  try {
    fn();
  } catch (py::error_already_set& error) {
    error.discard_as_unraisable("streamrace: applying captured ops");
  }
  h.paused = was_paused;
  h.draining = false;
}

void push(Held&& r) {
  size_t now;
  {
    std::lock_guard<std::mutex> guard(mutex);
    records.push_back(std::move(r));
    now = records.size();
  }
  if (now >= kDrainEvery) return drain_now();
  if (now % applier::kWakeEvery != 0 || !applier::attached.load(std::memory_order_relaxed)) return;
  // the applier waits for a drain (a record needed Python: a stream's first op, ...): this thread drains sooner
  if (applier::stalled.load(std::memory_order_relaxed)) drain_now();
  else applier::wake();
}

// A modelled namespace's op the Python model takes from the records, with its arguments (and outputs), this thread's
// stream and stack: applied in order at the next drain, on whichever thread drains, with no Python here. A c10d
// collective torch's C++ issues (DDP's reducer, from the autograd engine's thread) is queued before it runs; one Python
// issues, and every functional collective, as it returns with its Work or outputs (collectives.py says why each). The
// values hold the op's tensors until drained.
void queue_modelled(const char* op, std::shared_ptr<const Plan> plan, std::vector<c10::IValue> args,
                   std::vector<c10::IValue> outputs, What what) {
  Here& h = here;
  Held held = fresh_record(h);
  Record& r = *held;
  r.what = what;
  r.op = op;
  r.plan = std::move(plan);
  r.args = std::move(args);
  r.outputs = std::move(outputs);
  r.stream = current_stream();
  r.stack = stack_here(h);
  r.ordinal = h.last_ordinal;
  push(std::move(held));
}

void on_end(c10::ArrayRef<c10::IValue> outputs, at::ObserverContext* context) {
  if (context == nullptr) return;
  timers::Scope timed(timers::kCapture);
  auto* pending = static_cast<Pending*>(context);
  const Plan* plan = pending->plan.get();
  if (!pending->leaves.empty()) node_streams::bind_leaves(pending->leaves, stream_now());
  Here& h = here;
  --h.depth;
  if (plan->queued) {
    if (!plan->at_issue || issuing()) {
      queue_modelled(pending->op, pending->plan, std::move(pending->inputs), outputs.vec(),
                    What::kQueuedEnd);
    }
    return;
  }
  if (!plan->record) return;
  h.in_flight = nullptr;
  Record& r = *pending->record;
  if (plan->fresh) {
    r.fresh.reserve(outputs.size());
    for (const auto& v : outputs) add_value(r, r.fresh, v, plan->writes_output, true);
  }
  if (r.hosts > 0 && host_op(r)) {
    r.stream = kHostStream;  // the host's own op: its thread's host timeline
  } else if (!cuda && r.touched == 0) {
    return;  // no tensor of the modelled device: no launch, as under the dispatch mode
  }
  push(std::move(pending->record));
}

py::tuple shape_of(const Span& t) {
  py::tuple shape(t.shape.size());
  for (size_t i = 0; i < t.shape.size(); ++i) shape[i] = t.shape[i];
  return shape;
}

}  // namespace

// Records and addresses dropped outside the locks: a storage a record held may die, and its weak reference call back.
void clear_all(bool keep_plans = false) {
  Batch dropped;
  {
    std::lock_guard<std::mutex> guard(mutex);
    if (!keep_plans) {
      plans.clear();
      plans_made.fetch_add(1, std::memory_order_release);
      plans_key.clear();
      plans_epoch = ops_changes.load(std::memory_order_relaxed);
    }
    dropped.swap(records);
  }
  {
    std::lock_guard<std::mutex> guard(hosts_mutex);
    host_storages.clear();
    any_hosts.store(false, std::memory_order_relaxed);
  }
  std::lock_guard<std::mutex> guard(known_mutex);
  known.clear();
}

// This thread's ops are captured from now on (once enabled for some threads only); false if they were already.
bool observe() {
  Here& h = here;
  if (every_thread || h.observed) return false;
  h.observed = true;
  return true;
}

void unobserve() { here.observed = false; }

// Whether the plans kept may serve a session planning under `key` (under the GIL, as `enable` and `disable` run).
bool plans_hold(const std::string& key) {
  return !key.empty() && key == plans_key && plans_epoch == ops_changes.load(std::memory_order_relaxed);
}

void enable(bool on_cuda, py::object plan, py::object drain, bool all_threads, bool host_frees,
            const std::string& key) {
  if (on_cuda) torch_compat::ready_for_gpu_streams();
  cuda = on_cuda;
  if (!cuda && host_frees && cpu_deleter == nullptr)
    cpu_deleter = c10::GetDefaultCPUAllocator()->allocate(1).get_deleter();
  reporting_frees = !cuda && host_frees && cpu_deleter != nullptr;
  delete plan_fn;
  delete drain_fn;
  plan_fn = new py::object(plan);
  drain_fn = drain.is_none() ? nullptr : new py::object(drain);
  generation.fetch_add(1);  // every thread back on the default stream
  clear_all(plans_hold(key));
  plans_key = key;
  every_thread = all_threads;
  hook_ops(!cuda, true);  // aten::expand: the virtual model binds AccumulateGrad nodes at p.expand_as(p)
  on.store(true);
  if (!every_thread) observe();
}

// keep_plans: the session's plan inputs are as they were at `enable` (else its plans are dropped).
void disable(bool keep_plans) {
  on.store(false);
  // other threads keep their marks: they record into the next session, as a forwarding mode would
  if (!every_thread) unobserve();
  clear_all(keep_plans && plans_hold(plans_key));
  delete plan_fn;  // called from Python: the GIL is held; outside the lock, as releasing them may run Python
  delete drain_fn;
  plan_fn = drain_fn = nullptr;
}

void set_recording(bool value) { here.paused = !value; }

// Python issues a collective on this thread (true) or is done issuing it (false): its c10d op is queued as it returns.
void set_issuing(bool value) {
  uint64_t now = generation.load(std::memory_order_relaxed);
  Here& h = here;
  if (h.issuing_generation != now) h.issuing = 0;
  h.issuing_generation = now;
  h.issuing = std::max(0, h.issuing + (value ? 1 : -1));
}

// The virtual model's current stream on this thread (its small int for the stream; 0: the default stream).
void set_stream(int64_t stream) {
  here.stream = stream;
  here.stream_generation = generation.load(std::memory_order_relaxed);
  node_streams::stream_set(stream);
}

// A kernel the capture does not see as an op (compiled code's: Triton's, Inductor's C++ kernels), recorded in order
// with the ops: on `stream` (None: this thread's current), each tensor among `args` is read where its entry in `roles`
// has bit 1 and written where it has bit 2 (Inductor's argument conventions, models/compiled.py). Taken as the launch's
// own Python objects: a compiled step launches dozens, and no list is built per launch. The GIL is held (`interned`
// relies on it: a record's op name outlives it). False when nothing is captured here (the tracker then runs it the slow
// way).
bool record_kernel(const std::string& name, std::optional<int64_t> stream, py::handle args, py::handle roles) {
  Here& h = here;
  if (!live() || h.paused) return false;
  timers::Scope timed(timers::kCapture);
  py::tuple arg_tuple = py::reinterpret_borrow<py::object>(args);  // a tuple already (a call's *args): no copy
  py::tuple role_tuple = py::reinterpret_borrow<py::object>(roles);
  Held held = fresh_record(h);
  Record& r = *held;
  r.op = interned(name);
  in_node(r);
  size_t n = std::min(arg_tuple.size(), role_tuple.size());
  for (int bit : {1, 2})  // every read, then every write (an in-out argument is both)
    for (size_t i = 0; i < n; ++i) {
      PyObject* arg = PyTuple_GET_ITEM(arg_tuple.ptr(), i);
      if (!THPVariable_Check(arg)) continue;
      long role = PyLong_AsLong(PyTuple_GET_ITEM(role_tuple.ptr(), i));
      if (role == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (role & bit) add(r, r.accesses, THPVariable_Unpack(arg), bit == 2, false);
    }
  if (r.accesses.empty()) return true;
  r.stream = stream ? *stream : current_stream(r.device);
  r.stack = stack_here(h);
  push(std::move(held));
  return true;
}

// The host waits for `stream` inside the op this thread is running (torch reports the sync from within the op, before
// the op is recorded): kept on the op's record, so the wait lands right after the op. False when no op is in flight.
bool sync_inside_op(int64_t stream) {
  if (here.in_flight == nullptr) return false;
  here.in_flight->synced = stream;
  return true;
}

// Whether this thread is running a captured op (a sync reported now is that op's: a read-back's).
bool in_op() { return here.in_flight != nullptr; }

// A host storage (host_party.py) from now on, or no longer (freed: its address may be another storage's).
void mark_host(int64_t ptr) {
  std::lock_guard<std::mutex> guard(hosts_mutex);
  host_storages.insert(ptr);
  any_hosts.store(true, std::memory_order_relaxed);
}

void unmark_host(int64_t ptr) {
  std::lock_guard<std::mutex> guard(hosts_mutex);
  host_storages.erase(ptr);
  any_hosts.store(!host_storages.empty(), std::memory_order_relaxed);
}

// A storage freed (the allocator's callback, or a storage's weak reference): queued in order with the ops. Its address
// may be handed out again from now on, to a storage the tracker does not watch yet. stack: whether to take one.
// A free or an event, queued in order with the ops without forcing a drain (it may come from the allocator, on any
// thread).
void enqueue(What what, int64_t handle, int64_t stream, std::shared_ptr<Stack> stack) {
  Held held = fresh_record();
  held->what = what;
  held->handle = handle;
  held->stream = stream;
  held->stack = std::move(stack);
  std::lock_guard<std::mutex> guard(mutex);
  records.push_back(std::move(held));
}

void mark_free(int64_t ptr, bool stack) {
  timers::Scope timed(timers::kCapture);
  // no longer host memory from now on: the allocator may hand the address to the next storage before the free is
  // applied, and that one is classified as its op is captured
  if (any_hosts.load(std::memory_order_relaxed)) unmark_host(ptr);
  std::shared_ptr<Stack> taken = stack ? stack_here() : nullptr;
  {
    std::lock_guard<std::mutex> guard(known_mutex);
    known.erase(ptr);
  }
  enqueue(What::kFree, ptr, 0, std::move(taken));
}

// A CUDA event recorded on `stream`, or `stream` waiting on it (`wait`), as the GPU trace reports it (gpu_trace.cpp's
// interpreter, in a session, from any thread): queued in order with the ops; the feed applies it to the core with no
// Python. No stack (an event's record or wait is never a race's access).
void event_from_trace(bool wait, int64_t event, int64_t stream) {
  if (live()) enqueue(wait ? What::kEventWait : What::kEventRecord, event, stream, nullptr);
}

// torch's GPU trace calls `<registry>.fire_callbacks(...)`, the GIL taken, for every caching-allocator allocation and
// free and every event created or destroyed (torch.cuda._gpu_trace), and the Python method loops over its callbacks:
// a frame or two per call, even for registries nobody listens to. The cuda model puts these C functions in its place
// while it is the only listener (models/cuda.py, `TraceShortcut`): `traced_free` queues the free (`queue_free`).
std::atomic<streamrace_hb::PyCore*> free_core{nullptr};  // the Feed's core, while there is one

// A free reported to C++ (the allocator's, through `traced_free`; a storage's weak reference, the Feed's
// `dead_callback`): queued in order with the ops, with a stack only where the Feed's core says frees can race (no
// Feed: always, as hb.py's path would ask it).
void queue_free(int64_t ptr) {
  auto* core = free_core.load();
  mark_free(ptr, core == nullptr || core->frees_can_race());
}

PyObject* traced_nothing(PyObject*, PyObject* const*, Py_ssize_t) { Py_RETURN_NONE; }

// An allocator free reported through the trace, while a session captures: from gpu_trace.cpp's interpreter (handed
// over as a capsule), or from torch's through `traced_free`.
void free_from_trace(int64_t ptr) {
  if (live()) queue_free(ptr);
}

PyObject* traced_free(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) Py_RETURN_NONE;
  long long ptr = PyLong_AsLongLong(args[0]);
  if (ptr == -1 && PyErr_Occurred()) return nullptr;  // torch logs it: its trace passes an int, so never here
  try {
    free_from_trace(ptr);
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef traced_defs[] = {
    {"traced_nothing", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(traced_nothing)), METH_FASTCALL,
     "A GPU trace event nobody listens to."},
    {"traced_free", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(traced_free)), METH_FASTCALL,
     "A caching-allocator free, queued in order with the captured ops."},
};

// the stream the host waited for inside the op, or None
py::object synced_of(const Record& r) { return r.synced ? py::object(py::int_(*r.synced)) : py::object(py::none()); }

// (args, kwargs) of an op whose plan keeps them, as the dispatch mode would hand them over
py::object arguments_of(const Record& r) {
  if (!r.plan) return py::none();
  py::list positional;
  py::dict keywords;
  const auto& names = r.plan->names;
  for (size_t i = 0; i < r.args.size(); ++i) {
    py::object value = torch::jit::toPyObject(r.args[i]);
    if (i < names.size() && names[i].second) keywords[py::str(names[i].first)] = value;
    else positional.append(value);
  }
  return py::make_tuple(py::tuple(positional), keywords);
}

void watch_held(py::list& out, const Spans& spans) {
  for (const auto& t : spans)
    if (t.held)
      out.append(py::make_tuple("watch", t.storage, py::reinterpret_steal<py::object>(THPStorage_Wrap(t.held))));
}

// ("free", ptr, stack or None, thread), ("event_record" or "event_wait", event, stream, thread), ("queued",
// `queued_call`, thread), ("op", name, stream, in_node, accesses, fresh, stack, seq, node name or None, synced stream
// or None, (args, kwargs) or None, ordinal, thread), or ("watch", ptr, storage) right after the op that first saw a storage
// (host memory); a tensor is (storage, start, end, write, shape, dtype[, nbytes]); thread: the recording thread's
// ident.
py::list drain() {
  timers::Scope timed(timers::kIntake);
  Batch taken = take_records();
  struct GiveBack { Batch& records; ~GiveBack() { give_back(records); } } later{taken};
  py::list out;
  for (auto& held : taken) {
    Record& r = *held;
    py::object stack = stack_object(r);
    if (r.what == What::kFree) {
      out.append(py::make_tuple("free", r.handle, stack, r.thread));
      continue;
    }
    if (r.what == What::kEventRecord || r.what == What::kEventWait) {
      out.append(py::make_tuple(r.what == What::kEventWait ? "event_wait" : "event_record", r.handle, r.stream,
                                r.thread));
      continue;
    }
    if (r.what != What::kOp) {
      out.append(py::make_tuple("queued", queued_call(r, py::int_(r.stream)), r.thread));
      continue;
    }
    timers::count_op();
    py::list accesses, fresh;
    for (const auto& t : r.accesses)
      accesses.append(py::make_tuple(t.storage, t.start, t.end, t.write, shape_of(t), dtype_name(t.dtype)));
    for (const auto& t : r.fresh)
      fresh.append(py::make_tuple(t.storage, t.start, t.end, t.write, shape_of(t), dtype_name(t.dtype), t.nbytes));
    py::object node = r.node == nullptr || *r.node == 0 ? py::object(py::none()) : py::object(py::str(r.node));
    out.append(py::make_tuple("op", r.op, r.stream, r.in_node, accesses, fresh, stack, r.seq, node,
                              synced_of(r), arguments_of(r), r.ordinal, r.thread));
    watch_held(out, r.accesses);
    watch_held(out, r.fresh);
  }
  return out;
}

// ---- forcing: a confirmation's forced run (detector/forcing.py) is called before and after the ops it names by their
// ordinal (`Record::ordinal`), on the issuing thread, with the op's arguments (and outputs after it ran). Off, it costs
// one relaxed load per captured op.

std::atomic<bool> forcing_on{false};
std::mutex forcing_mutex;
std::unordered_set<int64_t> forcing_ordinals;
py::object* forcing_fn = nullptr;

void set_forcing(py::object fn, std::vector<int64_t> ordinals) {
  std::lock_guard<std::mutex> guard(forcing_mutex);
  forcing_on.store(false);
  delete forcing_fn;
  forcing_fn = nullptr;
  forcing_ordinals = std::unordered_set<int64_t>(ordinals.begin(), ordinals.end());
  if (fn.is_none()) return;
  forcing_fn = new py::object(std::move(fn));
  forcing_on.store(true);
}

// One more place a forced run names, without turning forcing off meanwhile: a pool task's op, whose place on its
// worker is known only once a worker starts the task (forced_order.ForcedOrder's `task_started`).
void add_forcing_ordinal(int64_t ordinal) {
  std::lock_guard<std::mutex> guard(forcing_mutex);
  forcing_ordinals.insert(ordinal);
}

// The ops captured on this thread so far in this session: a pool task's ops are counted from here.
int64_t thread_ordinal() {
  Here& h = here;
  return h.ordinal_generation == generation.load(std::memory_order_relaxed) ? h.ordinal : 0;
}

int64_t forcing_wants(at::ObserverContext* context) {  // the op's ordinal where the forced run names it, else 0
  if (!forcing_on.load(std::memory_order_relaxed) || context == nullptr) return 0;
  int64_t ordinal = static_cast<Pending*>(context)->ordinal;
  std::lock_guard<std::mutex> guard(forcing_mutex);
  return forcing_ordinals.count(ordinal) ? ordinal : 0;
}

// fn(when, ordinal, thread, op, stream, inputs, outputs or None); the ops it runs are not the program's (not captured:
// the op's own depth is still counted), and it never raises into the op.
void forcing_call(const char* when, int64_t ordinal, const char* op, c10::ArrayRef<c10::IValue> inputs,
                  c10::ArrayRef<c10::IValue> outputs, bool after) noexcept {
  try {
    py::gil_scoped_acquire gil;
    py::object fn;
    {
      std::lock_guard<std::mutex> guard(forcing_mutex);
      if (forcing_fn == nullptr) return;
      fn = *forcing_fn;
    }
    // tensors (and their lists) only, on a GPU: a collective's Work is needed only where its bytes are waited for
    // in Python (host memory), and is not handed over elsewhere
    auto kept = [](c10::ArrayRef<c10::IValue> values) {
      std::vector<c10::IValue> out;
      for (const auto& v : values) out.push_back(!cuda || v.isTensor() || v.isTensorList() ? v : c10::IValue());
      return out;
    };
    std::vector<c10::IValue> in = kept(inputs), out = kept(outputs);
    try {
      fn(when, ordinal, static_cast<int64_t>(PyThread_get_thread_ident()), op, current_stream(), values_object(in),
         after ? values_object(out) : py::object(py::none()));
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable("streamrace: a confirmation's forced order");
    }
  } catch (const std::exception&) {
  }
}

// ---- the records applied straight to the C++ core (`Feed`): tracker._apply_captured's rules, no Python per op

namespace feed {

using streamrace_hb::NativePayload;
using streamrace_hb::Payload;
using streamrace_hb::PyCore;

// backward_sites.site_of: (op, stack or None, forward site or None, node or None, thread, ordinal, origin or None)
py::object* site_factory = nullptr;
// frames._origins: the followed threads' ThreadOrigin by ident, read as each op is applied (a thread's records are
// applied before it ends): a site named later, once its thread has ended or its ident is another thread's, keeps it
py::object* thread_origins = nullptr;

// An op's site: named (a Python Site) only when a report or a trace reads it.
struct Site : NativePayload, streamrace_hb::Pooled<Site> {
  const char* op;  // a schema's name or an interned launch name: lives as long as the process
  std::shared_ptr<Stack> stack;
  Payload forward;  // inside an autograd node: the site of the forward op that created it (may be empty)
  std::string node;  // inside an autograd node: its name
  int64_t thread = 0;  // the recording thread's ident
  int64_t ordinal = 0;  // Record::ordinal
  py::object origin;  // its thread's ThreadOrigin as the op was applied, where the session follows that thread
  py::object named;
  ~Site() override {  // the last reference may go on the applier thread (a history entry replaced there)
    streamrace_hb::drop(origin);
    streamrace_hb::drop(named);
  }
  py::object to_python() override {
    if (!named) {
      py::object frames = stack ? py::cast(stack) : py::object(py::none());
      py::object node_name = node.empty() ? py::object(py::none()) : py::object(py::str(node));
      named = (*site_factory)(py::str(op), frames, forward.to_python(), node_name, thread, ordinal,
                              origin ? origin : py::object(py::none()));
    }
    return named;
  }
};

// An access's tensor: (shape, dtype, name or None), as tracker._accesses describes it.
struct Tensor : NativePayload, streamrace_hb::Pooled<Tensor> {
  Shape shape;
  c10::ScalarType dtype;
  std::shared_ptr<const std::string> name;  // the storage's name (`Tables::names`), if it had one
  py::object to_python() override {
    py::tuple dims(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) dims[i] = shape[i];
    return py::make_tuple(dims, dtype_name(dtype), name ? py::object(py::str(*name)) : py::object(py::none()));
  }
};

// Forward ops' sites by autograd sequence number (backward_sites.ForwardSites, bounded the same way).
class ForwardSites {
 public:
  void forward(int64_t seq, const Payload& site) {
    auto found = sites_.find(seq);
    if (found != sites_.end()) {
      found->second = site;  // keeps its place, as a dict's key does
      return;
    }
    sites_.emplace(seq, site);
    order_.push_back(seq);
    if (sites_.size() > kLimit)
      for (size_t i = 0; i < kLimit / 4; ++i) {
        sites_.erase(order_.front());
        order_.pop_front();
      }
  }
  size_t size() const { return sites_.size(); }
  Payload backward(int64_t seq) const {
    auto found = sites_.find(seq);
    return found == sites_.end() ? Payload() : found->second;
  }

 private:
  static constexpr size_t kLimit = 1 << 14;
  std::unordered_map<int64_t, Payload> sites_;
  std::deque<int64_t> order_;  // first insertion order
};

py::object int_key(int64_t key) { return py::reinterpret_steal<py::object>(PyLong_FromLongLong(key)); }

int64_t storage_of(py::handle key) {  // a storage's key: its data pointer
  long long value = PyLong_AsLongLong(key.ptr());
  if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
  return value;
}

// The tracker's tables about storages, held in C++ while a Feed applies the records (no Python dict per access): the
// storages watched (each with the weak reference that reports its free, where one was made), the stream of each one's
// latest write, autograd's redirects (a storage -> the stream of the next op reading it), and the names people gave.
// Streams are the core's ids. The tracker's Python paths read and write them through `Table`, a dict's face.
// `mutex` is the feed's: whoever applies records (a drain with the GIL, or the applier thread without it) and every
// face below hold it; recursive, as Python a drain calls (a queued op's model) reads the tables through their faces.
// `watched` has a lock of its own, held for a lookup or an update and nothing else: a storage's weak reference reads
// it from wherever a collection runs, even inside the core's judge, while the applier may hold `mutex` waiting for
// the core.
struct Tables {
  std::unordered_map<int64_t, py::object> watched;  // null: no weak reference
  std::unordered_map<int64_t, int32_t> last_writer, redirect;
  std::unordered_map<int64_t, std::shared_ptr<const std::string>> names;
  std::recursive_mutex mutex, watched_mutex;
};

using Locked = streamrace_hb::GilFreeLock<std::recursive_mutex>;  // a lock of the tables

// How one table's values look from Python: a weak reference or None (watched), an interned stream key (last_writer,
// redirect: ids in C++), a name (names).
struct WatchedValues {
  static std::recursive_mutex& lock(Tables& t) { return t.watched_mutex; }
  static py::object out(const py::object& ref, PyCore&) { return ref ? ref : py::none(); }
  static py::object in(py::object value, PyCore&) { return value.is_none() ? py::object() : value; }
};
struct StreamValues {
  static std::recursive_mutex& lock(Tables& t) { return t.mutex; }
  static py::object out(int32_t id, PyCore& core) { return core.stream_key(id); }
  static int32_t in(py::object key, PyCore& core) { return core.locked_stream_id(key); }
};
struct NameValues {
  static std::recursive_mutex& lock(Tables& t) { return t.mutex; }
  static py::object out(const std::shared_ptr<const std::string>& name, PyCore&) { return py::str(*name); }
  static std::shared_ptr<const std::string> in(py::object name, PyCore&) {
    return std::make_shared<const std::string>(name.cast<std::string>());
  }
};

// One of the tables as the tracker's dict was: keys are storages (data pointers).
template <class Value, class Values>
class Table {
 public:
  using Map = std::unordered_map<int64_t, Value>;
  Table(std::shared_ptr<Tables> tables, Map Tables::*map, py::object core)
      : tables_(std::move(tables)), map_(map), core_object_(std::move(core)), core_(core_object_.cast<PyCore&>()) {}

  bool contains(py::handle key) const {
    int64_t storage = storage_of(key);
    Locked locked(Values::lock(*tables_));
    return map().count(storage) > 0;
  }

  py::object get(py::handle key, py::object otherwise) const {
    py::object found = find(storage_of(key));
    return found ? found : otherwise;
  }

  py::object getitem(py::handle key) const {
    py::object found = find(storage_of(key));
    if (!found) throw py::key_error(py::repr(key).cast<std::string>());
    return found;
  }

  void setitem(py::handle key, py::object value) {
    int64_t storage = storage_of(key);
    Value in = Values::in(std::move(value), core_);
    Locked locked(Values::lock(*tables_));
    map()[storage] = std::move(in);
  }

  py::object pop(py::handle key, py::object otherwise) {  // otherwise null: KeyError when missing
    int64_t storage = storage_of(key);
    Locked locked(Values::lock(*tables_));
    py::object found = find(storage);
    if (!found) {
      if (!otherwise) throw py::key_error(py::repr(key).cast<std::string>());
      return otherwise;
    }
    map().erase(storage);
    return found;
  }

  void clear() {
    Map dropped;  // let go of outside the lock: a weak reference's release may run Python
    {
      Locked locked(Values::lock(*tables_));
      dropped.swap(map());
    }
  }
  size_t size() const {
    Locked locked(Values::lock(*tables_));
    return map().size();
  }

  py::list items() const {
    py::list out;
    Locked locked(Values::lock(*tables_));
    for (auto& [storage, value] : map()) out.append(py::make_tuple(int_key(storage), Values::out(value, core_)));
    return out;
  }

  static void bind(py::module_& m, const char* name) {
    py::class_<Table>(m, name)
        .def("__contains__", &Table::contains)
        .def("__getitem__", &Table::getitem)
        .def("__setitem__", &Table::setitem)
        .def("get", &Table::get, py::arg("key"), py::arg("default") = py::none())
        .def("pop", &Table::pop)
        .def("pop", [](Table& t, py::handle key) { return t.pop(key, py::object()); })
        .def("clear", &Table::clear)
        .def("items", &Table::items)
        .def("__len__", &Table::size)
        .def("__bool__", [](const Table& t) { return t.size() > 0; });
  }

 private:
  Map& map() const { return (*tables_).*map_; }

  py::object find(int64_t storage) const {  // null when missing
    Locked locked(Values::lock(*tables_));
    auto found = map().find(storage);
    return found == map().end() ? py::object() : Values::out(found->second, core_);
  }

  std::shared_ptr<Tables> tables_;
  Map Tables::*map_;
  py::object core_object_;
  PyCore& core_;
};
using WatchedTable = Table<py::object, WatchedValues>;
using StreamTable = Table<int32_t, StreamValues>;
using NameTable = Table<std::shared_ptr<const std::string>, NameValues>;

// The tracker's captured ops applied to its C++ core: the same rules as tracker._apply_captured, which stays the path
// for hb.py's core, with the tracker's tables in C++ (`Tables`). Python is called for a host sync's rule, a queued
// op's model (but where its plan has a fixed rule: `apply_rule`), races and notes.
class Feed {
 public:
  Feed(py::object core, py::object tracker)
      : core_object_(std::move(core)), core_(core_object_.cast<PyCore&>()), tables_(std::make_shared<Tables>()) {
    ref_keys_ = tracker.attr("_ref_keys");
    on_dead_ = dead_callback(tables_, ref_keys_);
    track_frees_ = tracker.attr("track_frees").cast<bool>();
    captured_sync_ = tracker.attr("_captured_sync");
    report_ = tracker.attr("_report");
    note_ = tracker.attr("note");
    queued_ = tracker.attr("_queued");
    rule_stream_ = tracker.attr("_rule_stream");
    host_timeline_ = tracker.attr("host_timeline");
    hosts_ = tracker.attr("hosts");
    forget_host_ = hosts_.attr("discard");
    free_core.store(&core_);
    if (site_factory == nullptr)
      site_factory = new py::object(py::module_::import("pytest_streamrace.detector.backward_sites").attr("site_of"));
    if (thread_origins == nullptr)
      thread_origins = new py::object(py::module_::import("pytest_streamrace.detector.frames").attr("_origins"));
  }

  // The tables' faces for the tracker: (watched, last_writer, redirect, names).
  py::tuple tables() const {
    return py::make_tuple(py::cast(WatchedTable(tables_, &Tables::watched, core_object_)),
                          py::cast(StreamTable(tables_, &Tables::last_writer, core_object_)),
                          py::cast(StreamTable(tables_, &Tables::redirect, core_object_)),
                          py::cast(NameTable(tables_, &Tables::names, core_object_)));
  }

  // tracker._dead in C++, for the weak references made here: a watched storage died, its free is queued in order with
  // the ops (with a stack only where frees can race). It outlives the feed (a storage may die after the session):
  // what it needs it holds, and the tables it reads are cleared when the session ends (tracker.detach).
  static py::object dead_callback(std::shared_ptr<Tables> tables, py::object ref_keys) {
    return py::cpp_function([tables, ref_keys](py::handle ref) {
      try {
        PyObject* found = PyDict_GetItemWithError(ref_keys.ptr(), ref.ptr());
        if (found == nullptr) {
          if (PyErr_Occurred()) throw py::error_already_set();
          return;
        }
        int64_t ptr = storage_of(found);
        if (PyDict_DelItem(ref_keys.ptr(), ref.ptr()) < 0) throw py::error_already_set();
        {
          Locked locked(tables->watched_mutex);
          auto entry = tables->watched.find(ptr);
          if (entry == tables->watched.end() || entry->second.ptr() != ref.ptr() || !on.load()) return;
        }
        queue_free(ptr);
      } catch (py::error_already_set& error) {  // printed as Python does for errors it cannot raise
        error.discard_as_unraisable("streamrace: a storage's free");
      }
    });
  }

  // Drains the capture into the core (until no frees follow on host memory), after what the applier thread left:
  // the candidates it found judged, its notes made, the records it could not apply (Python needed) applied first.
  // streams: the virtual model's streams by their small int (None on cuda: a stream is its handle). unnamed: the
  // threads with an unnamed implicit sync (a set of idents, or None); returns {thread: its first op's name} for them
  // (the tracker names each sync after it).
  py::dict apply(py::object streams, bool engine_records_streams, py::object unnamed) {
    timers::Scope timed(timers::kIntake);
    Locked locked(tables_->mutex);
    streamrace_hb::release_dropped();
    streams_ = std::move(streams);
    engine_records_streams_ = engine_records_streams;
    py::dict firsts;
    const bool naming = !unnamed.is_none();
    if (naming)  // the applier's records came first
      for (const auto& [thread, op] : applied_firsts_) {
        py::int_ key(thread);
        if (unnamed.contains(key) && !firsts.contains(key)) firsts[key] = py::str(op);
      }
    applied_firsts_.clear();
    judge_applied();
    auto apply_all = [&](Batch& taken, size_t from) {
      for (size_t i = from; i < taken.size(); ++i) {
        Record& r = *taken[i];
        if (r.what == What::kOp) timers::count_op();
        if (naming && r.what == What::kOp) {
          py::int_ thread(r.thread);
          if (unnamed.contains(thread) && !firsts.contains(thread)) firsts[thread] = py::str(r.op);
        }
        streamrace_hb::ActingFor acting(r.thread);  // the Python it calls too (a host sync's rule, a queued op's model)
        guarded(r, [&] { apply_one(r); });
        guarded(r, [&] {  // even when the op went unchecked: its storages' frees are still learnt
          for (const Span& span : r.accesses) watch(span);
          for (const Span& span : r.fresh) watch(span);
        });
      }
      give_back(taken);  // the storages they held (host memory): frees that follow are queued now
    };
    if (!left_.empty()) {
      Batch left;
      left.swap(left_);
      apply_all(left, left_from_);
    }
    stalled_.store(false, std::memory_order_relaxed);
    applier::stalled.store(false, std::memory_order_relaxed);
    for (;;) {
      Batch taken = take_records();
      if (taken.empty()) break;
      apply_all(taken, 0);
      if (!track_frees_) break;
    }
    streams_ = py::none();
    return firsts;
  }

  // The applier thread's turn (no GIL): the records so far, in order, as long as each needs no Python (`applied`);
  // the first that does and those after it wait for the next drain (`left_`), and until then the applier takes none.
  void apply_native() {
    if (stalled_.load(std::memory_order_relaxed)) return;
    Locked locked(tables_->mutex);
    if (stalled_.load(std::memory_order_relaxed)) return;
    for (;;) {
      Batch taken = take_records();
      if (taken.empty()) return;
      for (size_t i = 0; i < taken.size(); ++i) {
        if (!applied(*taken[i])) {
          left_.swap(taken);
          left_from_ = i;
          stalled_.store(true, std::memory_order_relaxed);
          applier::stalled.store(true, std::memory_order_relaxed);
          return;
        }
      }
      give_back(taken);
    }
  }

  void use_applier(bool on);  // applier.cpp
  uint64_t applier_applied() const { return applied_.load(std::memory_order_relaxed); }

  size_t forward_sites() const { return forward_.size(); }

  ~Feed() {
    PyCore* mine = &core_;
    free_core.compare_exchange_strong(mine, nullptr);
  }

 private:
  template <class F>
  void guarded(const Record& r, F&& step) {  // never inside the user's test: this op goes unchecked, said once
    try {
      step();
    } catch (py::error_already_set& error) {
      note(r, py::str(error.type().attr("__name__")), py::str(error.value()));
    } catch (const std::exception& error) {
      note(r, py::str("RuntimeError"), py::str(error.what()));
    }
  }

  static std::string what_of(const Record& r) {
    return r.op != nullptr ? r.op : r.what == What::kFree ? "free" : "an event's record or wait";
  }

  void note(const Record& r, py::str type, py::str message) {
    note_(py::str("{} is not checked: {}: {}").format(what_of(r), type, message));
  }

  // What the applier thread found since the last drain, handed to Python (the GIL and `tables_->mutex` held): the
  // candidates the core kept for a judge, and the notes.
  void judge_applied() {
    py::list races;
    core_.judge_deferred(races);
    if (py::len(races) > 0) {
      timers::Callout python;
      report_(races);
    }
    std::vector<std::string> notes;
    notes.swap(applier_notes_);
    for (const auto& text : notes) note_(py::str(text));
  }

  // One record applied without Python, on the applier thread: false, with nothing done, where it needs Python (a
  // host sync's rule, a queued op's model, a stream or group not seen yet, a followed thread's origin, host memory).
  bool applied(Record& r) {
    if (!native(r)) return false;
    streamrace_hb::ActingFor acting(r.thread);
    try {
      apply_one(r);  // as a drain would: what `native` checked is what it would otherwise ask Python
    } catch (const std::exception& error) {  // this op goes unchecked, said at the next drain
      applier_notes_.push_back(what_of(r) + " is not checked: RuntimeError: " + error.what());
    }
    applied_.fetch_add(1, std::memory_order_relaxed);
    if (r.what != What::kOp) return true;
    timers::count_op();
    for (const auto& first : applied_firsts_)
      if (first.first == r.thread) return true;
    applied_firsts_.push_back({r.thread, r.op});
    return true;
  }

  // Whether `applied` can take the record: what it would ask Python is known already.
  bool native(const Record& r) {
    if (PyDict_GET_SIZE(thread_origins->ptr()) > 0) return false;  // a followed thread's site names its origin
    switch (r.what) {
      case What::kFree:
        return !any_hosts.load(std::memory_order_relaxed) && PySet_GET_SIZE(hosts_.ptr()) == 0;
      case What::kEventRecord:
      case What::kEventWait:
        return ready(r.stream);
      case What::kQueuedStart: {
        if (!r.plan || !r.plan->rule) return false;
        const Rule& rule = *r.plan->rule;
        if (rule.stream_arg >= r.args.size() || !r.args[rule.stream_arg].isObject()) return false;
        const Named* on = known_named(r.args[rule.stream_arg]);
        return on != nullptr && ready_id(on->stream) && ready(r.stream);
      }
      case What::kOp: {
        if (r.stream == kHostStream || r.synced || r.sync || !r.args.empty()) return false;
        for (const Span& span : r.accesses) if (span.held) return false;
        for (const Span& span : r.fresh) if (span.held) return false;
        if (!ready(r.stream)) return false;
        for (const Span& span : r.accesses) {  // the op's stream, where a redirect takes it
          auto target = tables_->redirect.find(span.storage);
          if (target != tables_->redirect.end()) return ready_id(target->second);
        }
        return true;
      }
      default:
        return false;
    }
  }

  // A recorded stream the core knows by id, already named (what `created` would otherwise name in Python).
  bool ready(int64_t recorded) {
    auto found = streams_by_record_.find(recorded);
    return found != streams_by_record_.end() && ready_id(found->second);
  }

  bool ready_id(int32_t id) {
    if (static_cast<size_t>(id) < ready_.size() && ready_[id]) return true;
    if (!core_.ready(id)) return false;
    if (ready_.size() <= static_cast<size_t>(id)) ready_.resize(id + 1, false);
    ready_[id] = true;
    return true;
  }

  // The core's id of a stream the capture recorded.
  int32_t stream(int64_t recorded) {
    auto found = streams_by_record_.find(recorded);
    if (found != streams_by_record_.end()) return found->second;
    py::object key = streams_.is_none() ? int_key(recorded) : py::object(streams_[py::int_(recorded)]);
    int32_t id = core_.locked_stream_id(key);
    streams_by_record_[recorded] = id;
    return id;
  }

  Payload site(Record& r) {  // takes the record's node name
    auto* made = new Site();
    Payload payload = Payload::native(made);
    made->op = r.what == What::kFree ? "free" : r.op;
    made->stack = r.stack;
    made->thread = r.thread;
    made->ordinal = r.ordinal;
    if (!applier::here && PyDict_GET_SIZE(thread_origins->ptr()) > 0) {  // (the applier: none, `native` saw)
      py::int_ key(r.thread);
      PyObject* found = PyDict_GetItemWithError(thread_origins->ptr(), key.ptr());  // borrowed
      if (found != nullptr) made->origin = py::reinterpret_borrow<py::object>(found);
      else PyErr_Clear();
    }
    if (r.in_node) {
      made->node = r.node == nullptr || *r.node == 0 ? "a backward node" : r.node;
      made->forward = forward_.backward(r.seq);
    }
    return payload;
  }

  Payload tensor(Span& span, bool named) {
    auto* made = new Tensor();
    Payload payload = Payload::native(made);
    made->shape = std::move(span.shape);
    made->dtype = span.dtype;
    if (named && !tables_->names.empty()) {
      auto found = tables_->names.find(span.storage);
      if (found != tables_->names.end()) made->name = found->second;
    }
    return payload;
  }

  void watch(const Span& span) {  // tracker._apply_captured's "watch": a storage first seen, its free learnt from now
    if (!span.held || !track_frees_) return;
    {
      Locked locked(tables_->watched_mutex);
      if (tables_->watched[span.storage]) return;
    }
    py::object storage = py::reinterpret_steal<py::object>(THPStorage_Wrap(span.held));
    py::object ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(storage.ptr(), on_dead_.ptr()));
    if (!ref) throw py::error_already_set();
    if (PyDict_SetItem(ref_keys_.ptr(), ref.ptr(), int_key(span.storage).ptr()) < 0) throw py::error_already_set();
    Locked locked(tables_->watched_mutex);
    tables_->watched[span.storage] = std::move(ref);
  }

  // The stream a fixed rule's argument names, and this rank in it (-1: none), asked of the model once per group;
  // null where the model declines it. The group's memory is kept (a weak reference), so its address names no other
  // while the entry lives.
  using Identity = c10::intrusive_ptr<c10::intrusive_ptr_target>;
  struct Named { c10::weak_intrusive_ptr<c10::intrusive_ptr_target> object; int32_t stream; int64_t rank; };
  // What names a group: a custom class's instance (a ProcessGroup), which C++ boxes into a new object around it at
  // every call (DDP's reducer, each bucket's all-reduce); another object itself.
  static Identity identity(const c10::IValue& value) {
    const auto& object = value.toObject();
    if (object->slots().size() == 1 && object->getSlot(0).isCapsule()) return object->getSlot(0).toCapsule();
    return object;
  }
  const Named* known_named(const c10::IValue& value) const {  // null where the model was not asked yet
    auto found = named_.find(identity(value).get());
    return found != named_.end() && !found->second.object.expired() ? &found->second : nullptr;
  }

  const Named* named(const Record& r, const c10::IValue& value) {
    if (const Named* known = known_named(value)) return known;
    py::object got = rule_stream_(py::str(r.op), torch::jit::toPyObject(value));
    if (got.is_none()) return nullptr;
    auto pair = got.cast<py::tuple>();
    Identity group = identity(value);
    Named entry{c10::weak_intrusive_ptr<c10::intrusive_ptr_target>(group), core_.locked_stream_id(pair[0]),
                pair[1].is_none() ? -1 : pair[1].cast<int64_t>()};
    return &(named_.insert_or_assign(group.get(), std::move(entry)).first->second);
  }

  // Tensors in an argument, lists of lists included (all_gather's outputs).
  void add_nested(Record& r, Spans& out, const c10::IValue& v, bool write) {
    if (v.isList() && !v.isTensorList()) {
      for (const auto& e : v.toListRef()) add_nested(r, out, e, write);
      return;
    }
    add_value(r, out, v, write, false);
  }

  // models.collectives' on_op for a collective torch's C++ issued (queued before it ran), by its fixed rule: no
  // Python. False: the model takes it in Python (its group is not one the model names).
  bool apply_rule(Record& r, const Rule& rule) {
    if (rule.stream_arg >= r.args.size() || !r.args[rule.stream_arg].isObject()) return false;
    const Named* on = named(r, r.args[rule.stream_arg]);
    if (on == nullptr) return false;
    const int32_t comm = on->stream, issuing = stream(r.stream);
    core_.wait_stream_id(comm, issuing);
    const bool root = rule.root_arg >= 0 && on->rank >= 0 && static_cast<size_t>(rule.root_arg) < r.args.size() &&
                      r.args[rule.root_arg].isInt() && r.args[rule.root_arg].toInt() == on->rank;
    for (const auto& [index, access] : rule.tensors) {  // as an op's accesses: `apply` watches their storages too
      if (index >= r.args.size()) continue;
      bool write = access == Rule::kWrite || (access == Rule::kRootReads && !root) ||
                   (access == Rule::kRootWrites && root);
      add_nested(r, r.accesses, r.args[index], write);
    }
    r.op = rule.name;
    launch(r, comm);
    core_.wait_stream_id(issuing, comm);
    return true;
  }

  // The record's accesses and fresh outputs as one launch on stream `id`, judged (tracker._apply_captured's op).
  void launch(Record& r, int32_t id) {
    Tables& t = *tables_;
    Emptied emptied{scratch_};
    auto& touches = scratch_.touches;
    auto& allocs = scratch_.allocs;
    auto& first_seen = scratch_.first_seen;
    {  // (its own lock, held for nothing else: see Tables)
      Locked locked(t.watched_mutex);
      for (Span& span : r.accesses) t.watched.try_emplace(span.storage);
      for (Span& span : r.fresh) first_seen.push_back(t.watched.try_emplace(span.storage).second);
    }
    for (Span& span : r.accesses) {
      if (span.write) {
        t.last_writer[span.storage] = id;
      } else if (engine_records_streams_ && r.in_node) {  // read inside a node: one of its incoming gradients
        auto writer = t.last_writer.find(span.storage);
        if (writer != t.last_writer.end() && writer->second != id) core_.record_stream(span.storage, id);
      }
      touches.push_back({span.storage, span.start, span.end, span.write, tensor(span, true)});
    }
    for (size_t i = 0; i < r.fresh.size(); ++i) {
      Span& span = r.fresh[i];
      Payload desc = tensor(span, false);
      if (first_seen[i]) allocs.push_back({span.storage, span.nbytes, desc});
      if (span.write) {
        t.last_writer[span.storage] = id;
        touches.push_back({span.storage, span.start, span.end, true, std::move(desc)});
      }
    }
    Payload op_site = site(r);
    if (!r.in_node && r.seq >= 0) forward_.forward(r.seq, op_site);
    if (applier::here) {  // its candidates wait for the next drain's judge
      core_.record(id, op_site, allocs, touches, nullptr);
      return;
    }
    py::list races;
    core_.record(id, op_site, allocs, touches, &races);
    if (py::len(races) > 0) {
      timers::Callout python;
      report_(races);
    }
  }

  void freed(Record& r) {  // tracker._freed
    Tables& t = *tables_;
    if (PySet_GET_SIZE(hosts_.ptr()) > 0) forget_host_(r.handle);  // (the capture forgot it as it was freed)
    py::object ref;  // its weak reference, let go of outside the lock (on the applier: later, with the GIL)
    {
      Locked locked(t.watched_mutex);
      auto found = t.watched.find(r.handle);
      if (found == t.watched.end()) return;  // never touched by a tracked op
      ref = std::move(found->second);
      t.watched.erase(found);
    }
    streamrace_hb::drop(ref);
    if (!t.names.empty()) t.names.erase(r.handle);
    t.last_writer.erase(r.handle);
    core_.free(r.handle, site(r));
  }

  void apply_one(Record& r) {
    if (r.what == What::kFree) return freed(r);
    if (r.what == What::kEventRecord || r.what == What::kEventWait) {  // the cuda model's _event_record / _wait
      int32_t id = stream(r.stream);
      if (r.what == What::kEventRecord) core_.record_event(r.handle, id);
      else core_.wait_event(id, r.handle);
      return;
    }
    if (r.what == What::kQueuedStart && r.plan->rule && apply_rule(r, *r.plan->rule)) return;
    if (r.what != What::kOp) {  // tracker._queued: the model's, in order, named by the thread that issued it
      timers::Callout python;
      queued_(*queued_call(r, core_.stream_key(stream(r.stream))), py::arg("thread") = r.thread);
      return;
    }
    if (r.stream == kHostStream) {  // the host's own op, on its thread's timeline, done before the host goes on
      const py::object& timeline = host_timeline(r.thread);
      launch(r, core_.locked_stream_id(timeline));
      core_.synchronize_stream(timeline, py::none());
      return;
    }
    apply_op(r);
  }

  // An op on a device stream (its accesses, then where it syncs the host, the tracker's rule).
  void apply_op(Record& r) {
    Tables& t = *tables_;
    int32_t id = stream(r.stream);
    if (!t.redirect.empty())  // a gradient's add the engine runs on its consumer's stream
      for (const Span& span : r.accesses) {
        auto target = t.redirect.find(span.storage);
        if (target != t.redirect.end()) {
          id = target->second;
          t.redirect.erase(target);
          break;
        }
      }
    launch(r, id);
    // a host sync's rule (and a sync reported from inside the op) is the tracker's: tracker._captured_sync
    if (r.synced || r.sync) {
      py::object stack = stack_object(r);
      timers::Callout python;
      captured_sync_(py::str(r.op), core_.stream_key(id), synced_of(r), stack, arguments_of(r),
                     !r.accesses.empty() || !streams_.is_none());
    }
  }

  // A thread's host timeline (tracker.host_timeline), asked once per thread.
  const py::object& host_timeline(int64_t thread) {
    auto found = timelines_.find(thread);
    if (found != timelines_.end()) return found->second;
    return timelines_.emplace(thread, host_timeline_(thread)).first->second;
  }

  py::object core_object_;
  PyCore& core_;
  std::shared_ptr<Tables> tables_;
  py::object ref_keys_, on_dead_, captured_sync_, report_, note_, queued_, rule_stream_, host_timeline_;
  py::object hosts_, forget_host_;  // tracker.hosts, and its discard
  std::unordered_map<int64_t, py::object> timelines_;
  std::unordered_map<const void*, Named> named_;
  bool track_frees_ = false, engine_records_streams_ = false;
  py::object streams_ = py::none();
  std::unordered_map<int64_t, int32_t> streams_by_record_;
  std::vector<bool> ready_;  // by core stream id: named already (`ready_id`)
  ForwardSites forward_;
  // The applier thread's (under `tables_->mutex`): the records it left for a drain (from `left_from_` on), whether
  // it left any (`stalled_`: it takes no more until a drain), its notes, and each thread's first op it applied.
  Batch left_;
  size_t left_from_ = 0;
  std::atomic<bool> stalled_{false};
  std::vector<std::string> applier_notes_;
  std::vector<std::pair<int64_t, const char*>> applied_firsts_;
  std::atomic<uint64_t> applied_{0};  // records the applier applied, for tests and benchmarks
  // The vectors a record is applied with, kept between records (no allocation per record once grown), emptied after
  // each. One set: the tracker never applies a record from inside another's (its drain returns while it applies).
  struct Scratch {
    std::vector<PyCore::Touch> touches;
    std::vector<PyCore::Alloc> allocs;
    std::vector<bool> first_seen;  // per fresh output: its storage first seen here
  };
  struct Emptied {
    Scratch& s;
    ~Emptied() {
      s.touches.clear();
      s.allocs.clear();
      s.first_seen.clear();
    }
  };
  Scratch scratch_;
};

}  // namespace feed

// `call` run between `before(*args, **kwargs)` and `after(state)`, as one builtin: while `call` runs, no Python frame
// of ours is on the stack, so what it warns with a `stacklevel` (torch's hooks during a backward) is attributed to the
// same line as without the detector, and warnings filters keyed on the user's module still match. A Python wrapper
// would put its frames there. `before` returning None: `call` alone.
py::cpp_function around(py::object before, py::object call, py::object after) {
  return py::cpp_function([before, call, after](py::args args, py::kwargs kwargs) -> py::object {
    py::object state = before(*args, **kwargs);
    if (state.is_none()) return call(*args, **kwargs);
    py::object result;
    try {
      result = call(*args, **kwargs);
    } catch (py::error_already_set&) {  // its error is held here, not set, while `after` runs; then raised again
      after(state);
      throw;
    }
    after(state);
    return result;
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_core(m);  // hb_core.cpp, compiled into this module (capture.load)
  timers::bind(m);  // timers.cpp: benchmarks/profile_step.py's breakdown
  py::class_<Stack, std::shared_ptr<Stack>>(m, "Stack").def("frames", &Stack::frames);
  m.def("stack", [] { return stack_here(); });
  m.def("enable", &enable, py::arg("cuda"), py::arg("plan"), py::arg("drain") = py::none(),
        py::arg("every_thread") = true, py::arg("host_frees") = false, py::arg("plans_key") = "");
  m.def("observe", &observe);
  m.def("unobserve", &unobserve);
  m.def("disable", &disable, py::arg("keep_plans") = false);
  m.def("set_recording", &set_recording);
  m.def("set_issuing", &set_issuing);
  m.def("set_forcing", &set_forcing, py::arg("fn"), py::arg("ordinals"));
  m.def("add_forcing_ordinal", &add_forcing_ordinal);
  m.def("thread_ordinal", &thread_ordinal);
  // a host access no op makes (`tracker.host_access`) takes a place too
  m.def("next_ordinal", [] { return next_ordinal(here); });
  m.def("set_stream", &set_stream);
  m.def("sync_inside_op", &sync_inside_op);
  m.def("in_op", &in_op);
  m.def("mark_host", &mark_host);
  m.def("unmark_host", &unmark_host);
  m.def("record_kernel", &record_kernel, py::arg("name"), py::arg("stream"), py::arg("args"), py::arg("roles"));
  m.def("mark_free", &mark_free, py::arg("ptr"), py::arg("stack") = true);
  m.def("drain", &drain);
  m.def("discard", [] {  // the records dropped unread: the capture's own cost, for benchmarks' floors
    Batch taken = take_records();
    give_back(taken);
  });
  m.def("bind_nodes", &node_streams::start, py::arg("enter"), py::arg("leave"), py::arg("core"));
  m.def("unbind_nodes", &node_streams::stop);
  m.def("bind_graph", &node_streams::bind_roots, py::arg("roots"), py::arg("caller"));
  m.def("around", &around, py::arg("before"), py::arg("call"), py::arg("after"));
  m.def("report_fatal_signals", &fatal_signals::install, py::arg("fd"));
  m.def("crash_on_a_native_thread", &fatal_signals::crash_on_a_native_thread);
  for (auto& def : traced_defs)
    m.attr(def.ml_name) = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, m.attr("__name__").ptr()));
  m.attr("free_from_trace") = py::capsule(reinterpret_cast<void*>(&free_from_trace), "streamrace.free_from_trace");
  m.attr("event_from_trace") = py::capsule(reinterpret_cast<void*>(&event_from_trace), "streamrace.event_from_trace");
  py::class_<feed::Feed>(m, "Feed")
      .def(py::init<py::object, py::object>(), py::arg("core"), py::arg("tracker"))
      .def("apply", &feed::Feed::apply, py::arg("streams"), py::arg("engine_records_streams"), py::arg("name_first"))
      .def("use_applier", &feed::Feed::use_applier, py::arg("on"))
      .def_property_readonly("applier_applied", &feed::Feed::applier_applied)
      .def_property_readonly("forward_sites", &feed::Feed::forward_sites)
      .def_property_readonly("tables", &feed::Feed::tables);
  feed::WatchedTable::bind(m, "WatchedTable");
  feed::StreamTable::bind(m, "StreamTable");
  feed::NameTable::bind(m, "NameTable");
}
