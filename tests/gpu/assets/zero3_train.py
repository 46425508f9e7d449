"""A DeepSpeed ZeRO-3 training script, as a user writes one, for ``deepspeed --num_gpus 2 zero3_train.py``.

Stock ZeRO-3 with ``overlap_comm`` and every parameter partitioned (``stage3_param_persistence_threshold: 0``): the
configuration in which the next forward's all-gather reads the partitions the optimizer step's copy writes
(docs/upstream/zero3-param-gather.md). ``--accumulation 2`` with ``--unsynchronized-timer`` leaves every step's pair
unordered (a race); the defaults (accumulation 1, DeepSpeed's default timers) leave it ordered only by incidental host
syncs (a latent race). Prints ``step N loss X`` per optimizer step (rank 0), with the loss of its last micro-batch.

On a machine without a GPU, DeepSpeed's CPU accelerator has no streams, so ZeRO's stream code never runs; under
``streamrace run --backend virtual`` (torch.cuda's stream API on CPU) the script gives DeepSpeed an accelerator whose
streams are torch.cuda's, so that it does.
"""

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--accumulation", type=int, default=1)
parser.add_argument("--unsynchronized-timer", action="store_true",
                    help="timers.throughput.synchronized false: no device sync from the throughput timer")
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
args = parser.parse_args()

if not torch.cuda.is_available():
    from pytest_streamrace.detector.session import active

    detector = active()
    if detector is not None and detector.backend == "virtual":
        from deepspeed.accelerator import set_accelerator

        from pytest_streamrace.frameworks.deepspeed_accelerator import virtual_stream_accelerator

        set_accelerator(virtual_stream_accelerator())

import deepspeed  # noqa: E402  (after the accelerator is chosen)

rank = int(os.environ.get("RANK", "0"))
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else \
    torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)  # before the process group: NCCL binds this rank to its GPU
deepspeed.init_distributed()

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)]).to(device)
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": args.accumulation,
    "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1 << 30,
}
if args.unsynchronized_timer:
    config["timers"] = {"throughput": {"enabled": True, "synchronized": False}}
engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                       optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
generator = torch.Generator(device=device).manual_seed(1 + rank)
losses = []
for step in range(args.steps):
    for _ in range(args.accumulation):
        x = torch.randn(4, args.width, device=device, generator=generator)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
# read back once at the end: a read-back per step would order each step's copy before the next gather
if rank == 0:
    for step, loss in enumerate(losses[args.accumulation - 1::args.accumulation], 1):
        print(f"step {step} loss {loss.item():.8f}", flush=True)
torch.distributed.barrier()
