#!/usr/bin/env bash
# One-shot check of the Triton kernels on a lent CUDA machine (an H200 with Python 3.12,
# torch 2.11 CUDA 13, Triton 3.6, pytest; no network; the repo is not installed).
#
#   bash benchmarks/gpu_check.sh          # from the repository root; results go to $OUT (or ./out)
#   GPU_CHECK_SMOKE=1 bash benchmarks/gpu_check.sh   # CPU dry run of this script (CI runs it): no build,
#                                         # tests only collected, benchmarks at tiny shapes in the
#                                         # Triton interpreter; checks the plumbing, measures nothing
#
# Peers compared in the same run (each reported as missing when it does not import here, never
# fatal): fla's chunk_gated_delta_rule, dense and packed (gdn_gpu); torch._grouped_mm and
# transformers' grouped_mm experts (moe_gpu, and the harness's grouped_matmul / moe_experts);
# Liger's RMSNorm, SwiGLU and RoPE (rowwise_gpu and the harness) and fused linear cross-entropy (the
# harness); the packed-attention varlen kernel against the per-sample SDPA loop (attention_gpu).
# Steps: versions and devices; build of the C++ extension; the Megatron single-GPU smoke test
# on the current megatron-core (the lent machine has none: carry the newest 0.19.x wheel, built for
# its Python 3.12, in .whl/ and pass the device tool carry=[".whl"]; the step names the release):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl "megatron-core>=0.19,<0.20"
# ); the Triton-relevant test files one by one (each with its
# own timeout; a failing file does not stop the others); then the GPU timing scripts and the
# quick harness. Every step's outcome is printed in a summary; everything written is packed into
# one archive, $OUT/gpu_check.tar.gz, plus $OUT/summary.txt (the device tool returns few files).
# Later kernels add their test files to TEST_PATTERNS and their timing scripts (benchmarks/scripts/)
# or harness --ops to BENCHES.
set -u

# --- what to run (extend these) ---------------------------------------------------------------
TEST_PATTERNS=(
  tests/kernels/test_rowwise.py
  "tests/*/test_*triton*.py"
  "tests/*/test_gdn*.py"
  tests/kernels/test_causal_conv1d.py
  "tests/*/test_moe*.py"
  "tests/*/test_linear_ce*.py"
  tests/kernels/test_packed_attention.py
)
# "module|timeout seconds|arguments on the GPU|arguments of the CPU dry run (GPU_CHECK_SMOKE=1)"
# each runs as `python -m module` (\$OUT in the arguments becomes this run's output folder)
BENCHES=(
  "benchmarks.scripts.rowwise_gpu|55|--budget-s 35 --out \$OUT|--device cpu --small --dtypes float32 --reps 1 --warmup 0 --no-compile --out \$OUT"
  "benchmarks.scripts.gdn_gpu|70|--quick --out \$OUT|--device cpu --small --dtype float32 --reps 1 --warmup 0 --out \$OUT"
  "benchmarks.scripts.moe_gpu|40|--out \$OUT|--device cpu --small --dtypes float32 --reps 1 --warmup 0 --out \$OUT"
  "benchmarks.scripts.gdn_cp|60|--check --device cuda|--check --device cpu"
  "benchmarks.scripts.attention_gpu|25|--out \$OUT|--device cpu --small --dtype float32 --out \$OUT"
  "benchmarks.scripts.train_step|90|--device cuda --models qwen3_0_6b --layers 2 --seq 512 --dtypes bf16 --lora --steps 3 --gemm-floor --strict --out \$OUT/train_step.md|--device cpu --tiny --models qwen3_0_6b --layers 1 --seq 16 --dtypes bf16 --variants hf_eager,hf_autocast,hf_patched,facade_twinkle --steps 1 --gemm-floor --in-process --strict --out \$OUT/train_step.md"
  "benchmarks|60|--ops fused_linear_cross_entropy --no-model-step --out \$OUT/bench_lce|--quick --ops fused_linear_cross_entropy --dtypes float32 --modes fwd --providers twinkle-cpu,eager --no-model-step --no-progress --out \$OUT/bench_lce"
  "benchmarks|50|--quick --ops rms_norm,rope,swiglu,grouped_matmul,moe_experts --no-model-step --out \$OUT/bench|--quick --ops rms_norm --dtypes float32 --modes fwd --providers twinkle-cpu,torch.rms_norm --no-model-step --no-progress --out \$OUT/bench"
)
BUILD_TIMEOUT=${BUILD_TIMEOUT:-60}
MEGATRON_TIMEOUT=${MEGATRON_TIMEOUT:-75}
PER_FILE_TIMEOUT=${PER_FILE_TIMEOUT:-150}   # seconds per test file (Triton compiles every variant on first use)
TESTS_BUDGET=${TESTS_BUDGET:-170}           # all test files together; a file gets at most what is left
PYTEST_ARGS=${PYTEST_ARGS:--x}              # e.g. PYTEST_ARGS="--maxfail=10" to see more than the first failure
SMOKE=${GPU_CHECK_SMOKE:-0}
# ----------------------------------------------------------------------------------------------

cd "$(dirname "$0")/.." || exit 2
# The device tool returns at most 8 files from $OUT: everything is written to a work folder
# and packed into one archive (plus the summary) at the end.
FINAL_OUT=${OUT:-./out}
OUT=$(mktemp -d /tmp/gpu_check.XXXXXX)
export OUT
mkdir -p "$FINAL_OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# the lent machine's Python with torch is python3 (there may be no plain "python")
PY=${PYTHON:-python3}
if [ "$SMOKE" = 1 ]; then
  export TRITON_INTERPRET=1       # the dry run's Triton kernels run in the interpreter, on the CPU
  COLLECT="--collect-only"        # tests are collected (imports, parametrization), not run
else
  unset TRITON_INTERPRET          # real kernels here, never the interpreter
  COLLECT=""
fi

SUMMARY=()
FAILED=0
record() {  # record NAME RC SECONDS
  local verdict=ok
  if [ "$2" -eq 124 ] || [ "$2" -eq 137 ]; then verdict="TIMEOUT"; FAILED=1
  elif [ "$2" -ne 0 ]; then verdict="FAILED (rc=$2)"; FAILED=1; fi
  SUMMARY+=("$(printf '%-40s %-16s %4ss' "$1" "$verdict" "$3")")
}

T0=$SECONDS
echo "=== devices and versions"
nvidia-smi -L 2>&1 || echo "nvidia-smi failed"
PYTHONWARNINGS=ignore $PY - <<'EOF' 2>&1
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| cuda available", torch.cuda.is_available())
for mod in ("triton", "transformers", "pytest", "megatron.core", "fla", "liger_kernel"):
    try:
        m = __import__(mod, fromlist=["__version__"])
        print(f"{mod} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"{mod}: not importable ({type(e).__name__})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
EOF
record "versions" $? $((SECONDS - T0))

echo "=== build (the C++ CPU extension, this machine's ISA only; the Triton kernels need no build)"
if [ "$SMOKE" = 1 ]; then
  SUMMARY+=("$(printf '%-40s %-16s' "build (setup.py build_ext)" "SKIPPED (dry run)")")
else
  t=$SECONDS
  TWINKLE_ISA_VARIANTS=avx512 MAX_JOBS=16 timeout -k 5 "$BUILD_TIMEOUT" $PY setup.py build_ext --inplace \
    > "$OUT/build.log" 2>&1
  rc=$?
  grep -E "error:|twinkle:" "$OUT/build.log" | head -n 20
  record "build (setup.py build_ext)" $rc $((SECONDS - t))
fi

echo "=== megatron single-GPU smoke test"
# megatron-core is not installed on the lent machine: carry its wheels in .whl/ (see the device
# README) and they are installed into /tmp/site here; without them the step reports SKIPPED.
if ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/whl.log" 2>&1 \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if $PY -c "import megatron.core" > /dev/null 2>&1; then
  MCORE=$($PY -c "import megatron.core; print(megatron.core.__version__)" 2>/dev/null)
  echo "megatron-core $MCORE"
  t=$SECONDS
  timeout -k 10 "$MEGATRON_TIMEOUT" $PY -m pytest -q -p no:cacheprovider --tb=short -rs $COLLECT \
    tests/megatron/test_megatron.py tests/megatron/test_megatron_hybrid.py -k single_gpu > "$OUT/pytest_megatron_gpu.log" 2>&1
  rc=$?
  tail -n 15 "$OUT/pytest_megatron_gpu.log"
  record "megatron $MCORE tests -k single_gpu" $rc $((SECONDS - t))
else
  SUMMARY+=("$(printf '%-40s %-16s' "megatron single-GPU smoke" "SKIPPED (no megatron-core)")")
fi

echo "=== tests"
shopt -s nullglob
FILES=()
for pat in "${TEST_PATTERNS[@]}"; do
  for f in $pat; do
    case " ${FILES[*]-} " in *" $f "*) ;; *) FILES+=("$f") ;; esac
  done
done
shopt -u nullglob
TESTS_T0=$SECONDS
# the dry run only collects, but on a shared CPU machine collecting a file takes 10-40 s: its budget
# is scaled like the benchmarks' below
[ "$SMOKE" = 1 ] && TESTS_BUDGET=$((TESTS_BUDGET * ${SMOKE_TIMEOUT_SCALE:-3}))
for f in "${FILES[@]}"; do
  name=$(basename "$f" .py)
  left=$((TESTS_BUDGET - (SECONDS - TESTS_T0)))
  tmo=$(( left < PER_FILE_TIMEOUT ? left : PER_FILE_TIMEOUT ))
  if [ "$tmo" -lt 20 ]; then
    echo "--- $f: skipped (tests budget of ${TESTS_BUDGET}s spent)"
    SUMMARY+=("$(printf '%-40s %-16s' "$f" "SKIPPED (budget)")"); FAILED=1
    continue
  fi
  echo "--- $f"
  t=$SECONDS
  # shellcheck disable=SC2086  # PYTEST_ARGS and COLLECT hold several or no arguments
  timeout -k 10 "$tmo" $PY -m pytest -q $PYTEST_ARGS $COLLECT -p no:cacheprovider --tb=short -rs "$f" \
    > "$OUT/pytest_$name.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "$f: timed out after ${tmo}s (log: $OUT/pytest_$name.log)"
  # the tail keeps the console short: the result line, or the first failure's traceback
  tail -n 25 "$OUT/pytest_$name.log"
  record "$f" $rc $((SECONDS - t))
done
[ ${#FILES[@]} -eq 0 ] && { echo "no test files matched"; record "tests" 1 0; }

echo "=== benchmarks"
for b in "${BENCHES[@]}"; do
  IFS='|' read -r module tmo extra smoke_extra <<< "$b"
  # the budgets are sized for the GPU's device time; the CPU dry run runs in the Triton interpreter
  # on a shared machine, so it gets SMOKE_TIMEOUT_SCALE times as long (a budget, not a measurement)
  [ "$SMOKE" = 1 ] && { extra=$smoke_extra; tmo=$((tmo * ${SMOKE_TIMEOUT_SCALE:-3})); }
  name=${module##*.}
  path=${module//.//}
  if [ ! -f "$path.py" ] && [ ! -f "$path/__main__.py" ]; then record "$module" 1 0; echo "missing $module"; continue; fi
  t=$SECONDS
  # shellcheck disable=SC2086  # extra holds several arguments
  extra=${extra//\$OUT/$OUT}
  # a module run twice (the harness, for two sets of ops) keeps one log per run
  log=bench_$name; n=2
  while [ -e "$OUT/$log.log" ]; do log=bench_${name}_$n; n=$((n + 1)); done
  timeout -k 10 "$tmo" $PY -m "$module" $extra 2>&1 | tee "$OUT/$log.log"
  rc=${PIPESTATUS[0]}
  record "$module" $rc $((SECONDS - t))
done

echo
echo "=== summary ($((SECONDS - T0))s in all; logs in $FINAL_OUT/gpu_check.tar.gz)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
cp "$OUT/summary.txt" "$FINAL_OUT/summary.txt"
tar -czf "$FINAL_OUT/gpu_check.tar.gz" -C "$OUT" .
exit $FAILED
