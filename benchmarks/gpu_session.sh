#!/usr/bin/env bash
# The GPU checks of opttx as one command, for a lent GPU machine (one NVIDIA GPU, its own
# python3 with torch and CUDA). Each section runs under its own time limit and writes its whole
# log to $OUT/<section>.log; the last lines of every log are printed at the end, so a section
# that runs out of time still leaves the others' figures.
#
# Before the call, on the machine that has the repository (both folders are git-ignored via
# .git/info/exclude and travel with `carry`):
#   .gpu/meta-optimizers   a copy of ../shared/refs/meta-optimizers (Meta's Shampoo)
#   .whl/                  wheels missing there (heavyball)
#
# Usage (on the GPU machine, in the repository root):
#   bash benchmarks/gpu_session.sh [section ...]    # default: env tests update step state_copy
# Sections: env tests update step state_copy gpu_step offload
# (and, not in the default: orthogonalize refresh gram)
#
# Seen on an H100 with torch 2.11 (27 Nov): env + tests 40 s, update 131 s; step never finished
# there (Inductor's assertion, now worked around, stopped it after 70 s; expect 3 compiles of
# about 50 s); the state_copy variants took about 60 s; gpu_step's compiled AdamW at the 1b
# size took 88 s to compile. Budget a 10-minute call accordingly.
set -u
OUT=${OUT:-/tmp/opttx_gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ -d .gpu/meta-optimizers ] && export OPTTX_META_OPTIMIZERS=$PWD/.gpu/meta-optimizers

run() {  # run NAME LIMIT_S COMMAND...: the command's output to $OUT/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name (limit $limit s): $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "=== $name: rc $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/$name.log"
}

env_check() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
        --format=csv
    python3 -c "import torch, opttx; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, torch.cuda.get_device_name(0)); print('opttx', opttx.__file__)"
    python3 -c "import heavyball; print('heavyball', heavyball.__file__)" || true
    ls "${OPTTX_META_OPTIMIZERS:-/nonexistent}/distributed_shampoo" > /dev/null && echo "meta: ok"
}

sections=${*:-env tests update step state_copy}
for s in $sections; do
    case $s in
        env) export -f env_check; run env 30 bash -c env_check ;;
        # The CUDA-only tests (peak memory; offload's placement and copy streams), skipped
        # on CPU.
        tests) run tests 90 python3 -m pytest -q -p no:cacheprovider -x \
                   tests/test_memory_tracker.py \
                   "tests/test_offload.py::test_cuda_state_on_the_host_and_copies_off_the_compute_stream" ;;
        # Shampoo: the optimizer step alone, compiled opttx vs Meta (root-inverse and EC,
        # and EC with first_moment_in_eigenbasis). The limits of this and the step section
        # are guesses: neither has run on a GPU with the first_moment_in_eigenbasis row.
        update) run update 200 python3 benchmarks/shampoo_update.py --device cuda --steps 40 ;;
        # Shampoo: whole compiled training steps, against AdamW's (target <= 1.25x) and Meta's.
        step) run step 260 python3 benchmarks/shampoo_step.py --device cuda --references \
                  --reference-rows "meta-root,meta-ec,shampoo-ec,shampoo-ec-mq" ;;
        # How a compiled step writes its state back (AdamW, 307 M parameters).
        state_copy) run state_copy 120 python3 benchmarks/state_copy.py --device cuda ;;
        # AdamW on the 1.1B shape set: compiled opttx vs torch's fused kernel.
        gpu_step) run gpu_step 300 python3 benchmarks/gpu_step.py --device cuda --steps 30 \
                      --only "adamw.torch_foreach,adamw.torch_fused,adamw.opttx_compiled,adamw.opttx_compiled_cg,adamw.opttx_stacked" \
                      --json "$OUT/gpu_step.json" ;;
        # Offload: a ~1 B GPT step with the optimizer state offloaded (fractions 0, 0.5, 1
        # and the delayed update) against torchao's CPUOffloadOptimizer and no offload: peak
        # device memory and step time. Not run yet (written without a GPU); needs torchao.
        # The limit is a guess: 6 rows of a 1 B model, two Inductor compiles of the host step.
        offload) run offload 420 python3 benchmarks/offload_gpu.py --steps 10 ;;
        # Orthogonalization on the GPU: each method's error against SVD and 24
        # same-shaped 1024 x 1024 matrices batched vs one at a time (not in the default
        # sections; its limit is a guess: it has not run on a GPU yet).
        orthogonalize) run orthogonalize 240 python3 benchmarks/orthogonalize.py \
                           --device cuda --skip-bench --repeats 5 ;;
        # The batched Shampoo/SOAP refresh (one eigh per size group) against one eigh per
        # factor, a 12-layer d=768 model's matrices (not in the default sections; its limit
        # is a guess: it has not run on a GPU yet).
        refresh) run refresh 240 python3 benchmarks/batched_refresh.py --device cuda \
                     --layers 12 --dim 768 --block 1024 --rounds 5 ;;
        # Newton-Schulz against Gram Newton-Schulz per shape (Llama-3 8B's matrices whole and
        # as 8-way tensor-parallel slices): the local work of the sharded Gram mode (not in
        # the default sections; its limit is a guess: it has not run on a GPU yet).
        gram) run gram 180 python3 benchmarks/gram_ns_shapes.py --device cuda --batch 4 \
                  --rounds 5 ;;
        *) echo "unknown section $s" ;;
    esac
done

echo
echo "################ summary: the end of each log ################"
for s in $sections; do
    [ -f "$OUT/$s.log" ] || continue
    echo "---------------- $s ----------------"
    case $s in
        env|tests) tail -n 8 "$OUT/$s.log" ;;
        update) tail -n 9 "$OUT/$s.log" ;;
        step) tail -n 22 "$OUT/$s.log" ;;
        state_copy) tail -n 8 "$OUT/$s.log" ;;
        gpu_step) tail -n 40 "$OUT/$s.log" ;;
        offload) tail -n 16 "$OUT/$s.log" ;;
        orthogonalize) tail -n 36 "$OUT/$s.log" ;;
        refresh) tail -n 6 "$OUT/$s.log" ;;
        gram) tail -n 11 "$OUT/$s.log" ;;
    esac
done
