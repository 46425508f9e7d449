// torch's GPU trace without Python for the events the cuda model does not need there.
//
// Once the trace is on, torch's CUDA code calls the interpreter in `c10::impl::GPUTrace::gpuTraceState` for every
// caching-allocator allocation and free and every event created or destroyed, and torch's own interpreter takes the
// GIL, imports torch.cuda._gpu_trace and calls a Python method each time: about 0.2 ms of a launch-bound step on an
// H200 (benchmarks/paired_overhead.py --backend cuda). For the session this module puts an interpreter of its own
// there, which hands each event either to torch's (`route(kind, False)`, the default: Python's registries see it as
// before) or, for the four kinds above and event records and waits, takes it in C++ (`route(kind, True)`): a free, an
// event record or wait goes to the capture's queue, in order with the ops (the feed applies records and waits to the
// C++ core, with no Python per event: a dozen a DDP step); the rest is dropped. Stream, event and device
// synchronizations always go to torch's.
//
// The trace cannot be switched off again once on, and torch's interpreter would cost every allocation and free that
// trip through Python for the rest of the process: 1.2x on a launch-bound step after the first detector session (paired
// on an H200, benchmarks/paired_overhead.py). So the interpreter stays in the trace between sessions (`uninstall` only
// stops the frees reaching the capture); the model keeps there only the kinds nobody listens to, and gives a kind back
// to torch's interpreter when someone registers for it (``models.cuda.native_trace``).
//
// PyInterpreterVTable's pure virtual methods differ between torch versions. Only the trace methods are ever called on
// the trace's interpreter; the others are generated from the installed header (capture.load_trace, at `STUBS`) and
// throw if called.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <c10/core/TensorImpl.h>  // what the generated stubs return
#include <c10/core/impl/GPUTrace.h>
#include <c10/core/impl/PyInterpreter.h>
#include <atomic>
#include <stdexcept>

namespace py = pybind11;

namespace streamrace_trace {

using namespace c10;
using namespace c10::impl;

enum Kind { kAllocation, kFree, kEventCreation, kEventDeletion, kEventRecord, kEventWait, kKinds };
std::atomic<bool> in_cpp[kKinds];  // taken here rather than handed to torch's interpreter
std::atomic<const PyInterpreter*> torch_trace{nullptr};  // what the trace held before `install`
// The capture's (capsules), in a session: each queues its event in order with the ops.
std::atomic<void (*)(int64_t)> on_free{nullptr};
std::atomic<void (*)(bool, int64_t, int64_t)> on_event{nullptr};  // (wait, event, stream)

void queue_event(bool wait, uintptr_t event, uintptr_t stream) {
  try {  // inside torch's CUDA code: nothing may escape
    auto queue = on_event.load(std::memory_order_acquire);
    if (queue != nullptr) queue(wait, static_cast<int64_t>(event), static_cast<int64_t>(stream));
  } catch (...) {
  }
}

[[noreturn]] void unreachable(const char* method) {
  throw std::logic_error(std::string("streamrace: the GPU trace's interpreter has no ") + method);
}

struct TraceVTable final : PyInterpreterVTable {
  const PyInterpreterVTable& original() const { return **torch_trace.load(std::memory_order_acquire); }
  bool here(Kind kind) const { return in_cpp[kind].load(std::memory_order_relaxed); }

  void trace_gpu_event_creation(DeviceType device, uintptr_t event) const override {
    if (!here(kEventCreation)) original().trace_gpu_event_creation(device, event);
  }
  void trace_gpu_event_deletion(DeviceType device, uintptr_t event) const override {
    if (!here(kEventDeletion)) original().trace_gpu_event_deletion(device, event);
  }
  void trace_gpu_memory_allocation(DeviceType device, uintptr_t ptr) const override {
    if (!here(kAllocation)) original().trace_gpu_memory_allocation(device, ptr);
  }
  void trace_gpu_memory_deallocation(DeviceType device, uintptr_t ptr) const override {
    if (!here(kFree)) return original().trace_gpu_memory_deallocation(device, ptr);
    try {  // inside the allocator: nothing may escape
      auto free = on_free.load(std::memory_order_acquire);
      if (free != nullptr) free(static_cast<int64_t>(ptr));
    } catch (...) {
    }
  }
  void trace_gpu_event_record(DeviceType device, uintptr_t event, uintptr_t stream) const override {
    if (!here(kEventRecord)) return original().trace_gpu_event_record(device, event, stream);
    queue_event(false, event, stream);
  }
  void trace_gpu_event_wait(DeviceType device, uintptr_t event, uintptr_t stream) const override {
    if (!here(kEventWait)) return original().trace_gpu_event_wait(device, event, stream);
    queue_event(true, event, stream);
  }
  void trace_gpu_stream_creation(DeviceType device, uintptr_t stream) const override {
    original().trace_gpu_stream_creation(device, stream);
  }
  void trace_gpu_device_synchronization(DeviceType device) const override {
    original().trace_gpu_device_synchronization(device);
  }
  void trace_gpu_stream_synchronization(DeviceType device, uintptr_t stream) const override {
    original().trace_gpu_stream_synchronization(device, stream);
  }
  void trace_gpu_event_synchronization(DeviceType device, uintptr_t event) const override {
    original().trace_gpu_event_synchronization(device, event);
  }

// STUBS
};

// Never destroyed: torch's CUDA code may call it from any thread until the process ends.
const TraceVTable* vtable = new TraceVTable();
const PyInterpreter* interpreter = new PyInterpreter(vtable);

// Puts this interpreter in the trace (which must be on: torch._C._activate_gpu_trace), the frees it takes going to
// `free` and the event records and waits to `event` from now on. False when the trace is not on.
bool install(py::capsule free, py::capsule event) {
  const PyInterpreter* current = GPUTrace::get_trace();
  if (current == nullptr) return false;
  if (current != interpreter) torch_trace.store(current, std::memory_order_release);
  on_free.store(reinterpret_cast<void (*)(int64_t)>(free.get_pointer<void>()), std::memory_order_release);
  on_event.store(reinterpret_cast<void (*)(bool, int64_t, int64_t)>(event.get_pointer<void>()),
                 std::memory_order_release);
  GPUTrace::gpuTraceState.store(interpreter, std::memory_order_release);
  return true;
}

// The session is over: what it takes goes nowhere. The interpreter stays, with the kinds routed as they are.
void uninstall() {
  on_free.store(nullptr, std::memory_order_release);
  on_event.store(nullptr, std::memory_order_release);
}

bool installed() { return GPUTrace::get_trace() == interpreter; }

// For tests on machines without CUDA: the calls torch's CUDA code makes into the trace.
void emit(const std::string& event, const std::vector<int64_t>& args) {
  const PyInterpreter* trace = GPUTrace::get_trace();
  if (trace == nullptr) return;
  auto cuda = DeviceType::CUDA;
  auto at = [&](size_t i) { return static_cast<uintptr_t>(args.at(i)); };
  if (event == "allocation") (*trace)->trace_gpu_memory_allocation(cuda, at(0));
  else if (event == "free") (*trace)->trace_gpu_memory_deallocation(cuda, at(0));
  else if (event == "event_creation") (*trace)->trace_gpu_event_creation(cuda, at(0));
  else if (event == "event_deletion") (*trace)->trace_gpu_event_deletion(cuda, at(0));
  else if (event == "event_record") (*trace)->trace_gpu_event_record(cuda, at(0), at(1));
  else if (event == "event_wait") (*trace)->trace_gpu_event_wait(cuda, at(0), at(1));
  else if (event == "stream_synchronization") (*trace)->trace_gpu_stream_synchronization(cuda, at(0));
  else throw std::invalid_argument("unknown GPU trace event: " + event);
}

}  // namespace streamrace_trace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace streamrace_trace;
  m.def("install", &install, py::arg("free"), py::arg("event"));
  m.def("uninstall", &uninstall);
  m.def("installed", &installed);
  m.def("route", [](const std::string& kind, bool here) {
    static const std::vector<std::string> names{"allocation", "free", "event_creation", "event_deletion",
                                                "event_record", "event_wait"};
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == kind) return in_cpp[i].store(here);
    throw std::invalid_argument("unknown GPU trace event kind: " + kind);
  }, py::arg("kind"), py::arg("here"));
  m.def("emit", &emit, py::arg("event"), py::arg("args"));
}
