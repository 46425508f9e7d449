// The capture's entry: ops handed to the capture (capture.cpp's on_start/on_end) by a boxed kernel of ours at torch's
// BackendSelect dispatch key.
//
// Why not RecordFunction callbacks: RecordFunction boxes the arguments and outputs of every dispatcher call (composite
// ops before they decompose, every op nested inside a kernel, views): on the launch-bound step ~400 calls for the ~150
// ops the capture records, most of what the capture cost (benchmarks/instructions.py). BackendSelect is the last
// functionality key before the backend's kernel, in every call's key set (torch's default-included keys), and torch
// registers a fallthrough there for every op but factories. So a kernel of ours there sees exactly the calls that reach
// a kernel, below autograd and below any tensor subclass's or mode's handling, as a dispatch mode sees them, and it
// costs one boxing of the ops it is registered for, nothing for the others. Views (they touch no bytes) are left
// out. Factory ops, whose BackendSelect kernel picks the backend from dtype/layout/device, get ours instead, which
// picks it the same way (torchgen's ComputeBackendSelect). The profiler and every other RecordFunction user see what
// they saw before.
//
// The kernels stay registered for the process once added (`hook_ops`, at a session's start). torch writes an op's table
// entry before the key mask that routes calls to it, so adding one is safe beside a thread dispatching that op; taking
// one away is not (a call that read the old mask would reach the fallthrough), and no session needs them gone. Outside
// a session each costs a boxing and a redispatch. An op defined later is added at the next session's start, or within
// a session at the next captured op's start (`ops_added`, set by a dispatcher listener).
//
// Below autograd, the op runs inside its autograd kernel, which has made the op's node already but not yet put it on
// the outputs; the autograd number of the node an op made is the one `at::sequence_number` moved past (`moved_seq`),
// as the dispatch mode reads it. The virtual model binds nodes by that number before a backward (node_streams.cpp),
// but a leaf's AccumulateGrad at the op that first used the leaf. Where that op is a view, its
// node is in the graph a backward walks and gives the right stream there, except for `p.expand_as(p)`, the way DDP,
// DeepSpeed and Megatron reach a parameter's AccumulateGrad outside any graph: so its sessions hook `aten::expand`
// (`hook_ops(true, ...)`), with a lighter entry (`view_entry`). Hooking every view cost 0.24 M instructions on the
// launch-bound step (7% of the step; benchmarks/instructions.py).

namespace {

constexpr c10::DispatchKeySet kBelowBackendSelect(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);

void end(c10::ArrayRef<c10::IValue> outputs, at::ObserverContext* context) noexcept {
  try {
    on_end(outputs, context);
  } catch (const std::exception&) {
  }
}

void run(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack) {
  // No session, or a thread it does not observe (on_start checks the rest: depth, pause)
  if (!on.load(std::memory_order_relaxed) || (!every_thread && !here.observed)) {
    op.redispatchBoxed(below, stack);
    return;
  }
  const auto& schema = op.schema();
  size_t n = schema.arguments().size();
  OpCall call{schema.name().c_str(), c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - n, n), op};
  std::unique_ptr<at::ObserverContext> context;
  try {  // the capture never raises into the op
    context = on_start(call);
  } catch (const std::exception&) {
  }
  if (context == nullptr) {
    op.redispatchBoxed(below, stack);
    return;
  }
  std::vector<c10::IValue> kept;  // a forced run's op: its arguments, for the call after it
  int64_t forced = forcing_wants(context.get());
  if (forced) {
    kept.assign(call.inputs.begin(), call.inputs.end());
    forcing_call("before", forced, call.name, kept, {}, false);
  }
  try {
    op.redispatchBoxed(below, stack);
  } catch (...) {  // a call that threw ends with no outputs
    end(c10::ArrayRef<c10::IValue>(), context.get());
    throw;
  }
  size_t r = schema.returns().size();
  c10::ArrayRef<c10::IValue> outputs(stack->data() + stack->size() - r, r);
  if (forced) forcing_call("after", forced, call.name, kept, outputs, true);
  end(outputs, context.get());
}

void entry(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  run(op, keys & kBelowBackendSelect, stack);
}

// aten::expand, in the virtual model's sessions: a view touches no bytes; the model only binds the AccumulateGrad nodes
// of the leaves it reads, made by now (node_streams.cpp). Nothing else, so it costs its boxing and no more.
void view_entry(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const Here& h = here;
  if (!cuda && h.depth == 0 && !h.paused && live() && (every_thread || h.observed)) {
    size_t n = op.schema().arguments().size();
    try {
      node_streams::bind_inputs(c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - n, n), stream_now());
    } catch (const std::exception&) {
    }
  }
  op.redispatchBoxed(keys & kBelowBackendSelect, stack);
}

// A factory op: the backend from its dtype, layout and device arguments, and its tensor arguments' keys where it has
// any, as torch's generated BackendSelect kernel for it computes them.
void factory_entry(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  size_t n = arguments.size();
  const c10::IValue* values = stack->data() + stack->size() - n;
  std::optional<at::ScalarType> dtype;
  std::optional<at::Layout> layout;
  std::optional<at::Device> device;
  c10::DispatchKeySet tensors;
  bool has_tensors = false;
  for (size_t i = 0; i < n; ++i) {
    const auto& name = arguments[i].name();
    const auto& v = values[i];
    if (v.isNone()) continue;
    if (name == "dtype") dtype = v.toScalarType();
    else if (name == "layout") layout = v.toLayout();
    else if (name == "device") device = v.toDevice();
    else if (v.isTensor()) {
      has_tensors = true;
      if (v.toTensor().defined()) tensors = tensors | v.toTensor().key_set();
    } else if (v.isTensorList()) {
      has_tensors = true;
      for (const at::Tensor& t : v.toTensorList()) if (t.defined()) tensors = tensors | t.key_set();
    }
  }
  auto keys = c10::DispatchKeySet(c10::computeDispatchKey(dtype, layout, device));
  if (has_tensors) keys = c10::impl::computeDispatchKeySet(keys | tensors, kBelowBackendSelect);
  run(op, keys, stack);
}

// Whether every return aliases an argument without writing it (a view: no bytes touched).
bool is_view(const c10::FunctionSchema& schema) {
  const auto& returns = schema.returns();
  if (returns.empty()) return false;
  for (const auto& r : returns)
    if (r.alias_info() == nullptr || r.alias_info()->isWrite()) return false;
  return true;
}

bool is_factory(const c10::FunctionSchema& schema) {  // torchgen's needs_backend_select: TensorOptions arguments
  int found = 0;
  for (const auto& a : schema.arguments()) found += a.name() == "dtype" || a.name() == "layout" || a.name() == "device";
  return found == 3;
}

struct Silent : c10::WarningHandler {  // torch warns once when a kernel replaces another (a factory's, on purpose)
  void process(const c10::Warning&) override {}
};

struct Defined : c10::OpRegistrationListener {  // told of every op defined (under the dispatcher's lock): a flag only
  void onOperatorRegistered(const c10::OperatorHandle&) override { changed(); }
  // an op gone: a handle in `awaiting` may be too, so every op is looked at again
  void onOperatorDeregistered(const c10::OperatorHandle&) override { changed(); }
  static void changed() {  // and the capture's kept plans are dropped (`plans_hold`)
    ops_changes.fetch_add(1, std::memory_order_relaxed);
    ops_added.store(true, std::memory_order_relaxed);
  }
};

std::mutex hooks_mutex;
// Never destroyed: releasing them would change the dispatcher's tables while the process exits.
auto* hooks = new std::vector<c10::RegistrationHandleRAII>();
auto* decided = new std::unordered_set<std::string>();  // "name.overload": hooked, or never to be (a view, ...)
// Ops defined after the first look that had a schema but no kernel a call reaches when last looked at (a kernel yet
// to come: `define`, then `impl`): only these can change without an op being defined or removed (the listener's flag),
// so a session's start looks at them again, not at every op. The ops there were at the first look with no such kernel
// (a thousand composite ones of torch's own, whose kernels all came with the library) are looked at again with every
// op, when one is defined. Handles: looked at from `enable`, under the GIL, which Python's removal of an op holds too,
// and dropped on the flag a removal sets.
auto* awaiting = new std::vector<c10::OperatorHandle>();
auto* at_first_look = new std::unordered_set<std::string>();  // "name.overload" of every op there was then
bool scanned = false;  // every op looked at once
bool expand_seen = false;  // a scan for a virtual session looked at aten::expand

enum class Verdict { kDecided, kAwaiting };

Verdict consider(c10::Dispatcher& dispatcher, const c10::OperatorHandle& op, bool expand) {
  if (!op.hasSchema() || !reaches_kernel(op)) return Verdict::kAwaiting;
  const auto& name = op.operator_name();
  std::string key = name.name + "." + name.overload_name;
  if (decided->count(key)) return Verdict::kDecided;
  if (!c10::ObservedOperators::isObserved(name)) {
    decided->insert(std::move(key));
    return Verdict::kDecided;
  }
  const auto& schema = op.schema();
  bool view = is_view(schema);
  bool expand_op = view && name.name == "aten::expand";
  if (expand_op && !expand) return Verdict::kDecided;  // hooked by a virtual session's scan (`expand_seen`)
  bool factory = op.hasKernelForDispatchKey(c10::DispatchKey::BackendSelect);
  if ((view && !expand_op) || schema.is_vararg() || schema.is_varret() ||
      (factory && (name.name.rfind("aten::", 0) != 0 || !is_factory(schema)))) {  // torchgen's factories, none other
    decided->insert(std::move(key));
    return Verdict::kDecided;
  }
  try {  // an op the dispatcher refuses a kernel for goes uncaptured, rather than the session failing to start
    hooks->push_back(dispatcher.registerImpl(
        name, c10::DispatchKey::BackendSelect,
        factory ? c10::KernelFunction::makeFromBoxedFunction<&factory_entry>()
        : view  ? c10::KernelFunction::makeFromBoxedFunction<&view_entry>()
                : c10::KernelFunction::makeFromBoxedFunction<&entry>(),
        std::nullopt, nullptr, "streamrace: the capture's kernel entry"));
  } catch (const std::exception&) {
  }
  decided->insert(std::move(key));
  return Verdict::kDecided;
}

}  // namespace

// Adds the kernel entry for every op that reaches a kernel and is not hooked yet: at a session's start, and at the next
// captured op's start once an op was defined (`ops_added`). The first time it looks at every op (~6 ms); after that
// only at the ops defined since (the listener's flag: then every op again) and at those defined later that had no
// kernel a call reaches (`awaiting`: a kernel registered for an op defined earlier), so a session starts in
// microseconds. Not for
// views (but aten::expand with `expand`), for ops RecordFunction leaves unobserved (aten::size and the like), for an op
// whose BackendSelect kernel is not one torchgen made for an aten factory (is_pinned, _pin_memory, another library's
// own), or for varargs ops (none in aten).
void hook_ops(bool expand, bool session_start) {
  auto& dispatcher = c10::Dispatcher::singleton();
  std::lock_guard<std::mutex> guard(hooks_mutex);
  // Told of every op there is as it is added (the scan below sees those), then of each one defined after
  static auto* listening = new c10::RegistrationHandleRAII(
      dispatcher.addRegistrationListener(std::make_unique<Defined>()));
  (void)listening;
  Silent silent;
  c10::WarningUtils::WarningHandlerGuard quiet(&silent);
  bool added = ops_added.exchange(false, std::memory_order_relaxed);  // before listing: a later one stays flagged
  bool everything = !scanned || added || (expand && !expand_seen);
  if (!everything && !session_start) return;  // another thread's look took the flag: `awaiting` is for `enable`
  std::vector<c10::OperatorHandle> ops;
  if (everything) {
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (!scanned) at_first_look->insert(name.name + "." + name.overload_name);
      if (auto op = dispatcher.findOp(name)) ops.push_back(*op);
    }
  } else {
    ops.swap(*awaiting);
  }
  awaiting->clear();
  for (const auto& op : ops) {
    if (consider(dispatcher, op, expand) != Verdict::kAwaiting) continue;
    const auto& name = op.operator_name();
    if (!at_first_look->count(name.name + "." + name.overload_name)) awaiting->push_back(op);
  }
  scanned = true;
  expand_seen = expand_seen || expand;
}
