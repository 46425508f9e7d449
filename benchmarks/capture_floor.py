"""The floor of capturing ops in C++: what the detector's next design (issue 3) would pay before any judging.

A TorchDispatchMode enters Python for every op, and that alone costs 1.7x a launch-bound step on an H200 host
(``overhead.py``'s empty-mode column), above the <= 2x target. This extension instead registers a global
RecordFunction callback that records, in C++, what the dispatch mode would have handed the tracker: each op that
reaches a backend kernel (composite ops decompose first; ops nested in a recorded one are its own business), with the
byte ranges of the storages its schema says it reads and writes, its fresh outputs, the current stream and the Python
stack (torch's C++ capture, named later). Python drains the records as tuples once per step. ``overhead.py`` times
it as the ``capture-floor`` column; nothing in the plugin uses it yet.

Needs a C++ compiler (torch.utils.cpp_extension builds it once, about 40 s, into TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <mutex>
#include <unordered_map>

namespace {

struct Access { int64_t storage, start, end; bool write; };
struct Plan { bool record = false; std::vector<std::pair<size_t, bool>> args; bool fresh = false; };
struct Record {
  const char* op; int64_t stream; std::vector<Access> accesses;
  std::shared_ptr<torch::CapturedTraceback> stack;
};
struct Pending : at::ObserverContext { Record record; const Plan* plan; };

std::mutex mutex;
std::vector<Record> records;
std::unordered_map<const char*, Plan> plans;  // by the op's interned name
at::CallbackHandle handle = 0;
bool cuda = false;
thread_local int depth = 0;  // recorded ops running on this thread

const Plan skip;

const Plan& plan_for(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> guard(mutex);
  auto found = plans.find(fn.name());  // an op's name lives in its schema: a stable key
  if (found != plans.end()) return found->second;
  auto name = fn.operator_name();
  if (!name) return skip;  // a named range, not an op: its name is a temporary, never a key
  Plan plan;
  auto op = c10::Dispatcher::singleton().findOp(*name);
  if (op && !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
    const auto& schema = op->schema();
    for (size_t i = 0; i < schema.arguments().size(); ++i) {
      const auto& arg = schema.arguments()[i];
      bool tensor = arg.type()->str().find("Tensor") != std::string::npos;
      if (arg.alias_info() && arg.alias_info()->isWrite()) plan.args.push_back({i, true});
      else if (!arg.alias_info() && tensor) plan.args.push_back({i, false});
    }
    for (const auto& ret : schema.returns())
      if (!ret.alias_info() && ret.type()->str().find("Tensor") != std::string::npos) plan.fresh = true;
    plan.record = !plan.args.empty() || plan.fresh;  // views and metadata touch no bytes
  }
  return plans.emplace(fn.name(), std::move(plan)).first->second;
}

void add(std::vector<Access>& out, const at::Tensor& t, bool write) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return;
  int64_t size = t.element_size(), start = t.storage_offset() * size, last = 0;
  if (t.is_contiguous()) last = t.numel() - 1;
  else for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  out.push_back({reinterpret_cast<int64_t>(t.storage().data()), start, start + (last + 1) * size, write});
}

void add_value(std::vector<Access>& out, const c10::IValue& v, bool write) {
  if (v.isTensor()) add(out, v.toTensor(), write);
  else if (v.isTensorList()) for (const at::Tensor& t : v.toTensorList()) add(out, t, write);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (depth > 0) return nullptr;
  const Plan& plan = plan_for(fn);
  if (!plan.record) return nullptr;
  ++depth;
  auto pending = std::make_unique<Pending>();
  pending->plan = &plan;
  Record& r = pending->record;
  r.op = fn.name();
  if (cuda) {
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    r.stream = impl->getStream(impl->getDevice()).id();
  } else {
    r.stream = 0;
  }
  auto inputs = fn.inputs();
  for (const auto& [index, write] : plan.args)
    if (index < inputs.size()) add_value(r.accesses, inputs[index], write);
  r.stack = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
  return pending;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* context) {
  if (context == nullptr) return;
  --depth;
  auto* pending = static_cast<Pending*>(context);
  if (pending->plan->fresh)
    for (const auto& v : fn.outputs()) add_value(pending->record.accesses, v, true);
  std::lock_guard<std::mutex> guard(mutex);
  records.push_back(std::move(pending->record));
}

}  // namespace

void enable(bool on_cuda) {
  cuda = on_cuda;
  handle = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                     .needsInputs(true).needsOutputs(true).scopes({at::RecordScope::FUNCTION}));
}

void disable() { at::removeCallback(handle); }

py::list drain() {
  std::vector<Record> taken;
  {
    std::lock_guard<std::mutex> guard(mutex);
    taken.swap(records);
  }
  py::list out;
  for (const auto& r : taken) {
    py::list accesses;
    for (const auto& a : r.accesses) accesses.append(py::make_tuple(a.storage, a.start, a.end, a.write));
    out.append(py::make_tuple(r.op, r.stream, accesses));
  }
  return out;
}
"""


def load():
    """The compiled extension (built on first use)."""
    from torch.utils.cpp_extension import load_inline

    # NDEBUG: torch's headers add debug-only members to RecordFunction otherwise, and its layout would not match
    # the release build of torch.
    return load_inline("streamrace_capture_floor", SOURCE, functions=["enable", "disable", "drain"],
                       extra_cflags=["-O2", "-DNDEBUG"])
