#!/usr/bin/env bash
# The OpenAI server on a CUDA device: serving_throughput.py against the
# synthetic SmolLM2-135M-shaped model (cuda_check_support.py writes it as a
# Hugging Face folder; the bundled GGUF is not assumed on a CUDA host).
#
# On a CUDA host, from the repository root, with the server's packages installed
# (fastapi, starlette, uvicorn, pydantic and their dependencies):
#
#     bash benchmarks/cuda_serving.sh OUT_DIR
#
# Each dtype runs the levels 16,64,16,64: graphs are captured lazily, the first
# time a (batch, width) bucket is reached, so the first pass of each level pays
# for captures and the second is the figure to read. Server logs land in OUT.
# Overrides: DTYPES (default "bfloat16 float32"), SERVING_ARGS (replaces the
# serving_throughput.py flags after --model/--dtype), DEVICE (default cuda),
# PYSPY=1 (record the server and client with py-spy, carried as a wheel in .whl
# too, into OUT/pyspy_DTYPE.txt: raw collapsed stacks with thread names).
set -u
out=${1:-/tmp/cuda_serving}
mkdir -p "$out"
export PYTHONPATH=src
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:src
fi
export PYTHONUNBUFFERED=1
model=/tmp/synthetic-smollm2
[ -f $model/model.safetensors ] || python3 benchmarks/cuda_check_support.py $model || exit 1
status=0
for dtype in ${DTYPES:-bfloat16 float32}; do
    spy=()
    if [ "${PYSPY:-0}" = 1 ]; then
        spy=("$(command -v py-spy || echo /tmp/site/bin/py-spy)" record --subprocesses --threads --idle -r 100
             -f raw -o "$out/pyspy_$dtype.txt" --)
    fi
    TOKENMILL_BENCH_SERVER_LOG=$out/server_$dtype.log timeout 300 "${spy[@]}" python3 benchmarks/serving_throughput.py \
        --model $model --dtype $dtype ${SERVING_ARGS:---concurrency 16,64,16,64 --waves 2 --kv-cache-memory 4GiB} \
        --server-args "--device ${DEVICE:-cuda}" 2>&1 | tee "$out/serving_$dtype.txt" || status=1
done
exit $status
