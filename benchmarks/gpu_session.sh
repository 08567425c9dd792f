#!/usr/bin/env bash
# The device machine's one prepared run (a lent H100 / H200; docs/benchmarks.md, "GPU"): its environment,
# the tests that run our CUDA paths, the Triton kernels against their torch references
# (benchmarks/kernel_bench.py) and a served benchmark of real-shape models, each step under its own time
# limit; everything it writes goes under $OUT (session.log, junit.xml, kernels.json, served.json and
# logs.tar.gz with the full pytest and server logs).
#
#   bash benchmarks/gpu_session.sh --prepare        # here, first: the wheels and the tokenizer it carries
#   bash benchmarks/gpu_session.sh [STEP ...]       # there: env tests kernels served (default: all four)
#
# On the device machine: run(command="bash benchmarks/gpu_session.sh", carry=[".whl", ".gpu"]).
# It runs the image's python3 (its torch, triton and transformers' dependencies) with the wheels of
# benchmarks/gpu_wheels.txt (what our server imports that the image lacks) installed into /tmp/site. The
# embedded model's 92 MB package cannot travel (64 MiB a call): the tests get a random-weight folder of
# SmolLM2-135M's shape with its tokenizer (real_shape_models.py smollm2-135m, KUBEINFER_TEST_SMOLLM2_DIR).
# Environment: OUT (default build/gpu-session), TEST_PATHS, TEST_WORKERS (8), SERVED_MODELS
# ("llama-3.2-1b qwen3-moe-2b"), SERVED_USERS ("1 16 64"), each step's limit in seconds: LIMIT_TESTS (200),
# LIMIT_KERNELS (100), LIMIT_SERVED (210), and DEADLINE_S (480): the whole run's, steps cut to fit it.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
WHEELS=$REPO/.whl
CARRIED=$REPO/.gpu

if [ "${1:-}" = "--prepare" ]; then
    set -e
    mkdir -p "$WHEELS" "$CARRIED/smollm2-tokenizer"
    rm -f "$WHEELS"/*.whl  # one version of each: two would stop the whole install there
    grep -v '^#' benchmarks/gpu_wheels.txt | while read -r req; do
        [ -n "$req" ] || continue
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
            --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$WHEELS" "$req"
    done
    src=$(.venv/bin/python -c 'from server.models.loader import resolve_model; print(resolve_model(None).folder)')
    for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
        [ -f "$src/$f" ] && cp "$src/$f" "$CARRIED/smollm2-tokenizer/"
    done
    du -sh "$WHEELS" "$CARRIED"
    exit 0
fi

OUT=${OUT:-$REPO/build/gpu-session}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/gpu-session-logs.XXXX)
export TMPDIR=$LOGS  # the served benchmark's server logs land here, and go back in logs.tar.gz
exec > >(tee -a "$OUT/session.log") 2>&1
TEE_PID=$!
PY=${PYTHON:-python3}
MODELS_DIR=${MODELS_DIR:-/tmp/real-shapes}
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(env tests kernels served)
TEST_PATHS=${TEST_PATHS:-"tests/kernels tests/moe/test_moe_layer.py tests/models/test_arch_parity.py
    tests/moe/test_moe_arch_parity.py tests/models/test_gpt_oss.py tests/engine/test_engine_parity.py
    tests/lora/test_lora_engine.py tests/engine/test_sliding_window_parity.py tests/engine/test_attention_sinks.py
    tests/engine/test_attention_softcap.py tests/quant/test_quant_serving.py tests/engine/test_spec_decode.py"}
SERVED_MODELS=${SERVED_MODELS:-"llama-3.2-1b qwen3-moe-2b"}
SERVED_USERS=${SERVED_USERS:-"1 16 64"}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH=$REPO:$REPO/kernels:$REPO/operator:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export KUBEINFER_TEST_SMOLLM2_DIR=$MODELS_DIR/smollm2-135m
LIMIT_TESTS=${LIMIT_TESTS:-200} LIMIT_KERNELS=${LIMIT_KERNELS:-100} LIMIT_SERVED=${LIMIT_SERVED:-210}
DEADLINE_S=${DEADLINE_S:-480}
export REPO WHEELS CARRIED OUT LOGS PY MODELS_DIR TEST_PATHS SERVED_MODELS SERVED_USERS
export LIMIT_TESTS LIMIT_KERNELS LIMIT_SERVED DEADLINE_S

step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND under its limit, says how it ended and how long it took
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    # within the whole run's DEADLINE_S, with 20 s left for the logs: a device call ends at its timeout_s
    local left=$((DEADLINE_S - SECONDS - 20))
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$limit" -lt 30 ]; then
        echo "=== $name: skipped, ${left}s left of DEADLINE_S=$DEADLINE_S"
        return
    fi
    export STEP_LIMIT=$limit
    echo "=== $name: start $(date -u +%T), limit ${limit}s"
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "=== $name: rc=$rc after $((SECONDS - t0))s"
}

finish() {
    # the logs alone (pytest's folders are under --basetemp, elsewhere): one file, well under 16 MiB
    (cd "$LOGS" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.err' \) -print0 |
        tar -czf "$OUT/logs.tar.gz" --null -T -) 2>/dev/null
    echo "=== done $(date -u +%T); under $OUT: $(ls "$OUT" | tr '\n' ' ')"
    exec 1>&- 2>&-
    wait "$TEE_PID" 2>/dev/null  # session.log complete before the call returns
}
trap finish EXIT

env_step() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    if [ -d "$WHEELS" ] && [ -z "${NO_WHEELS:-}" ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl || return 1
    fi
    $PY - <<'EOF'
import platform, torch, triton, transformers
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "transformers", transformers.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
          "memory GiB", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
import server.engine, server.api.app  # noqa: F401,E401  (every import the server makes at start)
print("server imports: ok")
EOF
    [ -f "$KUBEINFER_TEST_SMOLLM2_DIR/config.json" ] ||
        $PY benchmarks/real_shape_models.py --models smollm2-135m --gguf --out "$MODELS_DIR" \
            --tokenizer-from "$CARRIED/smollm2-tokenizer" > /dev/null
}

tests_step() {
    # shellcheck disable=SC2086  # TEST_PATHS is a list of paths
    # its own limit inside the step's, so that the summary below is still printed
    # 8 workers on 16 cores: transformers' CPU references with 2 threads each
    OMP_NUM_THREADS=2 timeout $((STEP_LIMIT - 15)) $PY -m pytest -p no:cacheprovider -q -rfE --basetemp /tmp/pytest-gpu -n "${TEST_WORKERS:-8}" --dist loadfile --timeout 240 \
        --junitxml "$OUT/junit.xml" $TEST_PATHS > "$LOGS/pytest.log" 2>&1
    local rc=$?
    grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/pytest.log" | cut -c1-220 | tail -45
    return $rc
}

kernels_step() {
    timeout $((STEP_LIMIT - 10)) $PY benchmarks/kernel_bench.py > "$OUT/kernels.json" 2> "$LOGS/kernel_bench.err"
    local rc=$?
    tail -5 "$LOGS/kernel_bench.err"
    $PY - "$OUT/kernels.json" <<'EOF'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    sys.exit(f"no kernel JSON: {e}")
for r in doc.get("results", []):
    print(r["kernel"], r["config"], "triton", round(r["triton_ms"], 4), "ms", "torch", round(r["torch_ms"], 4),
          "x", round(r["speedup"], 2), "GB/s", r["gbps"] and round(r["gbps"]), "TF", r["tflops"] and round(r["tflops"], 1),
          "diff", r["max_abs_diff"])
EOF
    return $rc
}

served_step() {
    # shellcheck disable=SC2086  # SERVED_MODELS is a list of names
    $PY benchmarks/real_shape_models.py --models $SERVED_MODELS --gguf --reuse --out "$MODELS_DIR" \
        --tokenizer-from "$CARRIED/smollm2-tokenizer" > /dev/null || return 1
    # shellcheck disable=SC2086
    # the time the models took counted (SECONDS starts at 0 in this bash -c), so this ends before the step
    timeout $((STEP_LIMIT - 15 - SECONDS)) $PY benchmarks/real_shapes_served.py --models $SERVED_MODELS --models-dir "$MODELS_DIR" --phases ours-hf \
        --users $SERVED_USERS --long-prompt-tokens 4096 --rounds 1 --max-tokens 64 --ready-timeout 150 \
        --out "$OUT/served.json" > /dev/null 2> "$LOGS/served.err"
    local rc=$?
    grep -v '^{' "$LOGS/served.err" | tail -8
    $PY - "$OUT/served.json" <<'EOF'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    sys.exit(f"no served JSON: {e}")
print("skipped:", doc.get("skipped"))
for r in doc.get("runs", []):
    print(r["model"], r["server"], r["load"], "tok/s", r.get("output_tokens_per_s"),
          "ttft p50", (r.get("ttft_s") or {}).get("p50"), "itl p99", (r.get("itl_s") or {}).get("p99"),
          "failed", r.get("failed"))
EOF
    return $rc
}

echo "=== gpu_session $(date -u +%FT%T) steps: ${STEPS[*]}; git $(git rev-parse --short HEAD 2>/dev/null)"
for s in "${STEPS[@]}"; do
    case $s in
        env) step env 120 bash -c "$(declare -f env_step); env_step" ;;
        tests) step tests "$LIMIT_TESTS" bash -c "$(declare -f tests_step); tests_step" ;;
        kernels) step kernels "$LIMIT_KERNELS" bash -c "$(declare -f kernels_step); kernels_step" ;;
        served) step served "$LIMIT_SERVED" bash -c "$(declare -f served_step); served_step" ;;
        *) echo "unknown step $s (env tests kernels served)" ;;
    esac
done
