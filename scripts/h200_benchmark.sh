#!/usr/bin/env bash
# H200 benchmark of BridgeTower Large contrastive training on one GPU (random weights, synthetic cartoons):
# samples/s, MFU, data_wait_fraction and peak GPU memory for dataloader workers 0/1/2 x image paths
# {upstream, fast, device decode}, next to the data-free ceiling (lab/gpu_ceiling.py).
#
# The ceiling is measured for each training set-up, which changes how fast the model trains, not what it
# computes. A set-up is a dash-joined list of parts: "eager" (the script's defaults, which are
# GaudiTrainingArguments' recipe: AdamW eps 1e-6, adamw_torch, no per-step NaN check; and transformers'
# attention code, as the published GPU runs), "sdpa" (--attn_implementation sdpa: the text and cross-modal
# attention in one fused call), "sync" (--logging_nan_inf_filter True, transformers' own default, which the
# scripts no longer take: the Trainer's per-step NaN check reads the loss on the host, which waits for the
# device at every step; not in the default ladder, since no per-step sync is now every set-up's default, so
# the old "nosync" part would measure "sdpa" again), "compiled" (--compile_layers inductor: every
# repeated layer compiled in place) and "fused" (--optim adamw_torch_fused; within noise of eager on
# 2026-11-30). The default ladder adds one part at a time, so that each part's gain reads off side by
# side. Every configuration runs REPEATS times (default 2) in the same script run and is judged on its median;
# the loader matrix then runs with the set-up of the fastest median ceiling among those whose peak memory
# stays within MAX_GPU_GB (default 80, so that an H100 80GB runs it), and every row's "% of ceiling" is
# against its own set-up's median ceiling. (Throughput windows wait for the device at both ends.)
#
# On a GPU machine, from the repo root: bash scripts/h200_benchmark.sh
# A machine without network (and with another transformers than ours) takes the wheels that
# scripts/fetch_device_wheels.sh downloads elsewhere into .whl/: when .whl/ holds wheels, they are installed
# into $SITE (default /tmp/site) first and put first on PYTHONPATH, so they shadow the machine's own copies.
# Budget: under 10 minutes in all. No run starts after DEADLINE_S seconds; each is killed at its limit.
# Runs go in order of importance, so a short budget loses the least useful ones.
# Writes to $OUT (default bench_out/h200): h200_table.md, h200_results.json, device_decode_check.json,
# h200_logs.txt (the end of every run's log and of the GPU tests' log) and h200_console.log (this output).
#
# First contact (FIRST_CONTACT=1, the default; its time is added to DEADLINE_S, so the runs keep their budget):
# before anything else, the NVIDIA self-check (python -m bridgetower_bench.tools.nvidia_check: its table in
# the console, its record as $OUT/nvidia_check.json, exit status in $OUT/nvidia_check_exit.txt), then the CUDA
# script's one-line refusals, each saved with its exit status: with CUDA_VISIBLE_DEVICES= (no GPU visible:
# $OUT/refusal_no_gpu.txt) and with a per-device batch the device cannot hold, once where the need is measured
# (the check before step 1: $OUT/refusal_batch_estimate.txt) and once where it is not, so that the first step
# runs out of memory ($OUT/refusal_batch_oom.txt). TOO_BIG_BATCH (default 128) and OOM_BATCH (512) set them.
# It builds the Large model once and loads it three times: FIRST_CONTACT=only stops after it, so that it and
# the runs (FIRST_CONTACT=0) can go in two calls where one command's time is limited.
#
# A self-check that does not pass (no usable GPU: exit status 2; a check that failed: 1) ends the script with
# its status, before anything else is built or run. Stopped (Ctrl-C, SIGTERM, SIGHUP), the script stops what it
# started, each command with its own process group (timeout's), and exits 128 + the signal.
#
# SMOKE=1 runs the same steps on CPU with the tiny model and a few steps, to check the script itself
# (the self-check then says there is no GPU, exit status 2, which smoke mode expects and goes on after, and the
# batch refusals, which need a GPU, are skipped; SETUPS="eager" runs one ceiling); WORKERS="0" (say) runs fewer
# worker counts; CHECK=0 skips the device decode check; PROFILE=0 the profiled ceiling run (its
# profile.txt, the operators and kernels that take the step's time, lands in $OUT as ceiling_profile.txt). On a
# CPU machine (WHEELS= skips the wheel install):
#     WHEELS= SMOKE=1 WORKERS=0 bash scripts/h200_benchmark.sh
# Python: the kit's environment, .venv/bin/python when there is one (the README's NVIDIA install; no need to
# activate it), else python3 from PATH; PYTHON=... names another.
set -uo pipefail

# Every command that may take long runs in the background under timeout (which gives it a process group of its
# own) and is waited for here, so that a signal reaches the traps at once; on the way out, whatever this script
# started and is still running is stopped, group by group.
stop_children() {
    trap - EXIT
    local pid
    for pid in $(jobs -p); do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null; done
}
trap stop_children EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
bounded() {  # bounded SECONDS COMMAND...: COMMAND killed after SECONDS (and KILLed 10 s later), waited for here
    timeout --kill-after=10 "$@" &
    wait "$!"
}

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
WHEELS=${WHEELS-.whl}
CARRIED=0
if [[ -n "$WHEELS" ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE=${SITE:-/tmp/site}
    CARRIED=1
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=$SITE:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

OUT=${OUT:-$PWD/bench_out/h200}
WORK=${WORK:-/tmp/h200_bench}
SMOKE=${SMOKE:-0}
BATCH=${BATCH:-48}
STEPS=${STEPS:-15}            # optimizer steps per run; the first WARMUP are not counted
WARMUP=${WARMUP:-5}
DEADLINE_S=${DEADLINE_S:-470} # start no run after this many seconds of the script
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-120}
MIN_RUN_S=${MIN_RUN_S:-45}    # start no run that the deadline would cut shorter than this (a run takes 25-45 s)
TRAIN_ROWS=$(( (STEPS + 3) * BATCH ))  # the steps, the decode look-ahead and the loader's own prefetch

WORKERS=${WORKERS:-0 2 1}     # in this order
SETUPS=${SETUPS:-eager sdpa sdpa-compiled}  # ceilings in this order
REPEATS=${REPEATS:-2}         # runs of each configuration; the median decides
MAX_GPU_GB=${MAX_GPU_GB:-80}  # a set-up whose ceiling peaks above this is never the one the matrix runs
CHECK=${CHECK:-1}             # 0 skips the device decode check (section 2)
FIRST_CONTACT=${FIRST_CONTACT:-1}    # 0 skips the self-check and the refusals (section 0b); "only" runs nothing else
TOO_BIG_BATCH=${TOO_BIG_BATCH:-128}  # more than one H200 holds by the measured need: refused before step 1
OOM_BATCH=${OOM_BATCH:-512}          # with sdpa attention (no measured need): the first step runs out of memory
PROFILE=${PROFILE:-1}         # 0 skips the profiled ceiling run (section 3b)
MODEL_FLAGS=(--large) MODEL_DIR=bridgetower-large-random
DEVICE_FLAGS=(--bf16)
SETUP="BridgeTower Large (random weights), bf16"
if [[ "$SMOKE" == 1 ]]; then
    BATCH=4 STEPS=3 WARMUP=1 TRAIN_ROWS=32 MIN_RUN_S=5
    MODEL_FLAGS=(--layers 2) MODEL_DIR=tiny-bridgetower  # two layers per stack, so that --compile_layers has work
    DEVICE_FLAGS=(--use_cpu)
    SETUP="SMOKE TEST: tiny BridgeTower on CPU, fp32"
fi

setup_flags() {  # the training flags of a set-up, one per line (see the header)
    local part
    for part in ${1//-/ }; do
        case $part in
            eager) ;;
            sdpa) printf '%s\n' --attn_implementation sdpa ;;
            sync) printf '%s\n' --logging_nan_inf_filter True ;;
            compiled) printf '%s\n' --compile_layers inductor ;;
            fused) printf '%s\n' --optim adamw_torch_fused ;;
            *) echo "unknown set-up part '$part' in '$1'" >&2; return 1 ;;
        esac
    done
}
for setup in $SETUPS; do setup_flags "$setup" > /dev/null || exit 1; done  # before any device time is spent

mkdir -p "$OUT" "$WORK/results" "$WORK/logs"
exec > >(tee "$OUT/h200_console.log") 2>&1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_DATASETS_CACHE=$WORK/hf_datasets

stamp() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }

# 0. What is there -----------------------------------------------------------------------------------------
stamp "preflight"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
preflight_failed() {
    if [[ "$CARRIED" == 1 ]]; then echo "preflight failed: the carried wheels ($WHEELS) do not import with $PYTHON"
    else echo "preflight failed: $PYTHON lacks the kit's requirements (README, NVIDIA: the .venv install; or PYTHON=...)"; fi
}
"$PYTHON" - <<'EOF' || { preflight_failed; exit 1; }
import importlib.metadata as md, sys, torch, torchvision, transformers, datasets, accelerate, tokenizers
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torchvision", torchvision.__version__,
      "| transformers", transformers.__version__, "| datasets", datasets.__version__,
      "| accelerate", accelerate.__version__, "| tokenizers", tokenizers.__version__,
      "| huggingface_hub", md.version("huggingface_hub"), "| pyarrow", md.version("pyarrow"), "| fsspec", md.version("fsspec"))
try:
    import simplejpeg
    print("simplejpeg", simplejpeg.__version__)
except ImportError as error:
    print("simplejpeg: not importable (fast pipelines fall back to torchvision):", error)
print("cuda:", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

# 0b. First contact: the self-check, then the CUDA script's one-line refusals (no GPU; a batch too big) -------
first_contact_started=$SECONDS
refusal() {  # refusal NAME COMMAND...: the command's error line and exit status into $OUT/refusal_NAME.txt
    local name=$1; shift
    stamp "refusal: $name"
    bounded 180 "$@" > "$WORK/logs/refusal_$name.log" 2>&1
    local rc=$?
    { grep -E "error: " "$WORK/logs/refusal_$name.log" | tail -n 3; echo "exit status $rc"; } | tee "$OUT/refusal_$name.txt"
}
if [[ $FIRST_CONTACT == 1 || $FIRST_CONTACT == only ]]; then
    stamp "nvidia_check"
    bounded 420 "$PYTHON" -m bridgetower_bench.tools.nvidia_check --output_dir "$WORK/nvidia_check" \
        --json "$OUT/nvidia_check.json" --max_steps 3 --timeout 150 > "$WORK/logs/nvidia_check.log" 2>&1
    check_rc=$?
    grep -v Warning "$WORK/logs/nvidia_check.log"  # (read after it ends: its lines before the verdict below)
    echo "exit status $check_rc" | tee "$OUT/nvidia_check_exit.txt"
    if [[ $check_rc != 0 && ! ($SMOKE == 1 && $check_rc == 2) ]]; then
        stamp "the self-check did not pass (exit status $check_rc): nothing else runs"; exit "$check_rc"
    fi
    # The refusals train on the self-check's fixtures (or, when it stopped early, build the tiny ones).
    CHECK_FIXTURES=$WORK/nvidia_check/fixtures
    bounded 600 "$PYTHON" -m bridgetower_bench.tools.fixtures --out "$CHECK_FIXTURES" > "$WORK/logs/fixtures_check.log" 2>&1
    ONE_STEP=(--dataset_name "$CHECK_FIXTURES/newyorker-matching-synthetic" --dataset_config_name matching
              --image_column image --caption_column image_description --do_train --max_steps 1 --save_strategy no
              --report_to none --remove_unused_columns False --overwrite_output_dir --bf16)
    CUDA_VISIBLE_DEVICES= refusal no_gpu "$PYTHON" run_bridgetower_cuda.py --model_name_or_path "$CHECK_FIXTURES/tiny-bridgetower" \
        "${ONE_STEP[@]}" --per_device_train_batch_size 4 --output_dir "$WORK/refusal_no_gpu"
    if [[ $SMOKE == 1 ]]; then
        stamp "refusals of a batch too big: skipped (smoke mode: no GPU)"
    elif [[ -d $CHECK_FIXTURES/bridgetower-large-random ]]; then
        refusal batch_estimate "$PYTHON" run_bridgetower_cuda.py --model_name_or_path "$CHECK_FIXTURES/bridgetower-large-random" \
            "${ONE_STEP[@]}" --per_device_train_batch_size "$TOO_BIG_BATCH" --max_train_samples "$TOO_BIG_BATCH" \
            --output_dir "$WORK/refusal_batch"
        refusal batch_oom "$PYTHON" run_bridgetower_cuda.py --model_name_or_path "$CHECK_FIXTURES/bridgetower-large-random" \
            "${ONE_STEP[@]}" --attn_implementation sdpa --per_device_train_batch_size "$OOM_BATCH" \
            --max_train_samples "$OOM_BATCH" --output_dir "$WORK/refusal_batch"
    else
        stamp "refusals of a batch too big: skipped (the self-check built no Large model)"
    fi
    if [[ $SMOKE != 1 && -f $CHECK_FIXTURES/bridgetower-large-random/config.json && ! -e $WORK/fixtures/$MODEL_DIR ]]; then
        mkdir -p "$WORK/fixtures" && ln -s "$CHECK_FIXTURES/bridgetower-large-random" "$WORK/fixtures/$MODEL_DIR"  # built once
    fi
    DEADLINE_S=$(( DEADLINE_S + SECONDS - first_contact_started ))
    stamp "first contact took $(( SECONDS - first_contact_started ))s; no run starts after ${DEADLINE_S}s"
    if [[ $FIRST_CONTACT == only ]]; then stamp "done (FIRST_CONTACT=only)"; exit 0; fi
fi

# 1. Fixtures: the random-weight model and the synthetic data set, built side by side, while the GPU tests
#    run (nvJPEG against the host fast pipeline; the trainer's decode look-ahead; sdpa against eager) -------
stamp "fixtures: model ${MODEL_FLAGS[*]:-(tiny)}, data set with $TRAIN_ROWS train rows; GPU tests"
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/test_device_decode.py tests/test_attention.py -k cuda \
    > "$WORK/logs/pytest_cuda.log" 2>&1 &
pytest_pid=$!
timeout --kill-after=10 600 "$PYTHON" -m bridgetower_bench.tools.fixtures model "${MODEL_FLAGS[@]}" --out "$WORK/fixtures" \
    > "$WORK/logs/fixtures_model.log" 2>&1 &
model_pid=$!
bounded 600 "$PYTHON" -m bridgetower_bench.tools.fixtures dataset --out "$WORK/fixtures" --train-rows "$TRAIN_ROWS" \
    --validation-rows 16 --test-rows 16 > "$WORK/logs/fixtures_dataset.log" 2>&1
dataset_rc=$?
wait "$model_pid"
model_rc=$?
cat "$WORK/logs/fixtures_model.log" "$WORK/logs/fixtures_dataset.log" | grep -E "^(model|dataset|  images):" || true
wait "$pytest_pid" || true
stamp "GPU tests:"; grep -E "passed|failed|error|skipped|^FAILED|^E " "$WORK/logs/pytest_cuda.log" | tail -n 20
if [[ $model_rc != 0 || $dataset_rc != 0 ]]; then
    tail -n 30 "$WORK/logs/fixtures_model.log" "$WORK/logs/fixtures_dataset.log"
    echo "fixtures failed"; exit 1
fi
MODEL=$WORK/fixtures/$MODEL_DIR
DATA=$WORK/fixtures/newyorker-matching-synthetic

# Output directories get the model saved at the end of each run (3.5 GB): keep them in memory when it fits.
RUNS=$WORK/runs
if [[ $(df --output=avail -k /dev/shm 2>/dev/null | tail -n 1) -gt 12000000 ]] 2>/dev/null; then RUNS=/dev/shm/h200_runs; fi
mkdir -p "$RUNS"

# 2. Does nvJPEG + the device resize give the host fast pipeline's pixels, and how fast? ------------------
if [[ $CHECK == 1 ]]; then
    stamp "device decode check"
    photo=$("$PYTHON" -c "import matplotlib, os; p = os.path.join(matplotlib.get_data_path(), 'sample_data', 'grace_hopper.jpg'); print(p if os.path.exists(p) else '')" 2>/dev/null)
    bounded 90 "$PYTHON" lab/device_decode_check.py "$DATA"/matching/train-*.parquet $photo --limit 193 \
        --batch-size "$BATCH" --json "$OUT/device_decode_check.json" > >(grep --line-buffered -v Warning) 2>&1 \
        || echo "device decode check failed"
fi

# 3. The runs --------------------------------------------------------------------------------------------
COMMON=(--model_name_or_path "$MODEL" --dataset_name "$DATA" --dataset_config_name matching
        --image_column image --caption_column image_description --do_train "${DEVICE_FLAGS[@]}"
        --per_device_train_batch_size "$BATCH" --max_steps "$STEPS" --throughput_warmup_steps "$WARMUP"
        --logging_steps 10 --remove_unused_columns False --save_strategy no --report_to none
        --overwrite_output_dir --seed 42)
: > "$WORK/status.txt"

run() {  # run NAME SETUP LIMIT COMMAND...: one timed run; its train metrics land in $WORK/results/NAME.json
    local name=$1 setup=$2 max_limit=$3; shift 3
    local left=$(( DEADLINE_S - SECONDS ))
    if (( left <= 0 || left + 30 < MIN_RUN_S )); then
        stamp "$name: skipped (out of time)"; echo "$name skipped 0 $setup" >> "$WORK/status.txt"; return
    fi
    local limit=$(( max_limit < left + 30 ? max_limit : left + 30 ))
    local flags
    mapfile -t flags < <(setup_flags "$setup")
    stamp "$name ($setup): start (limit ${limit}s)"
    local started=$SECONDS
    bounded "$limit" "$@" "${flags[@]}" --output_dir "$RUNS/$name" > "$WORK/logs/$name.log" 2>&1
    local rc=$?
    if [[ $rc == 0 && -f "$RUNS/$name/train_results.json" ]]; then
        cp "$RUNS/$name/train_results.json" "$WORK/results/$name.json"
        echo "$name ok $(( SECONDS - started )) $setup" >> "$WORK/status.txt"
        stamp "$name: done in $(( SECONDS - started ))s: $("$PYTHON" -c "import json,sys; m=json.load(open(sys.argv[1])); print(f\"{m['train_samples_per_second']:.1f} samples/s, data wait {m['data_wait_fraction']:.2f}\")" "$WORK/results/$name.json")"
    else
        echo "$name failed(rc=$rc) $(( SECONDS - started )) $setup" >> "$WORK/status.txt"
        stamp "$name: FAILED (rc=$rc) after $(( SECONDS - started ))s"; tail -n 5 "$WORK/logs/$name.log"
    fi
    if [[ -f "$RUNS/$name/profile.txt" ]]; then cp "$RUNS/$name/profile.txt" "$OUT/$name.txt"; fi
    rm -rf "${RUNS:?}/$name"
}

ceiling() {  # ceiling SETUP REPEAT: the data-free ceiling of one training set-up
    run "ceiling_$1_r$2" "$1" "$RUN_TIMEOUT_S" "$PYTHON" lab/gpu_ceiling.py --model_name_or_path "$MODEL" \
        "${DEVICE_FLAGS[@]}" --per_device_train_batch_size "$BATCH" --max_steps "$STEPS" \
        --throughput_warmup_steps "$WARMUP" --logging_steps 10 --save_strategy no --report_to none --seed 42
}
matrix_run() {  # matrix_run WORKERS PIPELINE: REPEATS loader runs with the best set-up
    local extra=(--image_pipeline "$2") repeat
    [[ $2 == device ]] && extra=(--image_pipeline fast --device_decode)
    for repeat in $(seq "$REPEATS"); do
        run "w${1}_$2_r$repeat" "$BEST" "$RUN_TIMEOUT_S" "$PYTHON" run_bridgetower_cuda.py "${COMMON[@]}" \
            --dataloader_num_workers "$1" "${extra[@]}"
    done
}
median_ceiling() {  # median_ceiling SETUP: the median samples/s of its ceiling runs, or 0 when any peaked above MAX_GPU_GB
    "$PYTHON" - "$WORK/results" "$1" "$MAX_GPU_GB" <<'PY'
import glob, json, statistics, sys
results, setup, max_gb = sys.argv[1], sys.argv[2], float(sys.argv[3])
runs = [json.load(open(path)) for path in sorted(glob.glob(f"{results}/ceiling_{setup}_r*.json"))]
if not runs or any((m.get("peak_gpu_memory_gb") or 0) > max_gb for m in runs):
    print(0)
else:
    print(statistics.median(m["train_samples_per_second"] for m in runs))
PY
}

# 3a. The data-free ceiling of every set-up, REPEATS times; the fastest median within MAX_GPU_GB trains the
#     loader matrix.
BEST=eager BEST_SPS=0
for setup in $SETUPS; do
    for repeat in $(seq "$REPEATS"); do ceiling "$setup" "$repeat"; done
    sps=$(median_ceiling "$setup")
    if "$PYTHON" -c "import sys; sys.exit(0 if float(sys.argv[1]) > float(sys.argv[2]) else 1)" "$sps" "$BEST_SPS"; then
        BEST=$setup BEST_SPS=$sps
    fi
done
stamp "loader matrix with the '$BEST' set-up (ceiling $BEST_SPS samples/s)"

# 3b. The loader matrix: device decoding at the first worker count (the targets), the step profile (where
#     the step's time goes: a separate run, as profiling slows the steps), then the rest.
set -- $WORKERS
matrix_run "$1" device
if [[ $PROFILE == 1 ]]; then
    run ceiling_profile "$BEST" "$RUN_TIMEOUT_S" "$PYTHON" lab/gpu_ceiling.py --model_name_or_path "$MODEL" \
        "${DEVICE_FLAGS[@]}" --per_device_train_batch_size "$BATCH" --max_steps 8 --throughput_warmup_steps 5 \
        --profile_steps 3 --logging_steps 10 --save_strategy no --report_to none --seed 42
fi
for workers in "${@:2}"; do matrix_run "$workers" device; done
for workers in $WORKERS; do
    matrix_run "$workers" fast
    matrix_run "$workers" upstream
done

# 4. The table -------------------------------------------------------------------------------------------
stamp "table"
for log in "$WORK"/logs/*.log; do echo "===== $(basename "$log")"; tail -n 40 "$log"; done > "$OUT/h200_logs.txt"
"$PYTHON" - "$WORK" "$OUT" "$SETUP" "$BATCH" "$STEPS" "$WARMUP" "$REPEATS" "$MAX_GPU_GB" <<'EOF'
import json, os, re, statistics, sys
from bridgetower_bench import published
work, out, setup, batch, steps, warmup, repeats, max_gb = *sys.argv[1:4], *map(int, sys.argv[4:8]), float(sys.argv[8])
TFLOP_PER_SAMPLE, PEAK_TFLOPS = 1.4, 790.0  # docs/PUBLISHED.md, cost model: training cost per sample, measured bf16 peak
PUBLISHED_PER_H100 = published.THROUGHPUT["H100 GPU"]["workers=2"] / published.DEVICES  # per GPU
status, setups = {}, {}
for line in open(os.path.join(work, "status.txt")):
    name, state, _seconds, run_setup = line.split()
    status[name], setups[name] = state, run_setup
results = {}
for name in status:
    path = os.path.join(work, "results", name + ".json")
    results[name] = json.load(open(path)) if os.path.exists(path) else {}
configurations = {}  # a configuration (the run's name less its repeat) -> its runs, in order
for name in status:
    configurations.setdefault(re.sub(r"_r\d+$", "", name), []).append(name)
def median_of(runs, key):
    values = [results[n][key] for n in runs if isinstance(results[n].get(key), (int, float))]
    return statistics.median(values) if values else None
ceilings = {setups[runs[0]]: median_of(runs, "train_samples_per_second")
            for config, runs in configurations.items() if config.startswith("ceiling_") and config != "ceiling_profile"}
header = ("| configuration | training | workers | runs ok | samples/s (median) | min-max | MFU | % of ceiling | x per-H100 "
          "| data wait | peak GPU GB | device/host decoded |")
rows = [header, "|---" * (header.count("|") - 1) + "|"]
order = [f"ceiling_{s}" for s in ceilings] + [f"w{w}_{p}" for w in (0, 1, 2) for p in ("upstream", "fast", "device")]
cell = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"
for config in order:
    runs = configurations.get(config)
    if not runs:
        continue
    ok = [n for n in runs if status[n] == "ok"]
    speeds = [results[n]["train_samples_per_second"] for n in ok if "train_samples_per_second" in results[n]]
    sps = statistics.median(speeds) if speeds else None
    ceiling = ceilings.get(setups[runs[0]])
    peaks = [results[n]["peak_gpu_memory_gb"] for n in ok if isinstance(results[n].get("peak_gpu_memory_gb"), (int, float))]
    last = results[ok[-1]] if ok else {}
    decoded = (f"{last['device_decode_images']}/{last['device_decode_fallback_images']}" if "device_decode_images" in last else "-")
    rows.append("| " + " | ".join([
        config, setups[runs[0]], "-" if config.startswith("ceiling") else config[1], f"{len(ok)}/{len(runs)}", cell(sps, ".1f"),
        f"{min(speeds):.1f}-{max(speeds):.1f}" if speeds else "-",
        cell(sps * TFLOP_PER_SAMPLE / PEAK_TFLOPS if sps else None, ".1%"),
        cell(sps / ceiling if sps and ceiling else None, ".0%"),
        cell(sps / PUBLISHED_PER_H100 if sps else None, ".2f"),
        cell(median_of(ok, "data_wait_fraction"), ".3f"),
        cell(max(peaks) if peaks else None, ".1f") + (f" (over {max_gb:g})" if peaks and max(peaks) > max_gb else ""),
        decoded]) + " |")
check_path = os.path.join(out, "device_decode_check.json")
check = json.load(open(check_path)) if os.path.exists(check_path) else None
device = next((m.get("device_name") for m in results.values() if m.get("device_name")), "?")
lines = [f"{setup}, one {device}, {batch} per device, {steps} steps of which the first {warmup} are not counted; "
         f"each configuration {repeats} time(s), samples/s the median of its runs; "
         f"MFU = samples/s x {TFLOP_PER_SAMPLE} TFLOP / {PEAK_TFLOPS:.0f} TFLOP/s; "
         f"% of ceiling: against the median data-free ceiling of the row's training set-up; x per-H100: against 602.1 / 8 samples/s "
         f"(one GPU on synthetic data against the post's per-device share of an 8-GPU H100 node); "
         f"the matrix ran the fastest set-up whose ceiling stayed within {max_gb:g} GB.",
         "", *rows, ""]
if check:
    lines.append(f"device decode check ({check['images']} images): mean |diff| vs host fast {check['mean_abs_diff_pixels_255']}/255 "
                 f"(max {check['max_abs_diff_pixels_255']}), {check['device_decode_images_per_s']} images/s on the device "
                 f"vs {check['host_fast_images_per_s_one_core']} images/s on one host core")
table = "\n".join(lines)
print(table)
open(os.path.join(out, "h200_table.md"), "w").write(table + "\n")
json.dump({"status": status, "setups": setups, "results": results, "device_decode_check": check,
           "config": {"setup": setup, "batch": batch, "steps": steps, "warmup": warmup, "repeats": repeats,
                      "max_gpu_gb": max_gb}}, open(os.path.join(out, "h200_results.json"), "w"), indent=1)
EOF
stamp "done"
