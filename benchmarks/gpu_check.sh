#!/usr/bin/env bash
# GPU checks that fit a one-GPU machine (a few minutes on an H200):
#   1. NCCL process group (one rank), bf16 autocast training, DCP checkpoints of CUDA tensors;
#   2. resume from the step-10 checkpoint: losses of steps 11..20 against the uninterrupted run;
#   3. reshard on GPU: the same checkpoint at pp=1 vpp=2 (two stages on one rank, interleaved 1F1B);
#   4. GPT-2 124M throughput, pp=1, bf16-mixed and bf16-true.
# Two pipeline ranks need two GPUs (NCCL refuses two ranks on one device), so pp >= 2 on NCCL is
# not covered here. Usage: bash benchmarks/gpu_check.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-outputs/gpu_check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"

RUN="python3 -m pipetrain.train trainer=gpu logger=none trainer.enable_progress_bar=false trainer.val_check_interval=0"
SMALL="trainer.max_steps=20 checkpoint.every_n_steps=10 checkpoint.keep_last=5"
$RUN parallel=pp1 $SMALL hydra.run.dir="$OUT/full" 2>&1 | grep -E "pipetrain|Error|error" 
STEP10="$OUT/full/checkpoints/step=10.ckpt"
$RUN parallel=pp1 $SMALL hydra.run.dir="$OUT/resumed" "ckpt_path=\"$STEP10\"" 2>&1 | grep -E "pipetrain|Error|error"
$RUN parallel.pp=1 parallel.vpp=2 schedule=interleaved_1f1b $SMALL hydra.run.dir="$OUT/vpp2" "ckpt_path=\"$STEP10\"" \
    2>&1 | grep -E "pipetrain|Error|error"

python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
full, resumed, vpp2 = (json.load(open(f"{out}/{d}/summary.json")) for d in ("full", "resumed", "vpp2"))
print("accelerator", full["accelerator"], "| full losses", [round(x, 4) for x in full["train_loss"]])
for name, run in (("resumed pp1", resumed), ("resharded pp1 vpp2", vpp2)):
    diffs = [abs(a - b) / abs(b) for a, b in zip(run["train_loss"], full["train_loss"][10:])]
    print(f"{name}: first_step {run['first_step']}, max relative loss difference {max(diffs):.3e}, "
          f"bitwise {run['train_loss'] == full['train_loss'][10:]}")
EOF

BIG="model=gpt2_124m parallel=pp1 data.seq_len=1024 data.micro_batch_size=16 parallel.num_microbatches=2"
BIG="$BIG trainer.max_steps=30 checkpoint.every_n_steps=0 timing_warmup_steps=10 trainer.cpu_threads_per_process=null"
for precision in bf16-mixed bf16-true; do
  $RUN $BIG trainer.precision=$precision hydra.run.dir="$OUT/gpt2_124m_$precision" 2>&1 | grep -E "pipetrain:|Error|error"
done
