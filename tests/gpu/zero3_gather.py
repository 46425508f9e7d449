"""Does ZeRO-3's next all-gather read the partition before the optimizer step's copy into it finished? (deepspeed
0.19.8; docs/upstream/zero3-param-gather.md). Run under torchrun with 2 GPUs by tests/gpu/test_forcing_gpu.py.

A sleep on the default stream just before `_reassign_or_swap_out_partitioned_parameters` (the step's
`fp16_partitioned_groups_flat.copy_`) widens the window the detector reported. Timed events after the copy and after
the next gather's `torch.cat` (its read of the partition) say which finished first; the gather's send buffer is
compared with its sources at the next synchronize. Each forward after a step also snapshots the gathered weights (a
forward pre-hook runs after ZeRO-3's fetch); after synchronizing, this rank's slice of them is compared with its
partition as the step left it: a difference means the forward computed with pre-step weights. Variants: the stock
configuration (gradient accumulation 1, default timers), bf16/Adam and the fp32/SGD one of
tests/gpu/test_latent_gpu.py; DeepSpeed's own test_2_param_groups configuration (gradient accumulation 2, default
timers), the throughput timer unsynchronized, and a control that synchronizes the device after every step.
"""

import os
import sys

import torch
import torch.distributed as dist

import deepspeed
import deepspeed.runtime.zero.partition_parameters as pp

SLEEP_CYCLES = int(os.environ.get("SLEEP_CYCLES", 200_000_000))  # ~0.1 s on an H200


def run(name, timers_synchronized, sync_after_step, steps=6, accumulation=2, sgd=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
              "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, "bf16": {"enabled": True},
              "timers": {"throughput": {"enabled": True, "synchronized": timers_synchronized}}}
    if sgd:  # test_latent_gpu.py's ZeRO-3 case: fp32, the client's SGD, no "optimizer" or "bf16" section
        del config["optimizer"], config["bf16"]
        config["zero_allow_untested_optimizer"] = True
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    optimizer = engine.optimizer
    original = optimizer._reassign_or_swap_out_partitioned_parameters

    probe = {"event": None, "pending": 0, "done": 0, "pairs": [], "reads": [], "sent_stale": 0}

    def delayed(sub_group_id):
        torch.cuda._sleep(SLEEP_CYCLES)
        out = original(sub_group_id)
        probe["event"] = torch.cuda.Event(enable_timing=True)
        probe["event"].record()  # after the copy, on its stream
        return out

    original_instrument = pp.instrument_w_nvtx

    def instrument(fn):
        if fn is torch.cat and probe["event"] is not None:  # the gather's read of the partition, being enqueued
            probe["done" if probe["event"].query() else "pending"] += 1
            copied, probe["event"] = probe["event"], None

            def cat_then_record(*args, **kwargs):
                out = original_instrument(fn)(*args, **kwargs)
                gathered = torch.cuda.Event(enable_timing=True)
                gathered.record()  # on the gather's stream, right after its read of the partition
                probe["pairs"].append((copied, gathered))
                probe["reads"].append((kwargs["out"], list(args[0])))  # what the gather sent, and its sources
                return out

            return cat_then_record
        return original_instrument(fn)

    pp.instrument_w_nvtx = instrument

    optimizer._reassign_or_swap_out_partitioned_parameters = delayed
    snaps = {}
    linears = [m for m in engine.module.modules() if isinstance(m, torch.nn.Linear)]
    for i, m in enumerate(linears):
        m.register_forward_pre_hook(lambda mod, args, i=i: snaps.__setitem__(i, mod.weight.detach().clone()))
    stale = checked = 0
    after_step = False
    for micro in range(2 * steps):
        x = torch.randn(2, 256, device="cuda", dtype=torch.float32 if sgd else torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        if after_step:  # this forward gathered the weights the last step wrote
            torch.cuda.synchronize()
            # a read that went before the copy sent the pre-step values: compare with its sources as they are now
            probe["sent_stale"] += sum(not torch.equal(sent, torch.cat(src)) for sent, src in probe["reads"])
            probe["reads"].clear()
            # the forward's weights against this rank's partition as the step left it (GatheredParameters would not
            # do: the forward's parameters are still gathered, so it returns the very buffer under test)
            rank, diffs = dist.get_rank(), []
            for i, m in enumerate(linears):
                partition = m.weight.ds_tensor.detach().float().flatten()
                used = snaps[i].float().flatten()[rank * partition.numel():(rank + 1) * partition.numel()]
                diffs.append((used - partition[:used.numel()]).abs().max().item())
            checked += 1
            stale += any(d > 0 for d in diffs)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary and sync_after_step:
            torch.cuda.synchronize()
        after_step = boundary
    pp.instrument_w_nvtx = original_instrument
    torch.cuda.synchronize()
    gaps = [round(copied.elapsed_time(gathered), 3) for copied, gathered in probe["pairs"]]
    if dist.get_rank() == 0:
        print(f"{name:48s} stale forwards {stale}/{checked}; first gather after a step enqueued while the copy was "
              f"pending {probe['pending']}, after it finished {probe['done']}; ms from the copy's end to the read's "
              f"end (negative: the read finished first) {gaps}; gathers that sent pre-step values "
              f"{probe['sent_stale']}/{len(gaps)}", flush=True)
    getattr(engine, "destroy", lambda: None)()


def main():
    deepspeed.init_distributed("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    run("stock config (GAS 1, timers sync)", True, False, accumulation=1)
    run("latent check's config (GAS 1, SGD, fp32)", True, False, accumulation=1, sgd=True)
    run("test_2_param_groups config (GAS 2, timers sync)", True, False)
    run("throughput timer unsynchronized", False, False)
    run("control: device synchronized after each step", False, True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
