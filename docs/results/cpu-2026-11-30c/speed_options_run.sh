# The CPU A/B of the training-speed options (README, "This 2-core CPU machine"), from the repo root:
#     bash docs/results/cpu-2026-11-30c/speed_options_run.sh
# The data-free ceiling for eager / sdpa / sdpa + --compile_layers inductor, two rounds, on a tiny
# model with 14-px patches (442 image tokens: the attention-heavy shape) and two layers per stack.
set -e
W=${W:-speed_options_out}
.venv/bin/python -m bridgetower_bench.tools.fixtures model --layers 2 --patch-size 14 --out "$W/model" > /dev/null
for round in 1 2; do
  for setup in eager sdpa sdpa-compiled; do
    flags=()
    [[ $setup == sdpa ]] && flags=(--attn_implementation sdpa)
    [[ $setup == sdpa-compiled ]] && flags=(--attn_implementation sdpa --compile_layers inductor)
    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python lab/gpu_ceiling.py \
      --model_name_or_path "$W/model/tiny-bridgetower" --output_dir "$W/out_$setup" --use_cpu \
      --per_device_train_batch_size 8 --max_steps 30 --throughput_warmup_steps 10 \
      --report_to none --save_strategy no --seed 42 "${flags[@]}" > "$W/log_${setup}_$round.txt" 2>&1
    echo "$round $setup $(.venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1]))['train_samples_per_second'])" "$W/out_$setup/train_results.json")"
  done
done
