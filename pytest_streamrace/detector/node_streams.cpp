// The virtual autograd model's node binding in C++ (models/autograd_binding.py's NativeBinding), built into the
// capture's module: before each backward, every node of the graph behind its roots is bound to the virtual stream that
// was current on its thread when it was made (`bind_graph`), and carries two hooks of ours that run the model's Python
// (`enter`, `leave`) when the node runs, once the session has seen two streams. The fallback binds in Python with a
// function mode, which costs a Python frame per torch call (benchmarks/paired_overhead.py).
//
// Which stream was current when a node was made comes from its own autograd number: each thread's stream switches are
// logged with the number its next node gets (`stream_set`), so nothing is done per op, no op's outputs are read, and a
// node made above the ops the capture sees (a tensor subclass's, a compiled graph's) is found like any other. An
// AccumulateGrad node has no number: it is bound at the captured op that used its leaf (`bind_leaves`), else it takes
// the stream of its earliest consumer in the graph.
//
// The binding lives on the node (our pre-hook object): no table keyed by nodes whose addresses are reused, no weak
// references (their type differs between torch versions), and the hook goes first in the node's list, before any hook
// a user registered on the node, as the engine's stream guard is in place before any of them runs.
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <algorithm>
#include <mutex>
#include <unordered_map>

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
  timers::Callout python;
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
      timers::Scope timed(timers::kModels);
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
    timers::Scope timed(timers::kModels);
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

// Each thread's stream switches in this session (by RecordFunction's thread id, as Node::thread_id keeps it), each
// with the autograd number the thread's next node gets. A thread with none made its nodes on the default stream (0).
// The newest kSwitchesKept halves are kept: a node older than a thread's oldest switch left is taken as the default's.
struct Switch {
  uint64_t seq;
  int64_t stream;
};
constexpr size_t kSwitchesKept = 1 << 16;
std::mutex switches_mutex;
std::unordered_map<uint64_t, std::vector<Switch>> switches;

// The virtual model made `stream` current on this thread (the capture's set_stream).
void stream_set(int64_t stream) {
  if (!binding.load(std::memory_order_relaxed)) return;
  uint64_t thread = at::RecordFunction::currentThreadId();
  uint64_t seq = at::sequence_number::peek();
  std::lock_guard<std::mutex> guard(switches_mutex);
  auto& log = switches[thread];
  if (!log.empty() && log.back().seq == seq) log.pop_back();  // no node made under the stream it replaces
  if (log.empty() ? stream == 0 : log.back().stream == stream) return;
  log.push_back({seq, stream});
  if (log.size() > kSwitchesKept) log.erase(log.begin(), log.begin() + kSwitchesKept / 2);
}

// The stream current on `node`'s thread when it was made (switches_mutex held).
int64_t made_on(const Node* node) {
  auto it = switches.find(node->thread_id());
  if (it == switches.end()) return 0;
  const auto& log = it->second;
  auto after = std::upper_bound(log.begin(), log.end(), node->sequence_nr(),
                                [](uint64_t seq, const Switch& s) { return seq < s.seq; });
  return after == log.begin() ? 0 : std::prev(after)->stream;
}

void bind(Node* node, int64_t stream, uint64_t now) {
  Binding* b = binding_of(node);
  if (b != nullptr) {  // an earlier session's (a DDP wrapper's AccumulateGrad nodes live on)
    b->stream = stream;
    b->of = now;
    return;
  }
  auto hook = std::make_unique<Binding>(stream, now, dynamic_cast<torch::autograd::AccumulateGrad*>(node) != nullptr);
  b = hook.get();
  auto& pre = node->pre_hooks();
  pre.insert(pre.begin(), std::move(hook));
  if (node->num_outputs() > 0) node->add_post_hook(std::make_unique<Follow>(node, b));
}

// Whether nodes are bound now: a session binds, and grad mode is on (autograd records nothing otherwise).
bool wanted() { return binding.load(std::memory_order_relaxed) && c10::GradMode::is_enabled(); }

// A leaf's AccumulateGrad node, made by the leaf's first use, runs where that use ran (its number says nothing), and a
// backward may start from another graph than the one that made it (DDP and DeepSpeed make theirs with
// `p.expand_as(p)`): so it is bound at the op. `leaves_of` at the op's start keeps its inputs that are leaves needing a
// gradient (the node may not exist yet above autograd); `bind_leaves` at its end binds their nodes to `stream`.
void leaves_of(c10::ArrayRef<c10::IValue> inputs, std::vector<at::Tensor>& leaves) {
  if (!wanted()) return;
  for (const auto& v : inputs)
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad() && v.toTensor().is_leaf())
      leaves.push_back(v.toTensor());
}

void bind_leaves(std::vector<at::Tensor>& leaves, int64_t stream) {
  uint64_t now = session.load(std::memory_order_relaxed);
  for (const auto& t : leaves) {
    auto accumulator = torch::autograd::impl::try_get_grad_accumulator(t);
    if (!accumulator) continue;
    std::lock_guard<std::mutex> guard(mutex);
    Binding* b = binding_of(accumulator.get());
    if (b == nullptr || b->of != now) bind(accumulator.get(), stream, now);
  }
  leaves.clear();
}

// Below autograd (a view's kernel entry), where the nodes exist already: both at once.
void bind_inputs(c10::ArrayRef<c10::IValue> inputs, int64_t stream) {
  std::vector<at::Tensor> leaves;
  leaves_of(inputs, leaves);
  if (!leaves.empty()) bind_leaves(leaves, stream);
}

// Before a backward: the graph behind `roots`, up to the nodes this session already bound. An AccumulateGrad no op
// bound (its leaf used outside the ops the capture sees) takes the stream of its earliest consumer in the graph;
// `caller`, the stream of a root that has no number.
void bind_graph(const std::vector<Node*>& roots, int64_t caller) {
  if (!binding.load(std::memory_order_relaxed)) return;
  uint64_t now = session.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> guard(mutex);
  std::lock_guard<std::mutex> log_guard(switches_mutex);
  struct Step {
    Node* node;
    uint64_t consumer_seq;  // the node that reached it: its number and stream
    int64_t consumer_stream;
  };
  std::vector<Step> stack;
  std::unordered_map<Node*, std::pair<uint64_t, int64_t>> unnumbered;  // their earliest consumer's number and stream
  for (Node* root : roots)
    if (root != nullptr) stack.push_back({root, UINT64_MAX, caller});
  while (!stack.empty()) {
    Step step = stack.back();
    stack.pop_back();
    Node* node = step.node;
    Binding* b = binding_of(node);
    if (b != nullptr && b->of == now) continue;
    uint64_t seq = node->sequence_nr();
    int64_t stream;
    if (seq == UINT64_MAX) {
      auto [at, fresh] = unnumbered.try_emplace(node, step.consumer_seq, step.consumer_stream);
      if (!fresh) {
        if (step.consumer_seq < at->second.first) at->second = {step.consumer_seq, step.consumer_stream};
        continue;
      }
      stream = step.consumer_stream;
    } else {
      stream = made_on(node);
      bind(node, stream, now);
    }
    for (const auto& edge : node->next_edges())
      if (edge.function) stack.push_back({edge.function.get(), seq, stream});
  }
  for (const auto& [node, consumer] : unnumbered) bind(node, consumer.second, now);
}

template <class T>
Node* raw_node(const std::weak_ptr<T>& node) {  // a custom Function's node, before torch 2.12
  return node.lock().get();
}
template <class P>
Node* raw_node(const P& node) {
  return node.get();
}

// `bind_graph` from Python: the backward's roots (tensors, or the nodes of GradientEdges), the caller's stream.
void bind_roots(py::handle roots, int64_t caller) {
  timers::Scope timed(timers::kModels);
  std::vector<Node*> nodes;
  for (py::handle root : roots) {
    PyObject* obj = root.ptr();
    if (THPVariable_Check(obj)) nodes.push_back(THPVariable_Unpack(obj).grad_fn().get());
    else if (torch::autograd::THPCppFunction_Check(obj))
      nodes.push_back(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata.get());
    else if (THPFunction_Check(obj)) nodes.push_back(raw_node(reinterpret_cast<THPFunction*>(obj)->cdata));
  }
  py::gil_scoped_release released;  // the walk holds our locks only
  bind_graph(nodes, caller);
}

void start(py::object enter, py::object leave, py::object hb_core) {
  delete enter_fn;
  delete leave_fn;
  enter_fn = new py::object(std::move(enter));
  leave_fn = new py::object(std::move(leave));
  core.store(hb_core.is_none() ? nullptr : hb_core.cast<streamrace_hb::PyCore*>());
  session.fetch_add(1);
  {
    std::lock_guard<std::mutex> guard(switches_mutex);
    switches.clear();
  }
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
