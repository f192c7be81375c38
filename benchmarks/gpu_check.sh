#!/usr/bin/env bash
# The GPU checks of generation, in one run on one CUDA machine (about 11 minutes, most of it Inductor compiling):
#
#   1. NCCL at world size 1, float32, a small Llama: every runtime mode's (eager, compiled, cuda_graph) new tokens
#      against HF's greedy generate, and its plain forward's logits against the model's;
#   2. gloo with CUDA tensors at world size 2 on the one GPU, the same checks; the two processes' small all-reduces
#      go through symmetric memory (PyTorch's one-shot kernel) where torch maps their buffers, and each line says
#      which form the all-reduces took;
#   3. host syncs per decoded token of generate in each runtime mode (benchmarks/host_syncs.py: the synchronizing
#      CUDA calls that torch.cuda.set_sync_debug_mode reports; about one per 8 tokens expected in the compiled modes);
#   4. NCCL at world size 1, bfloat16, an 8-layer Llama of hidden 2048: ms per token of generate in each runtime
#      mode against HF's generate with its static cache (eager, and compiled as HF documents) on the same GPU, and
#      the fraction of the HBM roofline each reaches.
#
# Usage, from the repository root: bash benchmarks/gpu_check.sh [OUT_DIR]   (default $OUT, else a new temp dir).
# Each step has its own time limit, and a step that fails or hangs does not stop the next. What it writes:
# versions.txt, one log and one JSON (benchmarks/runtime_modes.py --json) per step. DEVICE=cpu runs the same steps on
# the CPU with gloo in place of NCCL and tiny models (a check of this script, not a GPU measurement).
set -u
out=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python=${PYTHON:-python3}
device=${DEVICE:-cuda}
if [ "$device" = cuda ]; then
    one=nccl small=4x256x1000 large=8x2048x32000 tokens=64 rounds=3
else
    one=gloo small=2x128x1000 large=2x256x1000 tokens=8 rounds=1
fi

if ! $python -c "import autotp" 2>/dev/null; then  # a machine with torch and transformers but without autotp
    $python -m pip install -q --no-deps --no-build-isolation --ignore-requires-python -e . > "$out/versions.txt" 2>&1
fi
{
    $python - <<'EOF'
import platform, torch, transformers
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
print("CUDA:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
EOF
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
} >> "$out/versions.txt" 2>&1
cat "$out/versions.txt"

step() {  # step NAME SECONDS ARGS...: benchmarks/runtime_modes.py ARGS under a time limit, logged to NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s)"
    timeout "$limit" $python benchmarks/runtime_modes.py --device "$device" --json "$out/$name.json" "$@" \
        > "$out/$name.log" 2>&1
    local status=$?
    grep -E "^Llama|^  [a-z_-]+ |^\||Error|error:|not run" "$out/$name.log" | grep -v "Warning" | tail -40
    echo "== $name: exit $status$([ $status = 124 ] && echo ' (time limit)')"
}

step "$one-1-float32" 150 --backend "$one" --world-sizes 1 --models "$small" --batches 1,4 --new-tokens 16 --rounds 1 \
    --variants "eager,compiled,$([ "$device" = cuda ] && echo cuda_graph,)hf"
step gloo-2-float32 150 --backend gloo --world-sizes 2 --models "$small" --batches 1 --new-tokens 16 --rounds 1 \
    --variants "eager,compiled,$([ "$device" = cuda ] && echo cuda_graph,)hf"
echo "== host-syncs (at most 120 s)"
timeout 120 $python benchmarks/host_syncs.py --device "$device" > "$out/host-syncs.log" 2>&1
status=$?
grep -E "^Llama|^  [a-z_]+ +[0-9]|Error" "$out/host-syncs.log" | tail -8
echo "== host-syncs: exit $status$([ $status = 124 ] && echo ' (time limit)')"
step "$one-1-bfloat16" 270 --backend "$one" --world-sizes 1 --models "$large" --batches 1,8 --new-tokens "$tokens" \
    --rounds "$rounds" --dtype bfloat16 \
    --variants "eager,compiled,$([ "$device" = cuda ] && echo cuda_graph,)hf,hf-compiled"
echo "results in $out"
