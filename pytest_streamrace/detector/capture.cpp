#include <torch/extension.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace {

struct Stack {
  std::shared_ptr<torch::CapturedTraceback> traceback;
  py::list frames() const {  // innermost first: (file, line, function)
    py::list out;
    std::vector<torch::CapturedTraceback*> one{traceback.get()};
    auto symbolized = torch::symbolize(one);
    for (uint64_t index : symbolized.tracebacks.at(0)) {
      const auto& f = symbolized.all_frames.at(index);
      out.append(py::make_tuple(f.filename, f.lineno, f.funcname));
    }
    return out;
  }
};

struct Span { int64_t storage, start, end; bool write; std::vector<int64_t> shape; std::string dtype; int64_t nbytes; };
struct Record {
  bool free = false; const char* op = nullptr; int64_t stream = 0; bool in_node = false;
  std::vector<Span> accesses, fresh; std::shared_ptr<Stack> stack; int64_t freed = 0;
  // the autograd sequence number: in forward, of the node the op may create; in backward, of the node running it
  int64_t seq = -1; std::string node;
  // a stream the host waited for inside this op (a read-back: a copy to the host, t[mask]); 0: none
  int64_t synced = 0;
};

// What to do with an op, decided once (by the tracker's plan) per op overload.
struct Plan { bool below_autograd = false, record = false, handoff = false, fresh = false, writes_output = false,
                   copy = false; std::vector<std::pair<size_t, bool>> args; };
struct Pending : at::ObserverContext { Record record; const Plan* plan; std::vector<c10::IValue> inputs; };

std::mutex mutex;  // records and plans
std::vector<Record> records;
std::unordered_map<const char*, Plan> plans;  // keyed by the op's name, which lives in its schema
at::CallbackHandle handle = 0;
std::atomic<bool> on{false};
bool cuda = false;
// Python callables, kept by pointer: a static py::object would be released after the interpreter is gone.
py::object* plan_fn = nullptr;
py::object* handoff_fn = nullptr;
thread_local int depth = 0;  // ops below autograd running on this thread
thread_local bool paused = false;  // this thread's work is modelled by hand (set_recording): others still record
thread_local Record* in_flight = nullptr;  // the record of the op this thread is running, until on_end pushes it

std::shared_ptr<Stack> stack_here() {
  auto s = std::make_shared<Stack>();
  s->traceback = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
  return s;
}

bool reaches_kernel(const c10::OperatorHandle& op) {  // what reaches the dispatch mode: no decomposition above it
  using K = c10::DispatchKey;
  for (K key : {K::CUDA, K::CPU, K::CompositeExplicitAutograd, K::CompositeExplicitAutogradNonFunctional})
    if (op.hasKernelForDispatchKey(key)) return true;
  return false;
}

const Plan* plan_for(const at::RecordFunction& fn) {
  {
    std::lock_guard<std::mutex> guard(mutex);
    auto found = plans.find(fn.name());
    if (found != plans.end()) return &found->second;
  }
  auto name = fn.operator_name();
  if (!name) return nullptr;  // a named range, not an op
  Plan plan;
  auto op = c10::Dispatcher::singleton().findOp(*name);
  plan.below_autograd = op && reaches_kernel(*op);
  plan.copy = name->name == "aten::copy_";
  if (plan.below_autograd) {
    py::gil_scoped_acquire gil;
    if (plan_fn == nullptr) return nullptr;
    py::object got = (*plan_fn)(name->name, name->overload_name);
    if (py::isinstance<py::str>(got)) {
      plan.handoff = got.cast<std::string>() == "handled";
    } else if (!got.is_none()) {
      auto t = got.cast<py::tuple>();
      for (auto item : t[0].cast<py::list>()) {
        auto pair = item.cast<py::tuple>();
        plan.args.push_back({pair[0].cast<size_t>(), pair[1].cast<bool>()});
      }
      plan.fresh = t[1].cast<bool>();
      plan.writes_output = t[2].cast<bool>();
      plan.record = true;
    }
  }
  std::lock_guard<std::mutex> guard(mutex);
  return &plans.emplace(fn.name(), std::move(plan)).first->second;
}

void add(std::vector<Span>& out, const at::Tensor& t, bool write, bool fresh) try {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return;
  const auto* impl = t.unsafeGetTensorImpl();
  // a Python scalar boxed for the kernel; a tensor subclass nested in a list argument (whose op is not recorded)
  if (impl->is_wrapped_number() || impl->key_set().has(c10::DispatchKey::Python)) return;
  if (t.device().is_cuda() != cuda) return;  // host memory: not the modelled device
  int64_t size = t.element_size(), start = t.storage_offset() * size, last = 0;
  if (t.is_contiguous()) last = t.numel() - 1;
  else for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  auto key = reinterpret_cast<int64_t>(t.storage().data());
  if (key == 0) return;
  out.push_back({key, start, start + (last + 1) * size, write, t.sizes().vec(),
                 std::string(c10::getDtypeNames(t.scalar_type()).first), fresh ? (int64_t)t.storage().nbytes() : -1});
} catch (const std::exception&) {
  return;  // no plain storage to read (functionalization wrappers and the like)
}

void add_value(std::vector<Span>& out, const c10::IValue& v, bool write, bool fresh) {
  if (v.isTensor()) add(out, v.toTensor(), write, fresh);
  else if (v.isTensorList()) for (const at::Tensor& t : v.toTensorList()) add(out, t, write, fresh);
  else if (v.isList()) for (const auto& e : v.toListRef()) if (e.isTensor()) add(out, e.toTensor(), write, fresh);
}

bool is_subclass(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const auto& t = v.toTensor();
  return t.defined() && t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python);
}

// An op on a tensor subclass (DTensor, FSDP2's sharded parameters): its own dispatch runs the op on the plain tensors
// that hold the bytes — those are recorded, as under the dispatch mode, so the outer op neither records nor nests.
bool on_subclass(const at::RecordFunction& fn) {
  for (const auto& v : fn.inputs()) {
    if (is_subclass(v)) return true;
    if (v.isList()) for (const auto& e : v.toListRef()) if (is_subclass(e)) return true;
  }
  return false;
}

// x.copy_(y) where both are views of the same bytes: ATen returns before launching anything (no access).
bool copies_onto_itself(const at::RecordFunction& fn) {
  auto inputs = fn.inputs();
  if (inputs.size() < 2 || !inputs[0].isTensor() || !inputs[1].isTensor()) return false;
  const auto& a = inputs[0].toTensor();
  const auto& b = inputs[1].toTensor();
  return a.defined() && b.defined() && a.is_alias_of(b) && a.storage_offset() == b.storage_offset() &&
         a.sizes().equals(b.sizes()) && a.strides().equals(b.strides()) && a.scalar_type() == b.scalar_type() &&
         a.is_conj() == b.is_conj() && a.is_neg() == b.is_neg();
}

// A copy from the device into pageable host memory: CUDA returns from it only once it is done, non_blocking or not,
// and torch reports no synchronize for a non-blocking one (host_sync.py's "copy_" rule, where arguments are seen).
bool into_pageable_host(const at::RecordFunction& fn) {
  auto inputs = fn.inputs();
  if (inputs.size() < 2 || !inputs[0].isTensor() || !inputs[1].isTensor()) return false;
  const auto& dst = inputs[0].toTensor();
  const auto& src = inputs[1].toTensor();
  return dst.defined() && src.defined() && src.is_cuda() && dst.device().is_cpu() && !dst.is_pinned();
}

// A c10d op to the Python model, on the issuing thread: at "start" (before it runs; `out` is None) and at "end".
void hand_over(const at::RecordFunction& fn, const std::vector<c10::IValue>& inputs, const char* phase) {
  if (paused || !on.load()) return;
  py::gil_scoped_acquire gil;
  py::tuple args(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) args[i] = torch::jit::toPyObject(inputs[i]);
  py::object out = py::none();
  if (phase[0] == 'e') {
    auto outputs = fn.outputs();
    if (outputs.size() == 1) out = torch::jit::toPyObject(outputs[0]);
    else {
      py::tuple t(outputs.size());
      for (size_t i = 0; i < outputs.size(); ++i) t[i] = torch::jit::toPyObject(outputs[i]);
      out = t;
    }
  }
  auto name = fn.operator_name();
  try {
    if (handoff_fn != nullptr) (*handoff_fn)(name->name, name->overload_name, args, out, phase);
  } catch (py::error_already_set& error) {  // printed as Python does for errors it cannot raise
    error.discard_as_unraisable("streamrace: modelling a collective");
  }
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (depth > 0 || paused || !on.load()) return nullptr;
  const Plan* plan = plan_for(fn);
  if (plan == nullptr || !plan->below_autograd || on_subclass(fn)) return nullptr;
  if (plan->copy && copies_onto_itself(fn)) return nullptr;
  ++depth;
  auto pending = std::make_unique<Pending>();
  pending->plan = plan;
  if (plan->handoff) {
    auto inputs = fn.inputs();
    pending->inputs.assign(inputs.begin(), inputs.end());
    hand_over(fn, pending->inputs, "start");
  }
  if (plan->record) {
    Record& r = pending->record;
    r.op = fn.name();
    if (cuda) {
      const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      r.stream = reinterpret_cast<int64_t>(impl->getStream(impl->getDevice()).native_handle());
    }
    auto node = torch::autograd::get_current_node();
    r.in_node = node != nullptr;
    if (node != nullptr) {
      r.seq = static_cast<int64_t>(node->sequence_nr());
      r.node = node->name();
    } else {
      r.seq = fn.seqNr();
    }
    auto inputs = fn.inputs();
    for (const auto& [index, write] : plan->args)
      if (index < inputs.size()) add_value(r.accesses, inputs[index], write, false);
    r.stack = stack_here();
    if (cuda && plan->copy && into_pageable_host(fn)) r.synced = r.stream;
    in_flight = &r;
  }
  return pending;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* context) {
  if (context == nullptr) return;
  --depth;
  auto* pending = static_cast<Pending*>(context);
  const Plan* plan = pending->plan;
  if (plan->handoff) {
    hand_over(fn, pending->inputs, "end");
    return;
  }
  if (!plan->record) return;
  in_flight = nullptr;
  Record& r = pending->record;
  if (plan->fresh)
    for (const auto& v : fn.outputs()) add_value(r.fresh, v, plan->writes_output, true);
  std::lock_guard<std::mutex> guard(mutex);
  records.push_back(std::move(r));
}

py::tuple shape_of(const Span& t) {
  py::tuple shape(t.shape.size());
  for (size_t i = 0; i < t.shape.size(); ++i) shape[i] = t.shape[i];
  return shape;
}

}  // namespace

void enable(bool on_cuda, py::object plan, py::object handoff) {
  cuda = on_cuda;
  delete plan_fn;
  delete handoff_fn;
  plan_fn = new py::object(plan);
  handoff_fn = new py::object(handoff);
  {
    std::lock_guard<std::mutex> guard(mutex);
    plans.clear();
    records.clear();
  }
  on.store(true);
  handle = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                     .needsInputs(true).needsOutputs(true).scopes({at::RecordScope::FUNCTION}));
}

void disable() {
  on.store(false);
  at::removeCallback(handle);
  {
    std::lock_guard<std::mutex> guard(mutex);
    records.clear();
    plans.clear();
  }
  delete plan_fn;  // called from Python: the GIL is held; outside the lock, as releasing them may run Python
  delete handoff_fn;
  plan_fn = handoff_fn = nullptr;
}

void set_recording(bool value) { paused = !value; }

// The host waits for `stream` inside the op this thread is running (torch reports the sync from within the op, before
// the op is recorded): kept on the op's record, so the wait lands right after the op. False when no op is in flight.
bool sync_inside_op(int64_t stream) {
  if (in_flight == nullptr) return false;
  in_flight->synced = stream;
  return true;
}

void mark_free(int64_t ptr) {
  Record r;
  r.free = true;
  r.freed = ptr;
  r.stack = stack_here();
  std::lock_guard<std::mutex> guard(mutex);
  records.push_back(std::move(r));
}

// ("free", ptr, stack) or ("op", name, stream, in_node, accesses, fresh, stack, seq, node name or None, synced stream
// or 0); a tensor is
// (storage, start, end, write, shape, dtype[, nbytes]).
py::list drain() {
  std::vector<Record> taken;
  {
    std::lock_guard<std::mutex> guard(mutex);
    taken.swap(records);
  }
  py::list out;
  for (auto& r : taken) {
    py::object stack = py::cast(r.stack);
    if (r.free) {
      out.append(py::make_tuple("free", r.freed, stack));
      continue;
    }
    py::list accesses, fresh;
    for (const auto& t : r.accesses)
      accesses.append(py::make_tuple(t.storage, t.start, t.end, t.write, shape_of(t), t.dtype));
    for (const auto& t : r.fresh)
      fresh.append(py::make_tuple(t.storage, t.start, t.end, t.write, shape_of(t), t.dtype, t.nbytes));
    py::object node = r.node.empty() ? py::object(py::none()) : py::object(py::str(r.node));
    out.append(py::make_tuple("op", r.op, r.stream, r.in_node, accesses, fresh, stack, r.seq, node, r.synced));
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_core(m);  // hb_core.cpp, compiled into this module (capture.load)
  py::class_<Stack, std::shared_ptr<Stack>>(m, "Stack").def("frames", &Stack::frames);
  m.def("enable", &enable);
  m.def("disable", &disable);
  m.def("set_recording", &set_recording);
  m.def("sync_inside_op", &sync_inside_op);
  m.def("mark_free", &mark_free);
  m.def("drain", &drain);
}
