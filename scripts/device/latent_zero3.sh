#!/usr/bin/env bash
# DeepSpeed 0.19.8 ZeRO-3's parameter gather after a step (docs/upstream/zero3-param-gather.md) as a latent race on real
# streams: the stock configuration and default timers, cuda backend, NCCL, one rank per GPU (1 on one GPU,
# 2 on nvidia-h200-x2; at world size 1 DeepSpeed forms no such pair — on CPU neither — so only 2 GPUs check it). The
# partition copy of the step (stage3.py) and the next all-gather's read of the partition
# (partition_parameters.py, on the all-gather stream) are ordered only by host syncs; expected: no race, a latent
# read-after-write per rank hidden by the trace check's read-back (zero/utils.py), and with
# incidental-sync:deepspeed/utils/timer.py and gradient accumulation 2 the timer's sync named too.
#   device run (kind nvidia-h100-x1 / nvidia-h200 / nvidia-h200-x2; carry .whl with deepspeed 0.19.8 and its deps):
#   bash scripts/device/latent_zero3.sh
set -u
. "$(dirname "$0")/setup.sh" latent-zero3
OUT=$OUT/zero3; mkdir -p "$OUT"  # beside latent.sh's logs when one command runs both
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-ds .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site-ds
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
ranks=$(nvidia-smi -L | wc -l); [ "$ranks" -gt 2 ] && ranks=2
work=$(mktemp -d)
cat > "$work/test_zero3_gpu.py" <<PY
import os, pytest, torch
import deepspeed

pytestmark = pytest.mark.distributed(world_size=$ranks)

def test_zero3_stock(streamrace_device, rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(streamrace_device)
    config = {"train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": int(os.environ.get("ACCUMULATION", "1")),
              "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator(device=streamrace_device).manual_seed(1 + rank)
    for _ in range(6):  # micro-batches
        loss = engine(torch.randn(4, 256, device=streamrace_device, generator=generator)).pow(2).mean()
        engine.backward(loss)
        engine.step()
PY
echo "incidental-sync:deepspeed/utils/timer.py" > "$work/s.supp"
cd "$work"
run() {  # name, args...
  local name=$1; shift
  timeout 240 python3 -m pytest -p no:cacheprovider --streamrace --streamrace-backend=cuda -rA \
    --streamrace-json "$OUT/$name.json" "$@" test_zero3_gpu.py > "$OUT/$name.log" 2>&1
  echo "== $name (exit $?)"; grep -E "^(PASSED|FAILED|ERROR)|^streamrace:|Error" "$OUT/$name.log" | cut -c1-200 | head -8
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
def fn(a):
    f = a["frames"][0] if a["frames"] else {"file": "?", "line": 0, "function": "?"}
    return f"{f['file'].split('/')[-1]}:{f['line']} {f['function']}"
for r in json.load(open(sys.argv[1]))["races"]:
    latent = r.get("latent")
    print(f"  rank {r.get('rank')} {'latent ' if latent else ''}{r['kind']:17} {fn(r['earlier'])[:60]:60} -> "
          f"{fn(r['later'])[:60]:60} on {r['later']['stream'][:40]}"
          f"{'  hidden by ' + latent['op'] + ' at ' + latent['at'] if latent else ''}")
PY
}
run report
run fail --streamrace-latent=fail
ACCUMULATION=2 run incidental --streamrace-suppress s.supp --streamrace-report-only
