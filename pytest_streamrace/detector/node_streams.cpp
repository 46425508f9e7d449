// The virtual autograd model's node binding in C++ (models/autograd_binding.py's NativeBinding), built into the
// capture's module: each new autograd node is bound to the virtual stream current when the op that made it ended
// (capture.cpp calls `bind_outputs` at every op's end), and carries two hooks of ours that run the model's Python
// (`enter`, `leave`) when the node runs, once the session has seen two streams. The fallback binds in Python with a
// function mode, which costs a Python frame per torch call (docs/performance.md).
//
// The binding lives on the node (our pre-hook object): no table keyed by nodes whose addresses are reused, no weak
// references (their type differs between torch versions), and the hook is first in the node's list, before any hook a
// user registers on the node they get back from the op.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_variable.h>

namespace node_streams {

using torch::autograd::Node;
using torch::autograd::variable_list;

std::atomic<bool> binding{false};
std::atomic<uint64_t> session{0};  // bumped per session: a node bound in an earlier one is bound again
std::atomic<streamrace_hb::PyCore*> core{nullptr};  // asked for the stream count (none: the hooks always run)
py::object* enter_fn = nullptr;  // (stream, grads, accumulate)
py::object* leave_fn = nullptr;  // (stream, edges, grads)
std::mutex mutex;  // binding: threads running forward share leaves' AccumulateGrad nodes

// Whether a node's hooks have work: the node is this session's, and two streams exist (on one stream the pre-hook
// would only make current the stream already current, and the post-hook's two-producers rule needs two).
bool runs(uint64_t of) {
  if (!binding.load(std::memory_order_relaxed) || of != session.load(std::memory_order_relaxed)) return false;
  auto* c = core.load(std::memory_order_relaxed);
  return c == nullptr || c->stream_count() > 1;
}

py::list wrap(const variable_list& tensors) {
  py::list out;
  for (const auto& t : tensors) out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
  return out;
}

void call(py::object* fn, const py::object& a, const py::object& b, const py::object& c) {
  try {
    if (fn != nullptr) (*fn)(a, b, c);
  } catch (py::error_already_set& error) {  // never into the user's backward
    error.discard_as_unraisable("streamrace: the virtual autograd model");
  }
}

struct Binding : torch::autograd::FunctionPreHook {
  int64_t stream;
  uint64_t of;
  bool accumulate;
  Binding(int64_t s, uint64_t o, bool a) : stream(s), of(o), accumulate(a) {}
  variable_list operator()(const variable_list& grads) override {
    if (runs(of)) {
      py::gil_scoped_acquire gil;
      call(enter_fn, py::int_(stream), wrap(grads), py::bool_(accumulate));
    }
    return grads;
  }
  // Compiled autograd asks every hook for its arguments (the default throws); ours is left out of its graph, whose
  // nodes run on the caller's stream, as the Python binding's hooks are (they return while compiling). Both
  // signatures: torch made it const in some release.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const {}
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) {}
};

Binding* binding_of(Node* node) {
  for (const auto& hook : node->pre_hooks())
    if (auto* b = dynamic_cast<Binding*>(hook.get())) return b;
  return nullptr;
}

// After the node ran: its gradients and where each goes (the node behind the edge, its input, that node's stream).
struct Follow : torch::autograd::FunctionPostHook {
  Node* node;  // owns this hook
  Binding* binding;  // the node's, owned by it too
  Follow(Node* n, Binding* b) : node(n), binding(b) {}
  variable_list operator()(const variable_list& outputs, const variable_list&) override {
    if (!runs(binding->of)) return outputs;
    py::gil_scoped_acquire gil;
    py::list edges;
    for (const auto& edge : node->next_edges()) {
      if (!edge.is_valid()) {
        edges.append(py::none());
        continue;
      }
      Binding* next = binding_of(edge.function.get());
      int64_t consumer = next != nullptr && next->of == binding->of ? next->stream : binding->stream;
      edges.append(py::make_tuple(reinterpret_cast<intptr_t>(edge.function.get()), edge.input_nr, consumer));
    }
    call(leave_fn, py::int_(binding->stream), edges, wrap(outputs));
    return outputs;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const {}
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) {}
};

// Bind the graph behind `root` to `stream`, up to the nodes this session already bound.
void bind_from(Node* root, int64_t stream) {
  uint64_t now = session.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> guard(mutex);
  thread_local std::vector<Node*> stack;
  stack.assign(1, root);
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    Binding* b = binding_of(node);
    if (b != nullptr && b->of == now) continue;
    if (b != nullptr) {  // an earlier session's (a DDP wrapper's AccumulateGrad nodes live on)
      b->stream = stream;
      b->of = now;
    } else {
      auto hook = std::make_unique<Binding>(stream, now, dynamic_cast<torch::autograd::AccumulateGrad*>(node) != nullptr);
      b = hook.get();
      node->add_pre_hook(std::move(hook));
      if (node->num_outputs() > 0) node->add_post_hook(std::make_unique<Follow>(node, b));
    }
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
}

void bind_tensor(const at::Tensor& t, int64_t stream) {
  if (!t.defined() || !t.requires_grad()) return;
  const auto& fn = t.grad_fn();
  if (fn) bind_from(fn.get(), stream);
}

// Whether new nodes are bound now: a session binds, and grad mode is on (autograd records nothing otherwise).
bool wanted() { return binding.load(std::memory_order_relaxed) && c10::GradMode::is_enabled(); }

// An op's outputs: the nodes they carry, and the new ones behind them, go to `stream`.
void bind_outputs(c10::ArrayRef<c10::IValue> outputs, int64_t stream) {
  if (!wanted()) return;
  for (const auto& v : outputs) {
    if (v.isTensor()) bind_tensor(v.toTensor(), stream);
    else if (v.isTensorList()) for (const at::Tensor& t : v.toTensorList()) bind_tensor(t, stream);
    else if (v.isList()) for (const auto& e : v.toListRef()) if (e.isTensor()) bind_tensor(e.toTensor(), stream);
  }
}

// A compiled graph's outputs (the Python `adopt_outputs`), to `stream`.
void bind_tensors(const std::vector<at::Tensor>& tensors, int64_t stream) {
  if (!wanted()) return;
  for (const auto& t : tensors) bind_tensor(t, stream);
}

void start(py::object enter, py::object leave, py::object hb_core) {
  delete enter_fn;
  delete leave_fn;
  enter_fn = new py::object(std::move(enter));
  leave_fn = new py::object(std::move(leave));
  core.store(hb_core.is_none() ? nullptr : hb_core.cast<streamrace_hb::PyCore*>());
  session.fetch_add(1);
  binding.store(true);
}

void stop() {
  binding.store(false);
  core.store(nullptr);
  delete enter_fn;  // called from Python: the GIL is held
  delete leave_fn;
  enter_fn = leave_fn = nullptr;
}

}  // namespace node_streams
