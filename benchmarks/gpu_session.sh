#!/usr/bin/env bash
# A GPU session's work on the folded kernels, one device call per step: checked natively, then
# timed (folded Mosaic GPU beside folded Triton), then profiled. Each step ends well inside the
# device tool's 10-minute limit per call. First run on an H100 on 2026-11-24 (KERNEL_NOTES v18);
# rerun it after a change to the kernels (v19 changed both folded kernels, v20 the softmax of
# every GPU kernel, on CPU only).
#
#   bash benchmarks/gpu_session.sh check    # Mosaic GPU native tests + generate check (~5 min)
#   bash benchmarks/gpu_session.sh check_triton  # Triton and bf16 kernels' native tests
#   bash benchmarks/gpu_session.sh sweep    # 32k sweep + the 32k table             (~4 min)
#   bash benchmarks/gpu_session.sh ncu '{"lowering": "mosaic_gpu", "variant": "folded"}'
#   bash benchmarks/gpu_session.sh ncu '{"variant": "folded"}'  # folded Triton
#   bash benchmarks/gpu_session.sh gear     # GEAR's XLA parts, v21's reductions vs einsums
#   bash benchmarks/gpu_session.sh rows     # padded query rows vs v22's stack copies (~3 min)
#   bash benchmarks/gpu_session.sh brief    # one call of <= 9 min: the 32k sweep and table, every
#                                           # GPU kernel's native tests, the generate check, stack
#                                           # copies at 1 and 4 heads, ncu of the default kernel
#   bash benchmarks/gpu_session.sh recheck  # v29's second call (~6 min): see the step's comment
#   bash benchmarks/gpu_session.sh defaults # v29's third call (~3 min): folded Mosaic vs Triton
#   bash benchmarks/gpu_session.sh probe    # v30's first call (~5 min): register key operand,
#                                           # ncu of folded Mosaic, teacher-forced logit margins
#   bash benchmarks/gpu_session.sh word     # v30's second call (~5 min): the word operand order
#   bash benchmarks/gpu_session.sh tune     # v30's third call (~4 min): word order settings
#   bash benchmarks/gpu_session.sh final ['<folded Mosaic settings JSON>']  # v30's fourth call
#                                           # (~4 min): 32k table, generate check
#   bash benchmarks/gpu_session.sh issuer   # v31-v33, not yet run (~6-8 min): copies from the
#                                           # first warp, the carried value accumulator, value
#                                           # statistics unpaired, the bound row max, fewer splits;
#                                           # then `final` with the winner in its Mosaic row
#   bash benchmarks/gpu_session.sh shapes '<folded Mosaic config JSON>'  # the winner against
#                                           # the v30 default at the other shapes (~4 min)
#   bash benchmarks/gpu_session.sh v34      # v34's third call (~5 min): the new default through
#                                           # generate, each kernel of one call timed, settings
#                                           # around it at 32k, ncu of it
#   bash benchmarks/gpu_session.sh v35      # not yet run (~8 min): q . k_min by the kernel
#                                           # itself (key_bias_source), XLA's products before the
#                                           # kernel as reductions (key_products), the value codes
#                                           # from registers (value_operand), with and without
#                                           # the bound row max, the splits merged by one
#                                           # Triton kernel (split_merge, v36), each lane's
#                                           # own value statistics (value_stat_loads, v36),
#                                           # copies from every warp (copy_issuer="spread",
#                                           # v36), ring slots of two blocks
#                                           # (blocks_per_copy, v37), each channel's own
#                                           # value slot written (partial_slots, v38): native
#                                           # tests and the 32k sweep
#   bash benchmarks/gpu_session.sh v40      # not yet run (~8 min): v39's checks natively, then
#                                           # v40's one barrier per block (key_stack_timing)
#                                           # and refills in the value product's shadow
#                                           # (copy_issue_point) timed beside C + merge at 32k,
#                                           # the fastest at the other shapes
#   bash benchmarks/gpu_session.sh v42      # not yet run (~8 min): v40's checks, its likeliest
#                                           # configs, and five warpgroups a program
#                                           # (warpgroups_per_program, v42) at 32k
#   bash benchmarks/gpu_session.sh v43      # not yet run (~9 min), replaces v42: v42's checks
#                                           # and configs, and the value codes by transposing
#                                           # matrix loads (value_operand="matrix_loads", v43)
#                                           # with C + merge, two blocks per slot, v40's
#                                           # settings and five warpgroups a program
#   bash benchmarks/gpu_session.sh warp_products  # not yet run (~2-3 min; first, then v43 on
#                                           # the warm machine): v44's per-warp products loop
#                                           # as CUDA and as Mosaic GPU, checked and timed
#   bash benchmarks/gpu_session.sh v59      # run 2026-12-04 (361 s): the 32k sweep of the warp
#                                           # variant beside the folded settings, the 32k table
#                                           # with the fastest, its native tests, generate check
#   bash benchmarks/gpu_session.sh v59b     # run 2026-12-04 (308 s): v59's fastest at other shapes
#                                           # and through generate (its 8k-128k table timed out)
#   bash benchmarks/gpu_session.sh v60      # not yet run (~8 min): every attention call of the
#                                           # warp kernel at head_dim 64, 2 bits against the
#                                           # reference (v59's divergence), its teacher-forced
#                                           # logits, the 8k and 128k tables with the Hopper default
#   bash benchmarks/gpu_session.sh v61      # not yet run (~6 min; before v60): the 32k sweep
#                                           # around warp V59 at four programs an SM (v60's
#                                           # shared bytes), the 32k table with the fastest, the
#                                           # warp kernel's native tests
#   bash benchmarks/gpu_session.sh v40_profile ['<config JSON>']  # right after v40, v42 or v43 (~4 min):
#                                           # the 32k table, each kernel of a call and ncu of
#                                           # the fastest (or of the config given)
#   bash benchmarks/gpu_session.sh v35_profile  # right after v35 (~4 min): KIVI-4, each
#                                           # kernel of a call under ncu, ncu of the candidate;
#                                           # then `final` with the winner and `shapes`
#
# Folded Triton is named as {"variant": "folded"}: since KERNEL_NOTES v29 an empty config is the
# measured default, which on Hopper is folded Mosaic GPU for most shapes (in v29's own calls, {}
# still meant folded Triton).
#
# Run from the repository root, on the device image's python3 (jax 0.11.2 with CUDA; nothing
# to install: the kernels and checks import no package the image lacks). Logs and JSON go to
# $OUT (the device tool's folder that comes back) or, without it, to ./gpu_session_out.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out="${OUT:-gpu_session_out}"
mkdir -p "$out"
python="${PYTHON:-python3}"

# Folded Triton's default, and without prefetch and with 3 stages (v19 changed its registers:
# 219 -> 226). The folded Mosaic rows: block 128 with 2 stages, where three programs now fit per
# SM, with the planner's 32 splits (5.2 waves) and with 37 (whole waves: 2368 programs, 6 x 396);
# 3 stages (two per SM); block 64 with 4 stages (four per SM) and 3 stages.
folded='{"lowering": "mosaic_gpu", "variant": "folded"'
sweep_configs="[{\"variant\": \"folded\"}, {\"prefetch\": false}, {\"num_stages\": 3}, \
${folded}}, ${folded}, \"num_splits\": 37}, ${folded}, \"num_stages\": 3}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 4}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 3}]"
# The Hopper default's folded Mosaic settings since v30 (FOLDED_MOSAIC_GPU_V30), and that config
# open for more keys.
v30_settings='"block_tokens": 64, "num_stages": 4, "key_operand": "registers", "operand_order": "word"'
v30="${folded}, ${v30_settings}"
# The Hopper default's since v34 (FOLDED_MOSAIC_GPU_V34).
v34_settings="${v30_settings}, \"copy_issuer\": \"first_warp\", \"value_accumulator\": \"carried\", \"value_stats\": \"separate\""
v34="${folded}, ${v34_settings}"
# v35's candidate "C" with the merge kernel (v39 on): the kernel's bias and bounds, register value
# codes, each lane's own value statistics, the splits merged by one Triton kernel.
c_merge="${v34}, \"row_max\": \"bound\", \"key_bias_source\": \"kernel\", \
\"value_operand\": \"registers\", \"value_stat_loads\": \"own_slot\", \"split_merge\": \"triton\""
# The warp variant (v45-v47), and the Hopper default's settings since v59 (WARP_MOSAIC_GPU_V59).
warp='{"lowering": "mosaic_gpu", "variant": "warp"'
warp_v59="${warp}, \"key_bias_source\": \"kernel\", \"num_stages\": 2, \"split_merge\": \"triton\"}"
# Folded Triton with padded query rows, with stack copies, and with copies but no prefetch.
stack_copies_configs='[{"variant": "folded"}, {"stack_copies": true}, {"stack_copies": true, "prefetch": false}]'

# v30's steps share these: the folded Mosaic test file natively (its log to $1), Nsight Compute
# on one folded Mosaic config (the report in /tmp: at most 8 files come back from $OUT), and a
# sweep per shape of the configs given ("context heads bits" lines; 1 head adds stack copies).
native_folded_tests() {  # every case, slow ones included: natively they compile in seconds
  timeout --signal=INT "${NATIVE_TESTS_SECONDS:-100}" env KVJAX_NATIVE_KERNELS=1 KVJAX_TESTS_FAST_COMPILE=0 \
    "$python" -m pytest -q -n 8 -p no:cacheprovider -m "slow or not slow" \
    tests/pallas_kernels/test_quantized_decode_attention_folded_mosaic_gpu.py \
    tests/pallas_kernels/test_key_bias_in_kernel.py 2>&1 | tee "$1"
}
ncu_folded_mosaic() {
  local report=/tmp/mosaic_kernel
  timeout --signal=INT 60 ncu --target-processes all --kernel-name regex:mosaic \
    --launch-skip 1 --launch-count 1 --set full --import-source no -o "$report" -f \
    "$python" benchmarks/profile_quantized_kernel.py --bits 2 --kernel-config "$1" \
    > /tmp/ncu.log 2>&1
  local profiled=$?
  tail -3 /tmp/ncu.log
  ncu --import "$report.ncu-rep" --page details > "$out/ncu_details.txt" 2>&1
  ncu --import "$report.ncu-rep" --page source --csv --print-source sass > /tmp/ncu_sass.csv
  "$python" benchmarks/ncu_sass_summary.py /tmp/ncu_sass.csv > "$out/ncu_sass_summary.txt" 2>&1
  return "$profiled"
}
call_kernels() {  # call_kernels CONFIG...: each kernel of two jitted calls timed under ncu
  local config status=0
  for config in "$@"; do
    echo "call kernels of $config" >> "$out/call_kernels.txt"
    timeout --signal=INT 45 ncu --target-processes all --metrics gpu__time_duration.sum \
      "$python" benchmarks/profile_quantized_kernel.py --bits 2 --calls 2 --kernel-config "$config" \
      2>&1 | grep -E "Context [0-9]|gpu__time_duration" | tail -32 >> "$out/call_kernels.txt" ||
      status=1
  done
  cat "$out/call_kernels.txt"
  return "$status"
}
device_and_native_tests() {  # device_and_native_tests LOG: the GPU to LOG, native test summary
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$1"
  native_folded_tests "$out/native_tests.log" | tail -3
}
native_tests_and_generate_check() {  # LOG CONFIG: the native tests (NATIVE_TESTS_SECONDS,
  # default 120 s), then the generate check (100 s) with CONFIG in its KIVI runs
  local status=0
  NATIVE_TESTS_SECONDS="${NATIVE_TESTS_SECONDS:-120}" device_and_native_tests "$1" || status=1
  timeout --signal=INT 100 "$python" benchmarks/generate_kernels_check.py \
    --kivi-settings "$2" 2>&1 | tee "$out/generate_kernels_check.log" | tail -12 || status=1
  return "$status"
}
table_32k() {  # table_32k SECONDS CONFIG: the issue's 32k table with CONFIG in the folded Mosaic
  # rows (the copy rate and XLA's bf16 attention of the same run), JSON and log to $out
  timeout --signal=INT "$1" "$python" benchmarks/decode_attention.py --contexts 32768 --no-gear \
    --kernel-config '{"variant": "folded"}' --folded-mosaic-kernel-config "$2" \
    --out "$out/decode_attention_32k.json" 2>&1 | tee "$out/decode_attention_32k.log"
}
native_tests() {  # native_tests SECONDS FILE...: the files' tests compiled, slow ones included
  local workers=()
  "$python" -c "import xdist" 2>/dev/null && workers=(-n 8)
  timeout --signal=INT "$1" env KVJAX_NATIVE_KERNELS=1 KVJAX_TESTS_FAST_COMPILE=0 \
    "$python" -m pytest -q "${workers[@]}" -p no:cacheprovider -m "slow or not slow" "${@:2}"
}
sweep_at_32k() {  # sweep_at_32k LOG CONFIGS_JSON [SECONDS]: the configs timed at 32k (JSON to $out)
  timeout --signal=INT "${3:-210}" "$python" benchmarks/decode_attention.py --contexts 32768 --sweep \
    --sweep-only --sweep-configs "$2" --out "$out/sweep_32k.json" 2>&1 | tee -a "$1"
}
warp_products_run() {  # warp_products_run LOG: v44's per-warp products experiment checked against
  # its numpy model and timed at the 32k shape (and 8k, 128k), from the committed cubins (no nvcc
  # needed here); then the same loop as a Mosaic GPU kernel, checked and timed at 32k
  echo "== warp products experiment (KERNEL_NOTES v44)" >> "$1"
  local status=0
  timeout --signal=INT 90 "$python" benchmarks/warp_products_experiment.py \
    --run benchmarks/warp_products_cubins --out "$out/warp_products_h200.json" >> "$1" 2>&1 \
    || status=1
  echo "== warp products, Mosaic GPU (KERNEL_NOTES v44)" >> "$1"
  timeout --signal=INT 150 "$python" benchmarks/warp_products_mosaic_experiment.py \
    --run --out "$out/warp_products_mosaic_h200.json" >> "$1" 2>&1 || status=1
  # v45: the library's "warp" variant, natively against the reference (its test file), then
  # timed at 32k (4 and 2 stages, the kernel's own bias and references, XLA's products as
  # reductions, the Triton merge; v46: each slot's copies by its own warp, with and without the
  # per-warp ring release, and v45's queries loaded once, 13 more registers) beside v34 and
  # C + merge
  echo "== warp variant, native tests (KERNEL_NOTES v45)" >> "$1"
  timeout --signal=INT 150 env KVJAX_NATIVE_KERNELS=1 "$python" -m pytest -q -n 4 \
    -p no:cacheprovider -m "slow or not slow" \
    tests/pallas_kernels/test_quantized_decode_attention_warp_mosaic_gpu.py \
    2>&1 | tail -15 >> "$1" || status=1
  sweep_at_32k "$1" "[${warp}}, ${warp}, \"num_stages\": 2}, \
${warp}, \"key_bias_source\": \"kernel\", \"num_stages\": 2}, ${warp}, \"key_products\": \"reduction\"}, \
${warp}, \"split_merge\": \"triton\"}, \
${warp}, \"key_bias_source\": \"kernel\", \"num_stages\": 2, \"split_merge\": \"triton\"}, \
${warp}, \"copy_issuer\": \"slot_owner\"}, \
${warp}, \"copy_issuer\": \"slot_owner\", \"ring_release\": \"per_warp\"}, \
${warp}, \"query_loads\": \"once\"}, \
${v34}}, ${c_merge}}]" 190 || status=1
  # KIVI-4 at 32k (two stages by default there) beside v34
  sweep_shapes_only "$1" "32768 4 4" -- "${warp}}" "${warp}, \"key_bias_source\": \"kernel\"}" \
    "${v34}}" || status=1
  # v46: 8 query heads per KV head (8 rows, two value MMAs an m-tile) beside v34
  sweep_shapes_only "$1" "32768 8 2" -- "${warp}}" "${v34}}" || status=1
  return "$status"
}
warp_head_dim64_run() {  # warp_head_dim64_run LOG (v47, ~3 min): the warp variant at head_dim 64
  # (its native tests run in warp_products_run): generate through it on the check's tiny model
  # (KIVI-2 and KIVI-4), then the 32k sweep at head_dim 64 (Llama 3.2 1B's shape: 4 query heads
  # per KV head), where no other Mosaic GPU kernel takes 2-bit codes (4 words a token), beside
  # the Triton kernels that run there now
  local status=0
  echo "== warp variant, generate check (KERNEL_NOTES v47)" >> "$1"
  timeout --signal=INT 90 "$python" benchmarks/generate_kernels_check.py --only warp \
    2>&1 | tail -4 >> "$1" || status=1
  sweep_shapes_only "$1" "32768 4 2 64" "32768 4 4 64" -- "${warp}}" "${warp}, \"num_stages\": 2}" \
    "{\"lowering\": \"triton\", \"variant\": \"folded\"}" "{\"lowering\": \"triton\"}" || status=1
  return "$status"
}
keep_fastest() {  # keep_fastest LOG: the 32k sweep's fastest config (of those not "wrong"), as
  # JSON to stdout, named in LOG and on stderr, and kept on the machine for v40_profile ($OUT
  # starts empty at every call)
  local best
  best="$("$python" -c "import json, sys; r = json.load(open(sys.argv[1]))['sweep_kivi2']; \
r = [t for t in r if not t.get('wrong')]; \
print(json.dumps(min(r, key=lambda t: t['seconds'])['config']))" "$out/sweep_32k.json")" &&
    echo "fastest at 32k: $best" | tee -a "$1" >&2 && echo "$best" > /tmp/kvjax_v40_fastest.json &&
    echo "$best"
}
sweep_shapes() {  # sweep_shapes LOG CONFIG...: the configs at 8k / 128k, 1 and 8 heads, KIVI-4
  local log="$1"
  shift
  sweep_shapes_only "$log" "8192 4 2" "131072 4 2" "32768 1 2" "32768 8 2" "32768 4 4" -- "$@"
}
sweep_shapes_only() {  # sweep_shapes_only LOG "CONTEXT HEADS BITS [HEAD_DIM]"... -- CONFIG...
  local log="$1" shape status=0 shapes=()
  shift
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shapes+=("$1"); shift; done
  shift
  local configs n_configs="$#"
  configs="[$(IFS=,; echo "$*")]"
  for shape in "${shapes[@]}"; do
    set -- $shape
    local these="$configs"
    [ "$2" = 1 ] && these="[{\"stack_copies\": true}, ${configs#[}"
    # 10 s to start, ~12 s per config (v34's calls)
    timeout --signal=INT $((10 + 12 * n_configs)) "$python" benchmarks/decode_attention.py \
      --sweep --sweep-only \
      --sweep-context "$1" --query-group "$2" --sweep-bits "$3" --head-dim "${4:-128}" \
      --sweep-configs "$these" \
      2>&1 | grep "sweep kivi" | sed "s/^/[$1 q$2 kivi$3 d${4:-128}] /" | tee -a "$log" \
      || status=1
  done
  return "$status"
}

case "${1:-}" in
  check)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
    # Native, not interpret: this is what checks v15's removal of the automatic store barriers.
    # Every case runs and the generate check runs after a failure too (device time is scarce);
    # the step still exits non-zero if the tests failed.
    tests_status=0
    KVJAX_NATIVE_KERNELS=1 "$python" -m pytest -q -p no:cacheprovider \
      tests/pallas_kernels/test_quantized_decode_attention_folded_mosaic_gpu.py \
      tests/pallas_kernels/test_quantized_decode_attention_mosaic_gpu.py 2>&1 |
      tee "$out/native_tests.log" || tests_status=$?
    "$python" benchmarks/generate_kernels_check.py 2>&1 | tee "$out/generate_kernels_check.log"
    exit "$tests_status"
    ;;
  check_triton)
    # The Triton kernels (every variant, GEAR's terms both ways) and both bf16 kernels, natively:
    # v20's base-2 softmax changed all of them.
    KVJAX_NATIVE_KERNELS=1 "$python" -m pytest -q -p no:cacheprovider \
      tests/pallas_kernels/test_quantized_kernels.py \
      tests/pallas_kernels/test_folded_scales_kernel_triton.py \
      tests/pallas_kernels/test_decode_attention_kernels.py \
      tests/pallas_kernels/test_decode_attention_mosaic_gpu.py 2>&1 |
      tee "$out/native_triton_tests.log"
    ;;
  sweep)
    "$python" benchmarks/decode_attention.py --contexts 32768 --sweep \
      --sweep-configs "$sweep_configs" --out "$out/decode_attention_sweep_32k.json" 2>&1 |
      tee "$out/decode_attention_sweep_32k.log"
    ;;
  gear)
    # GEAR-2 at 32k: the attention calls and each XLA part alone, v21's low-rank reductions
    # beside the einsums before them (benchmarks/xla_kernel_bytes.py: 222 -> 88 and 156 MB).
    "$python" benchmarks/gear_terms_parts.py --contexts 32768 \
      --out "$out/gear_terms_parts_32k.json" 2>&1 | tee "$out/gear_terms_parts_32k.log"
    ;;
  rows)
    # KIVI-2 at 32k where folded pads the query group (1 and 2 heads per KV head at group 32,
    # 4 at group 64, GEAR's codes): padding rows (the default) against v22's copies of the
    # stacked operands, and the copies without prefetch (165 registers at 1 head: 3 per SM).
    for shape in "1 32" "2 32" "4 64"; do
      set -- $shape
      "$python" benchmarks/decode_attention.py --contexts 32768 --sweep --sweep-only \
        --query-group "$1" --group-size "$2" \
        --sweep-configs "$stack_copies_configs" \
        --out "$out/stack_copies_q$1_g$2_32k.json" 2>&1 | tee "$out/stack_copies_q$1_g$2_32k.log"
    done
    ;;
  ncu)
    config="${2:?ncu needs a kernel config, e.g. '{\"lowering\": \"mosaic_gpu\", \"variant\": \"folded\"}'}"
    # Filtered to the Pallas kernel (an unfiltered profile of XLA's fusions failed in v13): a
    # Mosaic GPU kernel's name holds "mosaic"; a Triton one is named after its pallas_call.
    case "$config" in
      *mosaic_gpu*) kernel_name=regex:mosaic report="$out/mosaic_kernel" ;;
      *) kernel_name=regex:quantized_decode_attention report="$out/triton_kernel" ;;
    esac
    ncu --target-processes all --kernel-name "$kernel_name" --launch-skip 1 --launch-count 1 \
      --set full --import-source no -o "$report" -f \
      "$python" benchmarks/profile_quantized_kernel.py --bits 2 --kernel-config "$config" 2>&1 |
      tee "$out/ncu.log"
    ncu --import "$report.ncu-rep" --page details > "$out/ncu_details.txt"
    ncu --import "$report.ncu-rep" --page source --csv --print-source sass \
      > "$out/ncu_sass.csv"
    "$python" benchmarks/ncu_sass_summary.py "$out/ncu_sass.csv" | tee "$out/ncu_sass_summary.txt"
    ;;
  brief)
    # Everything above that a 15-minute device budget affords, in one call (v29: the first GPU
    # since v18). Each step has its own time limit, so a slow step cannot starve the next; the
    # timings run alone (the native tests, which use many processes, come after them). At most 8
    # files come back from $OUT, so logs are joined and the ncu report stays in /tmp.
    set +e
    status=0
    log="$out/decode_attention_32k.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv | tee "$log"
    timeout --signal=INT 230 "$python" benchmarks/decode_attention.py --contexts 32768 --sweep \
      --sweep-configs "[{\"variant\": \"folded\"}, {\"prefetch\": false}, {\"num_stages\": 3}, ${folded}}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 4}]" \
      --out "$out/decode_attention_32k.json" 2>&1 | tee -a "$log" || status=1
    timeout --signal=INT 130 env KVJAX_NATIVE_KERNELS=1 KVJAX_TESTS_FAST_COMPILE=0 "$python" -m pytest -q -n 8 \
      -p no:cacheprovider tests/pallas_kernels/test_quantized_kernels.py \
      tests/pallas_kernels/test_folded_scales_kernel_triton.py \
      tests/pallas_kernels/test_decode_attention_kernels.py \
      tests/pallas_kernels/test_decode_attention_mosaic_gpu.py \
      tests/pallas_kernels/test_quantized_decode_attention_folded_mosaic_gpu.py \
      tests/pallas_kernels/test_quantized_decode_attention_mosaic_gpu.py 2>&1 |
      tee "$out/native_tests.log" || status=1
    timeout --signal=INT 70 "$python" benchmarks/generate_kernels_check.py 2>&1 |
      tee "$out/generate_kernels_check.log" || status=1
    for shape in "1 32" "4 64"; do
      set -- $shape
      timeout --signal=INT 40 "$python" benchmarks/decode_attention.py --contexts 32768 --sweep \
        --sweep-only --query-group "$1" --group-size "$2" \
        --sweep-configs "$stack_copies_configs" \
        2>&1 | tee -a "$out/stack_copies_32k.log" || status=1
    done
    report=/tmp/triton_kernel
    timeout --signal=INT 50 ncu --target-processes all \
      --kernel-name regex:quantized_decode_attention --launch-skip 1 --launch-count 1 \
      --set full --import-source no -o "$report" -f \
      "$python" benchmarks/profile_quantized_kernel.py --bits 2 --kernel-config '{"variant": "folded"}' \
      > /tmp/ncu.log 2>&1 || status=1
    ncu --import "$report.ncu-rep" --page details > "$out/ncu_details.txt" 2>&1
    ncu --import "$report.ncu-rep" --page source --csv --print-source sass > /tmp/ncu_sass.csv
    "$python" benchmarks/ncu_sass_summary.py /tmp/ncu_sass.csv > "$out/ncu_sass_summary.txt" 2>&1
    exit "$status"
    ;;
  recheck)
    # v29's second call: the key-bias ring padded for TMA (block 64 faulted in `brief`), the
    # float32 tolerances of interpreted kernels on a GPU, the 32k table that the fault cut off,
    # stack copies at 2 heads, and the bf16-cache generate checks with their first differences.
    set +e
    status=0
    log="$out/decode_attention_32k.log"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
    timeout --signal=INT 100 env KVJAX_NATIVE_KERNELS=1 KVJAX_TESTS_FAST_COMPILE=0 \
      "$python" -m pytest -q -n 8 -p no:cacheprovider \
      tests/pallas_kernels/test_quantized_decode_attention_folded_mosaic_gpu.py \
      "tests/pallas_kernels/test_quantized_kernels.py::test_tpu_kernel_matches_reference" \
      tests/pallas_kernels/test_quantized_kernels.py::test_planar_steps_by_key_groups_whatever_block_tokens_says \
      tests/pallas_kernels/test_decode_attention_kernels.py::test_tpu_kernel_matches_reference \
      tests/pallas_kernels/test_decode_attention_kernels.py::test_a_nan_in_a_valid_slot_makes_its_row_nan_as_in_the_reference \
      2>&1 | tee "$out/native_tests.log" || status=1
    timeout --signal=INT 240 "$python" benchmarks/decode_attention.py --contexts 32768 --sweep \
      --sweep-configs "[{\"variant\": \"folded\"}, ${folded}}, ${folded}, \"block_tokens\": 64, \"num_stages\": 4}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 3}]" \
      --out "$out/decode_attention_32k.json" 2>&1 | tee -a "$log" || status=1
    timeout --signal=INT 40 "$python" benchmarks/decode_attention.py --contexts 32768 --sweep \
      --sweep-only --query-group 2 --group-size 32 \
      --sweep-configs "$stack_copies_configs" \
      2>&1 | tee "$out/stack_copies_q2_32k.log" || status=1
    timeout --signal=INT 60 "$python" benchmarks/generate_kernels_check.py --only bfloat16 2>&1 |
      tee "$out/generate_kernels_check.log" || status=1
    exit "$status"
    ;;
  defaults)
    # v29's third call: folded Mosaic GPU against folded Triton (the default) beyond 32k and 4
    # heads per KV head, and stack copies again at 1 head (v29's first call: 216.3 us against
    # 253.7), before either becomes a default. One sweep per process, 50 s each.
    set +e
    status=0
    for shape in "8192 4" "131072 4" "32768 1" "32768 8"; do
      set -- $shape
      configs="[{\"variant\": \"folded\"}, ${folded}}]"
      [ "$2" = 1 ] && configs="[{\"variant\": \"folded\"}, {\"stack_copies\": true}, ${folded}}]"
      timeout --signal=INT 50 "$python" benchmarks/decode_attention.py --sweep --sweep-only \
        --sweep-context "$1" --query-group "$2" --sweep-configs "$configs" \
        --out "$out/sweep_${1}_q$2.json" 2>&1 | tee -a "$out/defaults.log" || status=1
    done
    exit "$status"
    ;;
  probe)
    # v30's first call (~5 min): the key codes as wgmma's register operand, natively checked and
    # timed at 32k against the shared-memory operand (block 128 and block 64); Nsight Compute on
    # folded Mosaic GPU, the Hopper default since v29, which was never profiled on the H200; the
    # bf16-cache generate difference of v29 as teacher-forced logits (near tie or not).
    set +e
    status=0
    log="$out/probe.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$log"
    native_folded_tests "$out/native_tests.log" || status=1
    timeout --signal=INT 150 "$python" benchmarks/decode_attention.py --contexts 32768 --sweep \
      --sweep-only --sweep-configs "[${folded}}, ${folded}, \"key_operand\": \"registers\"}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 4}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 4, \"key_operand\": \"registers\"}, \
{\"variant\": \"folded\"}]" \
      --out "$out/sweep_32k.json" 2>&1 | tee -a "$log" || status=1
    for kernel in "folded Triton:{\"variant\": \"folded\"}" "folded Mosaic:${folded}}"; do
      timeout --signal=INT 60 "$python" benchmarks/generate_logit_margins.py \
        --kernel-config "${kernel#*:}" 2>&1 | tee -a "$out/logit_margins.log" || status=1
    done
    ncu_folded_mosaic "${folded}}" >> "$log" || status=1
    exit "$status"
    ;;
  word)
    # v30's second call (~5 min): each masked word one operand register ("operand_order":
    # "word", no byte permutes), natively checked, then timed beside the channel order at 32k
    # (block 128 and 64, key codes from registers or shared memory), and the best candidate
    # against the default at 8k / 128k, 1 and 8 heads per KV head and KIVI-4; the candidate
    # through generate (teacher-forced logits, bf16 cache); ncu of the candidate.
    set +e
    status=0
    log="$out/word.log"
    best="${v30}}"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$log"
    native_folded_tests "$out/native_tests.log" || status=1
    timeout --signal=INT 150 "$python" benchmarks/decode_attention.py --contexts 32768 --sweep \
      --sweep-only --sweep-configs "[${folded}}, ${folded}, \"operand_order\": \"word\"}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 4, \"key_operand\": \"registers\"}, ${best}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 4, \"operand_order\": \"word\"}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 3, \"key_operand\": \"registers\", \"operand_order\": \"word\"}, \
{\"variant\": \"folded\"}]" \
      --out "$out/sweep_32k.json" 2>&1 | tee -a "$log" || status=1
    sweep_shapes "$log" "${folded}}" "${best}" || status=1
    timeout --signal=INT 50 "$python" benchmarks/generate_logit_margins.py --kernel-config "${best}" \
      2>&1 | tee "$out/logit_margins.log" || status=1
    ncu_folded_mosaic "${best}" >> "$log" || status=1
    exit "$status"
    ;;
  tune)
    # v30's third call (~4 min): after the splits are merged before the value slots are picked
    # (the word order's un-permuting gather over the partials cost 9 us in the second call):
    # the word order at block 64 with shared or register key codes, with and without
    # approximate exp2 / reciprocal, against the default at 32k, then the two candidates against
    # the default at 8k / 128k, 1 and 8 heads per KV head and KIVI-4.
    set +e
    status=0
    log="$out/tune.log"
    word64="${folded}, \"block_tokens\": 64, \"num_stages\": 4, \"operand_order\": \"word\""
    shared="${word64}, \"approx_math\": true}"
    registers="${word64}, \"key_operand\": \"registers\", \"approx_math\": true}"
    device_and_native_tests "$log" || status=1
    sweep_at_32k "$log" "[${folded}}, ${word64}}, ${shared}, \
${word64}, \"key_operand\": \"registers\"}, ${registers}, \
${folded}, \"operand_order\": \"word\", \"approx_math\": true}]" || status=1
    sweep_shapes "$log" "${folded}}" "${shared}" "${registers}" || status=1
    exit "$status"
    ;;
  final)
    # v30's fourth call (~4 min): the 32k table with the Hopper default's folded Mosaic settings
    # in its row (v34's since v34; the kivi2 row named folded Triton), or the settings given as
    # the step's argument (a JSON dict of folded Mosaic settings, e.g. a sweep's winner), beside
    # XLA's bf16 attention and the copy rate of the same run; the generate check with the
    # default, or with the settings given in its KIVI runs (its time limit cut it after GEAR in
    # v34's second call: 150 s since).
    set +e
    status=0
    settings="${2:-{${v34_settings}\}}"
    table_32k 150 "$settings" || status=1
    candidate=()
    [ -n "${2:-}" ] && candidate=(--kivi-settings "{\"lowering\": \"mosaic_gpu\", \"variant\": \"folded\", ${2#\{}")
    timeout --signal=INT 150 "$python" benchmarks/generate_kernels_check.py "${candidate[@]}" 2>&1 |
      tee "$out/generate_kernels_check.log" || status=1
    exit "$status"
    ;;
  issuer)
    # v31's first call (~5 min): two settings the static count favours, neither yet run on a
    # GPU. "copy_issuer": "first_warp" (the first warp alone issues each block's copies, on one
    # barrier per ring slot) and "value_accumulator": "carried" (the value product adds into the
    # running accumulator): at the v30 default's settings 535 -> 398 mean instructions per 64
    # tokens, 128 -> 109 registers. Natively checked, then timed at 32k beside the v30 default:
    # each setting alone, both, both with 2 stages, with 8 and 16 splits (512 and 1024 programs
    # against the planner's 2048) and at block 128; both against the v30 default at 8k / 128k,
    # 1 and 8 heads and KIVI-4; ncu of both. With them (v32) "value_stats": "separate": the value
    # statistics reach the kernel as two group-major bf16 arrays, not packed into pairs by an
    # XLA pass at every call (67 MB of the timed loop's 291.6 MB per call at 32k by the compiled
    # HLO; 12-15 more instructions per 64 tokens in the kernel by the static count). And (v33)
    # "row_max": "bound": a fixed softmax reference per split from the key statistics' bounds,
    # no row max and no rescaling in the loop (fixed arm 535 -> 450 instructions per 64 tokens
    # at the v30 default's settings, 444 -> 369 with both of v31's, 5 -> 3 barriers; XLA reads
    # the key scales once more per call, 28 MB): with the v30 default's settings, with both of
    # v31's, and with those and "separate", which also goes to ncu. The other shapes moved to
    # `shapes` (a call of its own, with the sweep's winner), to keep this call inside the device
    # tool's 10 minutes with 14 configs (~8 min at the time limits, start included).
    set +e
    status=0
    log="$out/issuer.log"
    first="\"copy_issuer\": \"first_warp\""
    carried="\"value_accumulator\": \"carried\""
    separate="\"value_stats\": \"separate\""
    bound="\"row_max\": \"bound\""
    both="${v30}, ${first}, ${carried}"
    NATIVE_TESTS_SECONDS=150 device_and_native_tests "$log" || status=1
    sweep_at_32k "$log" "[${v30}}, ${v30}, ${first}}, ${v30}, ${carried}}, ${both}}, \
${v30}, ${separate}}, ${both}, ${separate}}, \
${v30}, ${bound}}, ${both}, ${bound}}, ${both}, ${separate}, ${bound}}, \
${folded}, \"block_tokens\": 64, \"num_stages\": 2, \"key_operand\": \"registers\", \"operand_order\": \"word\", ${first}, ${carried}}, \
${both}, \"num_splits\": 8}, ${both}, \"num_splits\": 16}, \
${folded}, ${first}, ${carried}}, ${folded}}]" 280 || status=1
    ncu_folded_mosaic "${both}, ${separate}, ${bound}}" >> "$log" || status=1
    exit "$status"
    ;;
  shapes)
    # After `issuer` (~4 min): the v30 default against the folded Mosaic config given (a JSON
    # dict, e.g. the 32k sweep's winner, "lowering" and "variant" included) at 8k / 128k, 1 and
    # 8 heads per KV head and KIVI-4.
    set +e
    sweep_shapes "$out/shapes.log" "${v30}}" "$2"
    exit $?
    ;;
  v34)
    # v34's third call (~6 min), after `issuer` and `final` + `shapes` made v30's settings with
    # first_warp, carried and separate the Hopper default (FOLDED_MOSAIC_GPU_V34): the generate
    # check with it (v34's `final` ran the check with v30's default, and its 75 s limit stopped
    # the script after GEAR); the dispatch's tests natively; each kernel of one jitted call
    # timed under ncu (how much of the call is XLA's), for the default and with row_max="bound"
    # (slower per call in `issuer`: its kernel or its XLA side?); the settings around the
    # default at 32k; ncu of the default.
    set +e
    status=0
    log="$out/v34.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$log"
    timeout --signal=INT 150 "$python" benchmarks/generate_kernels_check.py 2>&1 |
      tee "$out/generate_kernels_check.log" || status=1
    timeout --signal=INT 60 env KVJAX_NATIVE_KERNELS=1 KVJAX_TESTS_FAST_COMPILE=0 \
      "$python" -m pytest -q -n 8 -p no:cacheprovider \
      tests/pallas_kernels/test_quantized_decode_attention_gpu.py 2>&1 | tail -3 | tee -a "$log" ||
      status=1
    call_kernels "${v34}}" "${v34}, \"row_max\": \"bound\"}" || status=1
    sweep_at_32k "$log" "[${v34}}, ${v34}, \"num_stages\": 3}, ${v34}, \"num_stages\": 2}, \
${v34}, \"num_splits\": 16}, ${v34}, \"block_tokens\": 128, \"num_stages\": 2}, ${v30}}]" 120 || status=1
    ncu_folded_mosaic "${v34}}" >> "$log" || status=1
    exit "$status"
    ;;
  v35 | v35_profile)
    # v35 at most ~9.7 min (the native tests 150 s, the products' and merge's tests 60 s, the
    # 32k sweep 370 s), so the rest is v35_profile's: KIVI-4, each kernel of a call, ncu.
    # After v34 (~5 min): two settings of v34 not yet run on a GPU. "key_products": "reduction"
    # (in v34's third call ncu put XLA's q . k_min, a GEMM fusion, at 41 us of a call whose
    # kernel took 165 us, and row_max="bound"'s second GEMM fusion at 45 us, while "bound" cut
    # the kernel to 143 us; "reduction" makes both reduction fusions over the same 17 / 21 MB)
    # and "value_operand": "registers" (the value codes handed to wgmma from registers built by
    # byte permutes: no code tile stored and read back, shared-memory wavefronts per 64 tokens
    # and warp 126 -> 82 by the static count, where ncu found shared memory the busiest unit).
    # The folded Mosaic tests natively (the register value operand's inline code runs only
    # there); the products' tests on the GPU's XLA; the 32k sweep of their combinations and
    # KIVI-4 with and without register values (four programs per SM instead of three); each
    # kernel of one call under ncu; ncu of the default with register values.
    # And v35's "key_bias_source": "kernel" (q . k_min computed by each program before its loop,
    # one wgmma per 64 key groups: no GEMM fusion, no bias written and read back; the loop's
    # static count unchanged, 459 -> 458 instructions, 109 -> 111 registers, four programs per
    # SM), alone and with register values, and with "bound", whose softmax references the
    # kernel then computes too (a second wgmma per chunk over k_scale: no XLA product at all;
    # the fixed arm 377 instructions at 136 registers, three programs per SM, or 399 at 124
    # with register values, four), in the sweep and under ncu's per-kernel timing.
    # And v36's "split_merge": "triton" (the splits' merge, the value-slot picks and the word
    # order's positions in one Triton kernel instead of XLA's four: 20.8 us of v34's call under
    # ncu), natively tested, in the sweep with the v34 default and with the kernel's bias and
    # register values, and under ncu's per-kernel timing with the kernel's bias; and v36's
    # "copy_issuer": "spread" (each warp issues a share of the copies: the slowest warp's path
    # 459 -> 435 instructions per 64 tokens at v34's default by the static count; no shorter
    # with the kernel's bias, five streams instead of six), timed at v34's default; and v36's
    # "value_stat_loads": "own_slot" (each lane loads only its own value slot's statistics:
    # 459 -> 413 instructions per 64 tokens at v34's default, 396 -> 368 in "bound"'s fixed arm
    # with the kernel's bias and register values), natively tested (its inline code runs only
    # there), timed alone and in the candidate of every untimed setting the static count
    # favours, which ncu then profiles.
    # And v37's "blocks_per_copy": 2 (ring slots of two 64-token blocks in two stages: the
    # copies issued and waited for once per two blocks; the slowest warp 413 -> 374 instructions
    # per 64 tokens with "own_slot" at 128 registers, four programs per SM; the candidate's
    # fixed arm 368 -> 325 but at 130 registers, three per SM; with the kernel's bias, register
    # values and "own_slot" but no "bound" 385 at 127 registers), in place of two of the
    # "reduction" combinations, and in the KIVI-4 shapes (417 -> 370, three per SM either way;
    # the candidate with two stages of one block is four per SM there, 52 KB, at 413).
    # And v37's "token_order": "spread" (the register value codes' loads conflict-free: 16
    # wavefronts fewer per warp and 64 tokens by benchmarks/shared_bank_conflicts.py, for ~10
    # instructions more), with register values and with the kernel's bias, register values and
    # "own_slot" (113 registers, four per SM; with "bound" 132, three), in place of "bound" with
    # the kernel's bias alone.
    # And v38's "partial_slots": "own" (each channel's own value slot picked in the epilogue:
    # the partials 8.4 -> 4.2 MB written and read per call, and the candidate's registers
    # 124 -> 112; with two blocks per slot 130 -> 128, four programs per SM at 325 instructions
    # per 64 tokens in the fixed arm, the fewest of any four-per-SM config; after v38's one
    # query array 128 without "own" and 129 with it, so both are here), with the candidate and
    # the merge kernel, with and without two blocks per slot, in place of the two "reduction"
    # combinations (v35_profile still times "reduction" under ncu).
    set +e
    status=0
    log="$out/$1.log"
    kernel_bias="\"key_bias_source\": \"kernel\""
    reduction="\"key_products\": \"reduction\""
    bound="\"row_max\": \"bound\""
    values="\"value_operand\": \"registers\""
    merge="\"split_merge\": \"triton\""
    spread="${v30}, \"copy_issuer\": \"spread\", \"value_accumulator\": \"carried\", \
\"value_stats\": \"separate\"" # v34's settings with each warp issuing a share
    own="\"value_stat_loads\": \"own_slot\""
    two_blocks="\"num_stages\": 2, \"blocks_per_copy\": 2" # the later num_stages wins
    token_spread="\"token_order\": \"spread\""
    partials="\"partial_slots\": \"own\""
    # everything untimed that the static count favours, together
    candidate="${v34}, ${bound}, ${kernel_bias}, ${values}, ${own}"
    if [ "$1" = v35 ]; then
      NATIVE_TESTS_SECONDS=150 device_and_native_tests "$log" || status=1
      timeout --signal=INT 60 "$python" -m pytest -q -p no:cacheprovider \
        tests/pallas_kernels/test_key_bias.py tests/pallas_kernels/test_softmax_reference_bounds.py \
        tests/pallas_kernels/test_key_bias_in_kernel.py tests/pallas_kernels/test_split_merge_triton.py \
        2>&1 | tail -3 | tee -a "$log" || status=1
      sweep_at_32k "$log" "[${v34}}, ${v34}, ${kernel_bias}}, ${v34}, ${kernel_bias}, ${values}}, \
${v34}, ${values}, ${token_spread}}, ${v34}, ${bound}, ${kernel_bias}, ${values}}, \
${candidate}, ${merge}, ${partials}}, ${v34}, ${values}}, \
${candidate}, ${merge}, ${two_blocks}, ${partials}}, ${v34}, ${merge}}, \
${v34}, ${kernel_bias}, ${values}, ${merge}}, ${spread}}, ${v34}, ${own}}, ${candidate}}, \
${candidate}, ${merge}}, ${v34}, ${own}, ${two_blocks}}, ${candidate}, ${two_blocks}}, \
${v34}, ${kernel_bias}, ${values}, ${own}, ${two_blocks}}, \
${v34}, ${kernel_bias}, ${values}, ${own}, ${token_spread}}]" 370 || status=1
      exit "$status"
    fi
    # v35_profile, on the warm machine right after (at most ~4.5 min): what v35 left
    sweep_shapes_only "$log" "32768 4 4" -- "${v34}}" "${v34}, ${values}}" \
      "${v34}, ${kernel_bias}}" "${candidate}}" "${candidate}, ${two_blocks}}" \
      "${candidate}, \"num_stages\": 2}" || status=1
    call_kernels "${v34}, ${kernel_bias}, ${merge}}" "${candidate}, ${merge}}" \
      "${v34}, ${reduction}}" || status=1
    ncu_folded_mosaic "${candidate}}" >> "$log" || status=1
    exit "$status"
    ;;
  v39)
    # v39's second call (~7 min on a fresh machine), after v35's sweep put the candidate with the
    # merge kernel first at 32k (122.7 us against v34's 177.4) and `final` timed it at 126.6 but
    # stopped in the generate check: the kernel's bias over caches whose key groups are not
    # whole 8-row tiles failed to compile natively (fixed in v39 by padding k_min / k_scale),
    # and the kernel's bias lost the queries' low half natively (XLA's GPU compiler dropped
    # query_halves' f32 -> bf16 -> f32 round trip; fixed on CPU after this call ran). The next
    # session reruns it as is: a pass makes C + merge the default.
    # The folded file, the prologue's tests and the lowering tests natively; the generate check
    # with the candidate; the candidate against v34's default at the other shapes.
    set +e
    status=0
    log="$out/v39.log"
    winner="${c_merge}"
    native_tests_and_generate_check "$log" "${winner}}" || status=1
    sweep_shapes "$log" "${v34}}" "${winner}}" || status=1
    exit "$status"
    ;;
  v40 | v40_profile)
    # v40: v39's second call again (its fixes of the kernel's bias natively, the generate check
    # with C + merge), and v40's two settings timed beside C + merge at 32k: "key_stack_timing":
    # "block_ahead" (the next block's Q' staged before each block's one barrier: C's fixed arm
    # 2 -> 1 barriers per block, 368 -> 370 instructions per 64 tokens, 112 -> 109 registers,
    # the same 55 KB, four programs per SM) and "copy_issue_point": "value_product" (each ring
    # slot refilled in its last block's value product's shadow, so that the first warp's copies
    # no longer delay each block's barrier: 368 -> 361, 114 registers; both 383, 111), and the
    # sweep's fastest against C + merge at the other shapes; and both with approx_math (exp2 as
    # one ex2.approx: the softmax's dependent chain shorter, 383 -> 370 instructions, timed no
    # faster in v30 at that default's settings), and both with 16 splits instead of the
    # planner's 32 (each program's prologue and first copies' latency over 32 blocks instead of
    # 16; 1024 programs, 1.94 waves of 528). By the static count, block_ahead
    # with two blocks per slot takes 171 registers and with 3 stages 413 instructions: not
    # timed. ~8.5 min: the native tests 120 s, the generate check 100 s, the 32k sweep 110 s,
    # the shapes 5 x 34 s, one head per KV head with every lane's statistics 34 s. v41 (no GPU
    # lent) adds "value_product_columns": "own_tiles" (each 64-channel row tile's value product
    # against its own P' tiles: N 16 -> 8, the carried accumulator [128, 8]; C's fixed arm 368
    # -> 358 instructions per 64 tokens, 116 registers, four programs per SM) on C and on C
    # with both of v40's settings: two configs more, the sweep's limit 110 -> 140 s. A pass of
    # the native tests and the generate check makes the fastest the default. v40_profile, right after on the warm machine (~4 min): the 32k table with the
    # fastest, each kernel of a call and ncu of it (its barrier, fence and wgmma-wait stalls
    # against v34's "bound").
    set +e
    status=0
    log="$out/$1.log"
    winner="${c_merge}"
    ahead="\"key_stack_timing\": \"block_ahead\""
    refill="\"copy_issue_point\": \"value_product\""
    own_tiles="\"value_product_columns\": \"own_tiles\""
    if [ "$1" = v40 ]; then
      native_tests_and_generate_check "$log" "${winner}}" || status=1
      sweep_at_32k "$log" "[${v34}}, ${winner}}, ${winner}, ${ahead}}, ${winner}, ${refill}}, \
${winner}, ${ahead}, ${refill}}, ${winner}, ${ahead}, ${refill}, \"approx_math\": true}, \
${winner}, ${ahead}, ${refill}, \"num_splits\": 16}, \
${winner}, \"num_stages\": 2, \"blocks_per_copy\": 2}, ${winner}, ${own_tiles}}, \
${winner}, ${ahead}, ${refill}, ${own_tiles}}]" 140 || status=1
      best="$(keep_fastest "$log")" && sweep_shapes "$log" "${winner}}" "$best" || status=1
      # One query head per KV head (MHA) refuses own-slot statistics: the fastest with every
      # lane's, against v34's default there
      one_head="$("$python" -c "import json, sys; c = json.loads(sys.argv[1]); \
c['value_stat_loads'] = 'all_groups'; print(json.dumps(c))" "$best")" &&
        sweep_shapes_only "$log" "32768 1 2" -- "${v34}}" "$one_head" || status=1
      exit "$status"
    fi
    # the config given, else the one v40 found fastest on this (warm) machine
    best="${2:-$(cat /tmp/kvjax_v40_fastest.json 2>/dev/null)}"
    [ -n "$best" ] || best="${winner}, ${ahead}, ${refill}}"
    echo "profiled: $best" | tee -a "$log"
    # The 32k table with the fastest in the folded Mosaic rows (the copy rate and XLA's bf16
    # attention of the same run: the issue's measure), then its kernels and ncu
    table_32k 150 "$best" || status=1
    call_kernels "$best" || status=1
    ncu_folded_mosaic "$best" >> "$log" || status=1
    exit "$status"
    ;;
  v42)
    # v42 (no GPU lent when written): v40's checks and its most promising configs, and five
    # warpgroups a program (`warpgroups_per_program`: launched 640 threads wide, ptxas fits the
    # kernel into 96 registers, five warps per scheduler instead of four; sm_90a static count of
    # C + both of v40's settings + own value tiles at two stages: 96 registers, 0 spills, 399
    # instructions per 64 tokens against 391 at 103 registers, 220 KB a program of five). Each
    # warpgroup runs its own copy of the code (tracing, lowering and compiling a five-warpgroup
    # kernel took 7.1 s on 2 CPU cores, 1.5 s for one warpgroup). ~8 min: native tests 120 s,
    # the generate check 100 s, the sweep 200 s. Then v40_profile on the warm machine with the
    # fastest (it reads what this call leaves, as after v40).
    set +e
    status=0
    log="$out/v42.log"
    winner="${c_merge}"
    both="\"key_stack_timing\": \"block_ahead\", \"copy_issue_point\": \"value_product\""
    own_tiles="\"value_product_columns\": \"own_tiles\""
    five="${winner}, ${both}, ${own_tiles}, \"num_stages\": 2, \"warpgroups_per_program\": 5"
    native_tests_and_generate_check "$log" "${winner}}" || status=1
    # 5 warpgroups a program: one program per SM; the planner's 33 splits per (row, KV head)
    # make 7 programs of 5 each, 448 in all (3.4 waves of 132), 20 splits make 256 (1.9). Not
    # fewer than 16: a split of more than 64 key groups takes a second 2 KB bias chunk per
    # warpgroup, over the 227 KB (the kernel refuses it)
    sweep_at_32k "$log" "[${v34}}, ${winner}}, ${winner}, ${both}}, ${winner}, ${both}, \
${own_tiles}}, ${winner}, ${both}, ${own_tiles}, \"num_stages\": 2}, ${five}}, \
${five}, \"num_splits\": 20}]" 200 || status=1
    keep_fastest "$log" > /dev/null || status=1
    exit "$status"
    ;;
  v43)
    # v43 (no GPU lent when written): v42's checks, v34, C + merge and v42's five-warpgroup config
    # (v42's other configs are left to it and to v40), and value_operand="matrix_loads"
    # (the value codes by ldmatrix.trans: sm_90a static count, per 64 tokens in the slowest warp,
    # C 368 -> 339, C at two blocks per slot 324.5 -> 299.5 at 127 registers, C + v40's settings
    # 383 -> 359, and at two stages in five warpgroups a program 397 -> 371 at 96 registers; the
    # value ring TMA-swizzled for the loads).
    # ~9 min: native tests 120 s (the matrix-load cases included), the generate check with
    # C + merge + matrix loads 100 s, the sweep 270 s. Then v40_profile on the warm machine with
    # the fastest.
    set +e
    status=0
    log="$out/v43.log"
    winner="${c_merge}"
    matrix="\"value_operand\": \"matrix_loads\""
    both="\"key_stack_timing\": \"block_ahead\", \"copy_issue_point\": \"value_product\""
    own_tiles="\"value_product_columns\": \"own_tiles\""
    pairs="\"num_stages\": 2, \"blocks_per_copy\": 2"
    five="\"num_stages\": 2, \"warpgroups_per_program\": 5"
    native_tests_and_generate_check "$log" "${winner}, ${matrix}}" || status=1
    # v34, C + merge, then matrix loads on it, at two blocks per slot (with and without), with
    # v40's settings, and five warpgroups a program (v42's own-tiles config and the matrix-load
    # one; own tiles need channel-order rows, so not with matrix loads). Five warpgroups at 20
    # splits per (row, KV head): 4 programs of 5 each, 256 in all, 1.94 waves of 132 (the
    # planner's 33 make 448, 3.4 waves, the last 40% full, and a spare warpgroup or two in each
    # row's last program); the matrix-load one at the planner's too
    sweep_at_32k "$log" "[${v34}}, ${winner}}, ${winner}, ${matrix}}, ${winner}, ${pairs}}, \
${winner}, ${pairs}, ${matrix}}, ${winner}, ${both}, ${matrix}}, \
${winner}, ${both}, ${own_tiles}, ${five}, \"num_splits\": 20}, \
${winner}, ${both}, ${matrix}, ${five}, \"num_splits\": 20}, ${winner}, ${both}, ${matrix}, ${five}}]" \
      270 || status=1
    keep_fastest "$log" > /dev/null || status=1
    exit "$status"
    ;;
  warp_products)
    # v44 (~4 min with v45's part; run it first, then v43 on the warm machine: ~13 of the 15
    # minutes together):
    # the per-warp products loop (mma.sync per warp, one or no barrier in the loop) as CUDA
    # (committed cubins) and as a Mosaic GPU kernel, each checked against the numpy model and
    # timed at 32k (the CUDA one also at 8k and 128k, with the copy rate of the same run); the
    # folded Mosaic kernel's numbers come from v43's sweep
    log="$out/warp_products.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$log"
    warp_products_run "$log"
    ;;
  v59)
    # v59 (the first GPU lent since v39; ~8 min, one call): the 32k sweep first, so that the
    # timings come back even if a later step runs out of time: the warp variant (v45-v47: its
    # default, 2 stages, the kernel's bias with the Triton merge, XLA's products as reductions,
    # each slot's copies by its own warp with the per-warp release, queries loaded once) beside
    # v34's default, C + merge (v39's fastest), C + merge with v40's two settings and with v43's
    # matrix loads (one and two blocks per slot). Then the issue's 32k table with the fastest in
    # the folded Mosaic row (the copy rate and XLA's bf16 attention of the same run), the native
    # tests of the fastest's file, the generate check with it, and KIVI-4 at 32k.
    set +e
    status=0
    log="$out/v59.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$log"
    both="\"key_stack_timing\": \"block_ahead\", \"copy_issue_point\": \"value_product\""
    matrix="\"value_operand\": \"matrix_loads\""
    pairs="\"num_stages\": 2, \"blocks_per_copy\": 2"
    sweep_at_32k "$log" "[${warp}}, ${warp}, \"num_stages\": 2}, \
${warp}, \"key_bias_source\": \"kernel\", \"num_stages\": 2, \"split_merge\": \"triton\"}, \
${warp}, \"split_merge\": \"triton\"}, ${warp}, \"key_products\": \"reduction\"}, \
${warp}, \"copy_issuer\": \"slot_owner\", \"ring_release\": \"per_warp\"}, \
${warp}, \"query_loads\": \"once\"}, ${v34}}, ${c_merge}}, ${c_merge}, ${both}}, \
${c_merge}, ${matrix}}, ${c_merge}, ${pairs}, ${matrix}}]" 200 || status=1
    best="$(keep_fastest "$log")" || { best="${c_merge}}"; status=1; }
    table_32k 130 "$best" || status=1
    case "$best" in
      *'"warp"'*) test_files=(tests/pallas_kernels/test_quantized_decode_attention_warp_mosaic_gpu.py) ;;
      *) test_files=(tests/pallas_kernels/test_quantized_decode_attention_folded_mosaic_gpu.py
           tests/pallas_kernels/test_key_bias_in_kernel.py) ;;
    esac
    native_tests 110 "${test_files[@]}" 2>&1 | tail -15 | tee -a "$log" || status=1
    timeout --signal=INT 90 "$python" benchmarks/generate_kernels_check.py --kivi-settings "$best" \
      2>&1 | tee "$out/generate_kernels_check.log" | tail -12 || status=1
    sweep_shapes_only "$log" "32768 4 4" -- "${warp}}" "${v34}}" "$best" || status=1
    exit "$status"
    ;;
  v59b)
    # v59's second call (~6 min): the fastest of v59's sweep (the warp variant with the kernel's
    # bias, two stages and the Triton merge) in the issue's table at 8k, 32k and 128k; the
    # generate check with it on bf16 caches (2- and 4-bit) and the warp variant's own runs; it
    # against C + merge at one and eight query heads per KV head; head_dim 64 at 2 bits.
    set +e
    status=0
    log="$out/v59b.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$log"
    best="$warp_v59"
    timeout --signal=INT 170 "$python" benchmarks/decode_attention.py --contexts 8192 32768 131072 \
      --no-gear --kernel-config '{"variant": "folded"}' --folded-mosaic-kernel-config "$best" \
      --out "$out/decode_attention.json" 2>&1 | tee "$out/decode_attention.log" | tail -16 || status=1
    timeout --signal=INT 80 "$python" benchmarks/generate_kernels_check.py --only warp \
      --kivi-settings "$best" 2>&1 | tee "$out/generate_kernels_check.log" | tail -8 || status=1
    sweep_shapes_only "$log" "32768 1 2" "32768 8 2" -- "$best" "${c_merge}}" || status=1
    sweep_shapes_only "$log" "32768 4 2 64" -- "$best" "${warp}}" \
      "{\"lowering\": \"triton\", \"variant\": \"folded\"}" || status=1
    exit "$status"
    ;;
  v60)
    # What v59 left (~8 min, not yet run; after v61 on the warm machine): why the warp kernel's
    # generate check at head_dim 64 with 2-bit codes on a bf16 cache left the reference's tokens
    # (row 1 from its 8th token; interpret mode gives the reference's tokens, and the reference's
    # top-two margin there is 0.72 on CPU). First every attention call of the teacher-forced run
    # through the warp kernel (v59's settings) and through folded Triton against the reference on
    # the same inputs, per step, layer and row, the worst calls' inputs saved for a replay on the
    # CPU (`attention_calls_check.py --replay`); then the teacher-forced logits through warp V59;
    # then the issue's table at 8k and at 128k with the Hopper default (v59's 8k-128k table ran
    # past its limit in the 128k rows' compiles).
    set +e
    status=0
    log="$out/v60.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$log"
    # the limits below add up to 2 x 100 + 60 + 100 + 220 = 580 s, under a call's 600
    for name_and_config in "warp_v59 $warp_v59" 'folded_triton {"variant": "folded"}'; do
      set -- $name_and_config
      echo "== attention calls, KIVI-2 bf16, $name_and_config" >> "$log"
      timeout --signal=INT 100 "$python" benchmarks/attention_calls_check.py \
        --kernel-config "${name_and_config#* }" --dump "$out/calls_$1" 2>&1 | tail -80 >> "$log" ||
        status=1
    done
    echo "== logit margins, KIVI-2 bf16, $warp_v59" >> "$log"
    timeout --signal=INT 60 "$python" benchmarks/generate_logit_margins.py \
      --spec kivi:bits=2,residual=32 --kernel-config "$warp_v59" 2>&1 | tail -40 >> "$log" ||
      status=1
    for seconds_and_context in "100 8192" "220 131072"; do
      set -- $seconds_and_context
      timeout --signal=INT "$1" "$python" benchmarks/decode_attention.py --contexts "$2" \
        --no-gear --kernel-config '{"variant": "folded"}' --folded-mosaic-kernel-config "$warp_v59" \
        --out "$out/decode_attention_$2.json" 2>&1 | tail -16 | tee -a "$log" || status=1
    done
    exit "$status"
    ;;
  v61)
    # The first step of the next GPU session (~7 min, not yet run; then v60 on the warm machine if
    # `status` leaves 9 minutes). KERNEL_NOTES v60 put the kernel's prologue buffers and its
    # epilogue's partials in the same shared-memory bytes: warp V59 at 2-bit codes and head_dim
    # 128 went from 65 KB to 55 KB a program, three programs an SM to four (sm_90a static count),
    # and the planner's 32 splits from 5.2 waves (six, the last a sixth full) to 3.9. The 32k
    # sweep: V59 as it is now; the warp defaults, whose code did not change, as the control
    # against v59's run (148.2 us there); V59 with slot-owner copies, with them and the per-warp
    # release (both four programs an SM too); 16 and 64 splits instead of the planner's 32; V59
    # with the value ring TMA-swizzled (v62: one wavefront a value matrix instead of two, +1
    # instruction a block), and with the value statistics by matrix loads (v62: 469 -> 458
    # instructions a block at 128 registers, still four an SM by the static count). Then the
    # issue's 32k table with the fastest, and the warp kernel's tests natively (the shared bytes
    # are new code there, and v62's loads; v60's generate runs go through them at head_dim 64).
    set +e
    status=0
    log="$out/v61.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$log"
    v59_open="${warp_v59%\}}"
    owner='"copy_issuer": "slot_owner"'
    sweep_at_32k "$log" "[${warp_v59}, ${warp}}, ${v59_open}, ${owner}}, \
${v59_open}, ${owner}, \"ring_release\": \"per_warp\"}, ${v59_open}, \"num_splits\": 16}, \
${v59_open}, \"num_splits\": 64}, ${v59_open}, \"value_ring_layout\": \"swizzled\"}, \
${v59_open}, \"statistic_loads\": \"matrix_loads\"}]" 160 || status=1
    best="$(keep_fastest "$log")" || { best="$warp_v59"; status=1; }
    table_32k 130 "$best" || status=1
    native_tests 110 tests/pallas_kernels/test_quantized_decode_attention_warp_mosaic_gpu.py 2>&1 |
      tail -15 | tee -a "$log" || status=1
    exit "$status"
    ;;
  warp_head_dim64)
    # v47 (~3 min; after warp_products on the warm machine if `status` leaves 4 minutes)
    log="$out/warp_head_dim64.log"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$log"
    warp_head_dim64_run "$log"
    ;;
  *)
    echo "usage: $0 check | check_triton | sweep | gear | rows | brief | recheck | defaults | probe | word | tune | final | issuer | shapes '<config JSON>' | v34 | v35 | v35_profile | v39 | v40 | v40_profile | v42 | v43 | warp_products | warp_head_dim64 | v59 | v59b | v60 | v61 | ncu '<kernel config JSON>'" >&2
    exit 2
    ;;
esac
