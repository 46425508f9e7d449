"""torch.compile under the detector: compiled code runs compiled, and what its kernels touch is seen.

Dynamo compiles under the detector (the access tracker ignores compile internals, the virtual autograd model stays out
of traced code, and the detector's own entry points are frames dynamo skips), so the program under test is the
user's compiled program. What it does at run time reaches the tracker through its existing interface, as ops on the
stream current at launch, with the user line that called the compiled function:

- ATen calls of compiled code (aot_eager graphs, Inductor's extern kernels such as ``extern_kernels.mm`` and
  fallbacks) pass the dispatcher, where the dispatch mode (virtual) or the C++ capture (cuda) sees them;
- Inductor's generated kernels do not. Their arguments follow one naming convention — ``in_ptr*`` read,
  ``out_ptr*`` written, ``in_out_ptr*`` both — and Inductor lists the arguments a Triton kernel mutates
  (``mutated_arg_names``). C++ kernels (CPU) are module globals of the generated wrapper code, called by name: each
  is replaced, while a session is active, by a callable that records its launch (roles from the C++ signature).
  Triton kernels (Inductor's and user kernels from ``triton_op``/``wrap_triton``, launched through
  ``CachingAutotuner.run``) record theirs on the stream they are launched on;
- a CUDA-graph replay (``mode="reduce-overhead"``, cudagraph trees) is one op reading the graph's inputs and writing
  its outputs on the replay stream; kernels launched while a stream captures are not work and are not recorded.

Every compiled graph is wrapped (``OutputGraph.call_user_compiler``) in a run-time shim that picks up generated
modules loaded since the last call and hands the graph's outputs to `on_outputs` (the virtual autograd model binds
the autograd nodes compiled code created to the stream current at the call).
"""

from __future__ import annotations

import re
import sys

import torch

from .. import compile_time
from ...patching import AttrPatch, WhenImported, dynamo_skipped
from .. import active
from ..tracker import READ, WRITE

_roles_by_file: dict[str, dict[str, tuple[int, ...]]] = {}  # generated module file -> kernel name -> arg roles

_CPP_KERNEL = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\s*\[[^\]]*\]\s*,\s*r?'''(.*?)'''", re.S | re.M)
_CPP_SIGNATURE = re.compile(r'extern\s+"C"[^(]*?\bkernel\s*\(([^)]*)\)', re.S)


def _role(name: str, pointer: bool, const: bool) -> int:
    """Read/write role of a generated kernel's argument from Inductor's naming convention (0: not memory)."""
    if name.startswith("in_out_ptr"):
        return READ | WRITE
    if name.startswith("out_ptr"):
        return WRITE
    if name.startswith("in_ptr"):
        return READ
    if not pointer:
        return 0
    return READ if const else READ | WRITE  # a pointer named otherwise: assume the worst unless it is const


def cpp_roles(source: str) -> tuple[int, ...] | None:
    """Per argument of a generated C++ kernel (``extern "C" void kernel(const float* in_ptr0, ...)``), its role."""
    found = _CPP_SIGNATURE.search(source)
    if found is None:
        return None
    roles = []
    for param in found.group(1).split(","):
        param = param.strip()
        if not param:
            continue
        name = re.findall(r"\w+", param)[-1]
        roles.append(_role(name, "*" in param or "[" in param, param.startswith("const")))
    return tuple(roles)


def module_kernels(path: str) -> dict[str, tuple[int, ...]]:
    """The C++ kernels a generated wrapper module defines, with their argument roles (parsed once per file)."""
    kernels = _roles_by_file.get(path)
    if kernels is None:
        kernels = {}
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            text = ""
        for match in _CPP_KERNEL.finditer(text):
            roles = cpp_roles(match.group(2))
            if roles is not None:
                kernels[match.group(1)] = roles
        _roles_by_file[path] = kernels
    return kernels


class _CppKernel:
    """A generated C++ kernel in its module's globals: records its launch while a session is active."""

    __slots__ = ("name", "fn", "roles")

    def __init__(self, name, fn, roles):
        self.name, self.fn, self.roles = name, fn, roles

    def __call__(self, *args):
        model = _model()
        if model is not None:
            model.launch(self.name, args, self.roles)
        return self.fn(*args)


def _skip_in_dynamo() -> None:
    """Frames dynamo never tries to compile: the entry points the stream models registered with
    ``patching.skip_in_dynamo`` (called from C++, they run inside compiled regions too)."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return
    for code in dynamo_skipped():
        skip_code(code)


def _model() -> "CompiledCode | None":
    """The active session's model of compiled code (generated code and compiled graphs outlive sessions)."""
    return active.model(CompiledCode)


class CompiledCode:
    """A patch (install/uninstall) plus the attr patches it needs: see the module docstring.

    current(): the hb key of the stream current now; on_outputs(out): called with a compiled graph's outputs."""

    def __init__(self, tracker, current, on_outputs=None):
        self.tracker = tracker
        self.current = current
        self.on_outputs = on_outputs
        self._wrapped: list[tuple[dict, str, object]] = []  # (module globals, name, original)
        self._modules_seen = 0
        self._seen_ids: set[int] = set()
        self._lazy: list = []  # (module name, make_patches(module)) applied when it is imported
        self._hooks: list = []
        self._applied: list = []

    # launches

    def launch(self, name: str, args, roles, stream=None) -> None:
        """One generated kernel launched with `args` (roles per argument: READ, WRITE bits) on `stream` (default:
        current)."""
        tracker = self.tracker
        try:
            tracker.launch(name, stream, args, roles)
        except Exception as exc:  # never inside the user's test
            tracker.note(f"{name} is not checked: {type(exc).__name__}: {exc}")

    # generated modules

    def discover(self) -> None:
        """Wrap the C++ kernels of generated modules loaded since the last look."""
        codecache = sys.modules.get("torch._inductor.codecache")
        if codecache is None:  # nothing generated in this process yet
            return
        modules = _loaded(codecache.PyCodeCache)
        if len(modules) < self._modules_seen:  # Inductor's caches were cleared: look at all again
            self._modules_seen = 0
        if len(modules) == self._modules_seen:
            return
        for module in modules[self._modules_seen:]:
            if id(module) in self._seen_ids:
                continue
            self._seen_ids.add(id(module))
            path = getattr(module, "__file__", None)
            if not path:
                continue
            namespace = vars(module)
            for name, roles in module_kernels(path).items():
                fn = namespace.get(name)
                if fn is None or isinstance(fn, _CppKernel):
                    continue
                namespace[name] = _CppKernel(name, fn, roles)
                self._wrapped.append((namespace, name, fn))
        self._modules_seen = len(modules)

    # patch protocol

    def patches(self, stream_model: str) -> list:
        """This patch. What it patches in dynamo and Inductor is patched when that module is imported (now, if it
        is): importing dynamo costs seconds, and most tests never compile."""
        self._lazy = [("torch._dynamo.output_graph", _dynamo_patches), ("torch._inductor.codecache", _codecache_patches)]
        if stream_model == "cuda":
            self._lazy += [("torch._inductor.runtime.triton_heuristics", _triton_patches),
                           ("torch._inductor.cudagraph_trees", _cudagraph_patches)]
        return [self]

    def _apply(self, make_patches, module) -> None:
        for patch in make_patches(module):
            patch.install()
            self._applied.append(patch)

    def install(self) -> None:
        for name, make_patches in self._lazy:
            hook = WhenImported(name, lambda module, make=make_patches: self._apply(make, module))
            self._hooks.append(hook)
            hook.install()
        self.discover()

    def uninstall(self) -> None:
        while self._hooks:
            self._hooks.pop().uninstall()
        while self._applied:
            self._applied.pop().uninstall()
        while self._wrapped:
            namespace, name, original = self._wrapped.pop()
            if isinstance(namespace.get(name), _CppKernel):
                namespace[name] = original


def _loaded(cache) -> list:
    """The generated modules Inductor's PyCodeCache loaded, in the order it loaded them: its ``modules`` list, or
    (torch 2.4) the values of its ``cache`` dict."""
    modules = getattr(cache, "modules", None)
    if modules is not None:
        return modules
    by_key = getattr(cache, "cache", None)
    return list(by_key.values()) if isinstance(by_key, dict) else []


def _dynamo_patches(output_graph) -> list:
    """Every graph a backend compiled is wrapped in the run-time shim (``_runtime``); the detector's entry points
    become frames dynamo skips."""
    _skip_in_dynamo()
    graph_class = output_graph.OutputGraph
    original = graph_class.call_user_compiler

    def call_user_compiler(graph, gm, *args, **kwargs):  # (gm, example_inputs); torch 2.4's takes gm alone
        with compile_time.scope():  # compiling and max-autotune synchronize: not the program's ordering
            compiled = original(graph, gm, *args, **kwargs)
        return _runtime(compiled)
    return [AttrPatch(graph_class, "call_user_compiler", call_user_compiler)]


def _runtime(compiled_fn):
    """A compiled graph as dynamo will call it: generated modules loaded since are wrapped first, the outputs go to
    the active session after. Passes straight through when no session is active (compiled code outlives sessions)."""

    def run(*args, **kwargs):
        model = _model()
        if model is None:
            return compiled_fn(*args, **kwargs)
        model.discover()
        out = compiled_fn(*args, **kwargs)
        if model.on_outputs is not None and _model() is model:
            try:
                model.on_outputs(out)
            except Exception as exc:
                model.tracker.note(f"compiled graph outputs are not bound to streams: {type(exc).__name__}: {exc}")
        return out

    for attr in ("_boxed_call",):
        if hasattr(compiled_fn, attr):
            setattr(run, attr, getattr(compiled_fn, attr))
    return run


# cuda stream model: Triton launches and CUDA-graph replays

def _triton_kernel(autotuner) -> tuple[str, tuple[int, ...]] | None:
    """A Triton kernel launched through Inductor's CachingAutotuner: its name and, per positional argument, its role
    (Inductor's naming convention, plus the arguments it says are mutated; user kernels: their own names). Kept on
    the autotuner: a compiled step launches dozens."""
    kernel = getattr(autotuner, "_streamrace_kernel", None)
    if kernel is not None:
        return kernel
    # The kernel's own argument names; in the parent of a compile worker `fn` may be a stub, the signature stays.
    fn = getattr(autotuner, "fn", None)
    names = getattr(fn, "arg_names", None)
    if not names:
        names = list((getattr(autotuner, "triton_meta", None) or {}).get("signature", {}) or ())
    if not names:
        return None
    mutated = set(getattr(autotuner, "mutated_arg_names", ()) or ())
    roles = []
    for name in names:
        role = _role(name, False, False)
        if name in mutated:
            role |= WRITE
        if not role:
            role = READ  # a user kernel's tensor argument that is not mutated: read (scalars are skipped later)
        roles.append(role)
    kernel = (getattr(fn, "__name__", None) or "triton kernel", tuple(roles))
    try:
        autotuner._streamrace_kernel = kernel
    except AttributeError:
        pass
    return kernel


def _capturing() -> bool:
    try:
        return _stream_capturing()
    except Exception:
        return False


# torch.cuda.is_current_stream_capturing's own call, without its Python frame: asked at every Triton launch
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _codecache_patches(codecache) -> list:
    """Generated modules are wrapped as they load (a backward compiled lazily loads its module mid-backward)."""
    cache = getattr(codecache, "PyCodeCache", None)
    load = getattr(cache, "load_by_key_path", None)
    if load is None:
        return []

    def load_by_key_path(cls, *args, **kwargs):
        module = load(*args, **kwargs)
        model = _model()
        if model is not None:
            model.discover()
        return module
    return [AttrPatch(cache, "load_by_key_path", classmethod(load_by_key_path))]


def _triton_patches(triton_heuristics) -> list:
    """Triton launches through Inductor's CachingAutotuner (its kernels and user kernels alike)."""
    autotuner = getattr(triton_heuristics, "CachingAutotuner", None)
    run = getattr(autotuner, "run", None)
    if run is None:
        return []

    def launch(self, *args, stream, **kwargs):
        # Recorded once run() returns: on its first call run() autotunes first (benchmark launches on copies of the
        # arguments, then a device synchronize), and the kernel is launched after that synchronize, not before it.
        # A compiled step launches dozens: no Python frame of ours between this one and the capture's record.
        out = run(self, *args, stream=stream, **kwargs)
        model = active.models.get(CompiledCode)
        if model is None:
            return out
        try:
            capturing = _stream_capturing()
        except Exception:  # no CUDA here (the virtual backend's stand-ins)
            capturing = False
        if not capturing:
            kernel = getattr(self, "_streamrace_kernel", None) or _triton_kernel(self)
            if kernel is not None:
                on = stream if isinstance(stream, int) else None
                tracker = model.tracker
                capture = tracker._capture if on is None or tracker.device_type == "cuda" else None  # as launch()
                try:
                    recorded = capture is not None and capture.record_kernel(kernel[0], on, args, kernel[1])
                except Exception:  # the model's path says why, once
                    recorded = False
                if not recorded:
                    model.launch(kernel[0], args, kernel[1], on)
        return out
    # Its benchmarking at a kernel's first launch synchronizes the device: the compiler's ordering, not the program's.
    tuning = [AttrPatch(autotuner, name, compile_time.wrap(getattr(autotuner, name)))
              for name in ("precompile", "benchmark_all_configs", "autotune_to_one_config") if hasattr(autotuner, name)]
    return [AttrPatch(autotuner, "run", launch)] + tuning


def _cudagraph_patches(cudagraph_trees) -> list:
    """CUDA-graph replays of cudagraph trees (mode="reduce-overhead")."""
    node = getattr(cudagraph_trees, "CUDAGraphNode", None)
    out = []
    for method in ("run", "run_first_inputs"):
        original = getattr(node, method, None)
        if original is not None:
            out.append(AttrPatch(node, method, _replay(original)))
    record = getattr(node, "_record", None)
    if record is not None:
        out.append(AttrPatch(node, "_record", _untracked(record)))
    return out


def _untracked(original):
    """Recording a CUDA graph launches nothing: ops captured meanwhile (on the capture stream) are not accesses."""

    def record(self, *args, **kwargs):
        model = _model()
        if model is None:
            return original(self, *args, **kwargs)
        with model.tracker.paused(), compile_time.scope():  # recording synchronizes: not the program's ordering
            return original(self, *args, **kwargs)
    return record


def _replay(original):
    """A cudagraph-tree node run: the replay reads the graph's inputs and writes its outputs on the current stream."""

    def run(self, new_inputs):
        model = _model()
        inputs = [t for t in list(new_inputs) + list(getattr(self, "reconstructed_inputs", None) or [])
                  if isinstance(t, torch.Tensor)] if model is not None else []
        outputs = original(self, new_inputs)
        if model is not None and not _capturing():
            written = [t for t in outputs if isinstance(t, torch.Tensor)] if isinstance(outputs, (list, tuple)) else []
            try:
                model.tracker.run("cudagraph replay", model.current(), inputs, written)
            except Exception as exc:
                model.tracker.note(f"a CUDA-graph replay is not checked: {type(exc).__name__}: {exc}")
        return outputs
    return run
