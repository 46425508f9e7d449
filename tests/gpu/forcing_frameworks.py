"""GPU driver for forcing: stock frameworks are correct until forced, then wrong — with the forcing plain API.
Megatron's DDP with two distributed-optimizer instances built on a side stream is Megatron-LM #3670's race: unforced,
it shows now and then, as timing has it; forced, every iteration.

Run by tests/gpu/test_forcing_gpu.py under ``torchrun --nproc_per_node 2``:
  deepspeed: ZeRO-2 overlap_comm, 12 x Linear(512), 2 SGD steps, params compared exactly with an overlap_comm=False
             reference. Forced = every AccumulateGrad node bound round-robin to 2 side streams, side 0 delayed.
  megatron:  DDP overlap_grad_reduce, num_distributed_optimizer_instances=2, 8 x Linear(2048), 4 iterations, this
             rank's reduce-scatter shard compared exactly with an overlap_grad_reduce=False reference.
             Forced = DDP built on a side stream (as Megatron's training script does), every grad_accs node delayed.
Each configuration runs --repeats times in one process; rank 0 prints one table row per configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os

import torch
import torch.distributed as dist

from pytest_streamrace.forcing.accumulators import bind_accumulators, built_on_side_stream
from pytest_streamrace.forcing.delays import Delays, cycles_per_ms, no_delay, one_slow
from pytest_streamrace.forcing.referee import compare

DEVICE = "cuda"  # a CPU dry run under the virtual backend sets "cpu"


def _params(module) -> dict:
    torch.cuda.synchronize()
    return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}


# DeepSpeed ZeRO-2


def deepspeed_run(overlap: bool, forced: bool, sleep_ms: float) -> dict:
    import deepspeed

    torch.manual_seed(0)
    width = 512
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(12)]).to(DEVICE)
    binding, delays = None, None
    if forced:  # before deepspeed.initialize: its hooks then land on the bound nodes
        binding = bind_accumulators(model, streams=2, policy="round_robin")
        delays = Delays(one_slow("side 0", sleep_ms))
        delays.before_accumulate(binding)
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 2, "overlap_comm": overlap, "contiguous_gradients": True,
                                    "reduce_bucket_size": width * width * 3,
                                    "allgather_bucket_size": width * width * 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    data = torch.Generator(device=DEVICE).manual_seed(1 + dist.get_rank())
    for _ in range(2):
        loss = engine(torch.randn(8, width, device=DEVICE, generator=data)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    params = _params(engine.module)
    if delays is not None:
        delays.restore()
    del engine, binding
    gc.collect()
    return params


def deepspeed_rows(repeats: int, sleep_ms: float) -> list[tuple]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl")
    reference = deepspeed_run(overlap=False, forced=False, sleep_ms=0)
    rows = []
    for name, forced in (("overlap_comm, hooks on default stream", False),
                         (f"overlap_comm, forced: 2 side streams, side 0 +{sleep_ms:g} ms", True)):
        verdicts = [compare(deepspeed_run(True, forced, sleep_ms), reference) for _ in range(repeats)]
        rows.append((f"deepspeed {deepspeed.__version__}", name, verdicts, "runs"))
    return rows


# Megatron-core DDP


def megatron_run(overlap: bool, side: bool, sleep_ms: float, iterations: int) -> list[torch.Tensor]:
    from megatron.core.distributed import DistributedDataParallel as DDP, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(DEVICE)
    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, use_distributed_optimizer=True,
                                           num_distributed_optimizer_instances=2, grad_reduce_in_fp32=True)

    def build():
        return DDP(TransformerConfig(num_attention_heads=1, num_layers=1), config, model)

    if side:
        ddp, stream = built_on_side_stream(build)
    else:
        ddp, stream = build(), None
    delays = Delays(one_slow("build side", sleep_ms) if side and sleep_ms else no_delay())
    delays.before_accumulate(ddp.grad_accs)
    torch.cuda.synchronize()
    data = torch.Generator(device=DEVICE).manual_seed(1234 + dist.get_rank())
    shards = []
    for _ in range(iterations):
        ddp.zero_grad_buffer()
        ddp(torch.randn(64, 2048, device=DEVICE, generator=data)).pow(2).mean().backward()
        ddp.finish_grad_sync()
        torch.cuda.synchronize()
        mine = []
        for group in ddp.bucket_groups:
            n = group.intra_distributed_optimizer_instance_size
            r = group.intra_distributed_optimizer_instance_rank
            mine += [b.grad_data.view(n, -1)[r].float().cpu().clone() for b in group.buckets]
        shards.append(torch.cat(mine))
    delays.restore()
    del ddp, stream
    gc.collect()
    return shards


def megatron_rows(repeats: int, sleep_ms: float, iterations: int = 4) -> list[tuple]:
    import megatron.core
    from megatron.core import parallel_state

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=2)
    reference = megatron_run(overlap=False, side=False, sleep_ms=0, iterations=iterations)
    rows = []
    for name, side, ms in (("overlap_grad_reduce, DDP on default stream", False, 0.0),
                           ("overlap_grad_reduce, DDP on a side stream, no delay", True, 0.0),
                           (f"overlap_grad_reduce, forced: side stream, hooks +{sleep_ms:g} ms", True, sleep_ms)):
        verdicts = []
        for _ in range(repeats):
            got = megatron_run(True, side, ms, iterations)
            verdicts += [compare({"shard": g}, {"shard": r}) for g, r in zip(got, reference)]
        rows.append((f"megatron-core {megatron.core.__version__}", name, verdicts, "iterations"))
    parallel_state.destroy_model_parallel()
    return rows


def table(rows: list[tuple]) -> str:
    lines = [f"cycles per ms (calibrated): {cycles_per_ms():.4g}",
             "| framework | configuration | wrong | NaN/Inf | max rel error |", "|---|---|---|---|---|"]
    for framework, name, verdicts, unit in rows:
        wrong = [v for v in verdicts if not v.identical]
        nan = sum(1 for v in verdicts if v.nonfinite)
        worst = max((v.max_rel_error for v in wrong), default=0.0)
        lines.append(f"| {framework} | {name} | {len(wrong)}/{len(verdicts)} {unit} | {nan} | {worst:.3g} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=("deepspeed", "megatron"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sleep-ms", type=float, default=None,
                        help="delay per forced node (default: 10 for deepspeed, 1 for megatron)")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if args.framework == "deepspeed":
        rows = deepspeed_rows(args.repeats, 10.0 if args.sleep_ms is None else args.sleep_ms)
    else:
        rows = megatron_rows(args.repeats, 1.0 if args.sleep_ms is None else args.sleep_ms)
    if dist.get_rank() == 0:
        print(f"RESULT {args.framework} (rank 0, {args.repeats} repeats)\n{table(rows)}", flush=True)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
