"""DeepSpeed #8036: DeepCompile ZeRO-1 kept its gradient targets alive through the optimizer step."""

from __future__ import annotations

import contextlib

from pytest_streamrace.patching import patched
from pytest_streamrace.repro.spec import Framework, Repro, Variant

WIDTH, LAYERS = 4096, 8  # 134 M parameters, as in the measurement behind docs: one bf16 partition is 128 MiB on 2 ranks
_cache: dict = {}  # the compiled engine of this rank process, reused by --repeat runs (DeepCompile state is global)


def has_native_fix() -> bool:
    """Whether the installed DeepSpeed has DeepSpeed #8036 (ZeRO's step releases DeepCompile's pre-flattened
    gradients)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return hasattr(DeepSpeedZeroOptimizer, "_release_preflattened_grad_buffers")


# The harness patches: engine.compile() with DeepSpeed #8036 on or off, whatever version is installed.

def _init_functions():
    """(module, attribute) of each place DeepCompile's ZeRO-1/2 init is looked up from."""
    import importlib

    found = []
    for module, attr in (("deepspeed.compile.init_z1_and_2", "init_z1_and_2"),  # >= 0.19.7
                         ("deepspeed.compile.init_z1", "init_z1"),  # <= 0.19.6
                         ("deepspeed.runtime.engine", "init_z1")):  # imported at module level in <= 0.19.1
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, attr):
            found.append((mod, attr))
    return found


@contextlib.contextmanager
def deepcompile_fix(fixed: bool):
    """Inside, engine.compile() sets DeepCompile ZeRO-1 up with DeepSpeed #8036 (fixed=True) or without it."""
    if fixed == has_native_fix():
        yield
        return
    wrap = _apply_fix if fixed else _remove_fix
    with contextlib.ExitStack() as patches:
        for mod, attr in _init_functions():
            patches.enter_context(patched(mod, attr, wrap(getattr(mod, attr))))
        yield


def _remove_fix(init):
    """DeepSpeed #8036 removed (>= 0.19.2): ZeRO-1 gets persistent cloned per-parameter targets, registered with the
    native op once and handed to the optimizer as plain lists — what ZeRO-1 did up to 0.19.1, and what the ZeRO-2 branch
    of the same init still does. The reduce pass stays ZeRO-1's."""
    def init_without_fix(engine, backend, compile_config, compile_kwargs, schedule=None, use_z2=False):
        if use_z2:
            return init(engine, backend, compile_config, compile_kwargs, schedule, use_z2)
        if schedule is None:
            schedule = [(0, [_z1_reduce_pass()])]
        return init(engine, backend, compile_config, compile_kwargs, schedule, use_z2=True)
    return init_without_fix


def _z1_reduce_pass():
    try:
        from deepspeed.compile.passes.zero_1_and_2_compile import add_z1_reduce  # >= 0.19.7
    except ImportError:
        from deepspeed.compile.passes.zero1_compile import add_z1_reduce
    return add_z1_reduce


def _apply_fix(init):
    """DeepSpeed #8036 applied (<= 0.19.1). The native op of these versions cannot rebind a parameter's target
    (registration keeps the first), so the targets it holds are moved into one flat partition buffer per group, whose
    memory is allocated when backward starts and released (storage resized to zero) as soon as the fp32 partition is
    built — the same lifetime as the fix's step-local buffer. ZeRO's step uses that buffer as the flat partition, as the
    fix does, instead of flattening a copy."""
    def init_with_fix(engine, backend, compile_config, compile_kwargs, schedule=None, use_z2=False):
        out = init(engine, backend, compile_config, compile_kwargs, schedule, use_z2)
        if not use_z2:
            _step_local_targets(engine.optimizer)
        return out
    return init_with_fix


class _Partition(list):
    """One group's gradient targets, views of `flat_partition` (the name ZeRO's step looks for since
    DeepSpeed #8036)."""

    def __init__(self, targets, flat):
        super().__init__(targets)
        self.flat_partition = flat

    def acquire(self) -> None:
        storage = self.flat_partition.untyped_storage()
        storage.resize_(self.flat_partition.numel() * self.flat_partition.element_size())
        self.flat_partition.zero_()

    def release_grad_buffers(self) -> None:
        self.flat_partition.untyped_storage().resize_(0)


class _ReleasingGradients(dict):
    """optimizer.averaged_gradients: ZeRO's step sets a group to None right after building its fp32 partition —
    where the fix releases the group's targets."""

    def __setitem__(self, key, value):
        old = self.get(key)
        if value is None and isinstance(old, _Partition):
            old.release_grad_buffers()
        super().__setitem__(key, value)


def _step_local_targets(optimizer) -> None:
    import torch
    from deepspeed.compile import util

    hook = util.pre_backward_hooks[-1] if util.pre_backward_hooks else None
    names = getattr(getattr(hook, "__code__", None), "co_freevars", ())
    if "grad_buffer" not in names:
        raise RuntimeError("streamrace: cannot apply DeepSpeed #8036 to this DeepSpeed: its ZeRO-1 init did not "
                           "leave the expected set_grad_buffer hook")
    grad_buffer = hook.__closure__[names.index("grad_buffer")].cell_contents  # {group: [registered targets]}
    if any(t.dtype == torch.float32 for targets in grad_buffer.values() for t in targets):
        # ZeRO's step would alias an fp32 flat partition as the fp32 gradient, and releasing it would lose them
        raise RuntimeError("streamrace: the DeepSpeed #8036 harness patch expects 16-bit gradient targets (bf16 or "
                           "fp16)")
    partitions = {}
    with torch.no_grad():
        for group, targets in grad_buffer.items():
            flat = torch.zeros(sum(t.numel() for t in targets), dtype=targets[0].dtype, device=targets[0].device)
            offset = 0
            for t in targets:  # the native registry holds these very tensors: they now view the flat buffer
                t.set_(flat.untyped_storage(), offset, t.shape)
                offset += t.numel()
            partitions[group] = _Partition(targets, flat)  # kept allocated until the first step releases it

    def set_step_local_grad_buffer(*_):
        for p in partitions.values():
            p.acquire()
        optimizer.averaged_gradients = _ReleasingGradients(partitions)

    util.pre_backward_hooks[-1] = set_step_local_grad_buffer
    flatten, aligned = optimizer.flatten, optimizer.flatten_dense_tensors_aligned

    def preflattened(original):
        def flat_or_copy(tensors, *args, **kwargs):
            flat = getattr(tensors, "flat_partition", None)
            return flat.view(-1) if flat is not None else original(tensors, *args, **kwargs)
        return flat_or_copy

    optimizer.flatten, optimizer.flatten_dense_tensors_aligned = preflattened(flatten), preflattened(aligned)


# One rank's run.

def _compiling_untracked(detector):
    """The detector stays out: this bug is about lifetimes, not races (its tracker lets dynamo compile)."""
    return detector.paused() if detector is not None else contextlib.nullcontext()


def _engine(ctx):
    cached = _cache.get("engine")
    if cached is not None and _cache.get("variant") == ctx.variant:
        return cached
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]).to(ctx.device)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1},
              "compile": {"deepcompile": True}, "bf16": {"enabled": True},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    with deepcompile_fix(fixed=ctx.variant == "patched"):
        engine.compile()
    _cache.update(engine=engine, variant=ctx.variant)
    return engine


def _track_targets(checker, engine, names: dict) -> None:
    """Register this step's gradient targets (what DeepCompile reduces into, ZeRO's averaged_gradients): each must
    be gone when the inner optimizer steps."""
    optimizer = engine.optimizer
    for group, targets in (optimizer.averaged_gradients or {}).items():
        if not targets:
            continue
        params = optimizer.params_in_partition[group]
        by_storage: dict[int, list[str]] = {}
        index = 0  # of the next parameter: targets are the partition's parameters in order, padding where marked
        for t in targets:
            if getattr(t, "_zero_padding", False) or index >= len(params):
                label = "padding"
            else:
                label, index = names.get(id(params[index]), f"param {index}"), index + 1
            if t.untyped_storage().nbytes():
                by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(label)
        for t in {t.untyped_storage().data_ptr(): t for t in targets if t.untyped_storage().nbytes()}.values():
            labels = by_storage[t.untyped_storage().data_ptr()]
            name = (f"gradient target of {labels[0]} (group {group})" if len(labels) == 1 else
                    f"flat gradient partition of group {group} ({len(labels)} targets: {', '.join(labels[:3])}...)")
            checker.track(t.untyped_storage(), name, by="optimizer.step")


def run(ctx) -> dict:
    import torch

    from pytest_streamrace.lifetime import LifetimeChecker

    with _compiling_untracked(ctx.detector):
        engine = _engine(ctx)
        names = {id(p): n for n, p in engine.module.named_parameters()}
        checker = LifetimeChecker(ctx.device)
        checker.at_call(engine.optimizer.optimizer, "step", phase="optimizer.step")
        generator = torch.Generator(device=ctx.device).manual_seed(1 + ctx.rank + 1000 * ctx.repeat)
        try:
            for step in range(ctx.steps):
                x = torch.randn(8, WIDTH, device=ctx.device, generator=generator).to(torch.bfloat16)
                checker.phase("forward")
                loss = engine(x).float().pow(2).mean()
                checker.phase("backward")
                engine.backward(loss)
                _track_targets(checker, engine, names)
                engine.step()
                ctx.progress(f"step {step + 1}/{ctx.steps}: loss {loss.item():.5f}, "
                             f"{len(checker.violations)} target(s) retained so far")
        finally:
            checker.close()
    if checker.unreached or not checker.checked:
        raise RuntimeError("deepcompile_zero1: no gradient target was checked at the optimizer step "
                           f"({len(checker.unreached)} unchecked); the run did not exercise DeepCompile ZeRO-1")
    mib = 1 << 20
    partition = sum(int(n) for n in engine.optimizer.partition_size) * 2  # bf16 gradients
    step_peaks = [s.peak_bytes for s in checker.peaks.segments if s.phase == "optimizer.step"]
    return {"retained": len(checker.violations), "retained_mib": round(checker.retained_bytes() / ctx.steps / mib, 1),
            "partition_mib": round(partition / mib, 1), "step_peak_mib": round(step_peaks[-1] / mib, 1),
            "checked": checker.checked, "first": checker.problems().splitlines()[1].strip() if checker.violations
            else ""}


REPRO = Repro(
    name="deepcompile_zero1",
    title="DeepSpeed DeepCompile ZeRO-1: gradient targets alive through the optimizer step (DeepSpeed #8036)",
    description="""
DeepCompile ZeRO-1 reduces gradients inside the compiled backward graph (the native `dc` op) into gradient targets
registered per parameter. Up to 0.19.1 those targets were clones made once at compile time, held by the native op's
registry and by the init's closure for the life of the engine; ZeRO's step flattened a copy of them into the fp32
partition, so during the optimizer step one bf16 gradient partition stayed allocated for nothing — peak memory one
partition higher on every step. DeepSpeed #8036 binds the targets to a flat partition buffer built when backward starts,
lets ZeRO's step use it as the flat partition, and releases it (and the registry's references) right after the fp32
partition is built. The repro runs DeepCompile ZeRO-1 (bf16, AdamW, 8 x Linear(4096)) and tracks every gradient
target with the lifetime checker: each must be gone when the inner optimizer steps. On 0.19.8 the harness
re-introduces the bug (ZeRO-1 set up with persistent cloned targets, as the ZeRO-2 branch of the same init still
does); on 0.19.1 it applies the fix (the registered targets moved into one flat buffer per group, its storage
allocated at backward and resized to zero after the fp32 partition, since that native op cannot rebind a target).
Evidence: targets still alive at the optimizer step, and the step's peak (compare step_peak_mib across variants:
expected to differ by about partition_mib). CUDA only: DeepCompile JIT-builds its native op with nvcc.""",
    references=("https://github.com/deepspeedai/DeepSpeed/pull/8036", "docs/how-to/buffer-lifetimes.md"),
    affected="deepspeed <= 0.19.1",
    fixed="deepspeed >= 0.19.2",
    framework=Framework("deepspeed", ">=0.19.1", extra="deepspeed"),
    variants=(
        Variant("unpatched", "reproduced", "persistent cloned gradient targets (as <= 0.19.1)"),
        Variant("patched", "clean", "step-local flat gradient partition, released after the fp32 partition "
                "(DeepSpeed #8036)"),
    ),
    run=run,
    backends=("cuda",),
    relevant=None,  # the evidence is lifetimes; the detector is paused for the run
)
