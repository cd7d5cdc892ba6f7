#!/usr/bin/env bash
# The one short device check for a session lent a GPU machine (docs/operations.md, "GPU").
# There, python3 already holds a CUDA torch; this project's other runtime packages travel
# as cp312 wheels in .whl/ (`make gpu-wheels` here). Writes its logs under $OUT.
set -uo pipefail
out=${OUT:-/tmp/blockgrad-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 BLOCKGRAD_DEVICE=cuda
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'; } 2>&1 | tee "$out/gpu.txt"
# Every CUDA test (they skip on CPU-only machines) plus the engine's reference tests, on the GPU.
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_device.py tests/test_oom.py \
  tests/test_api.py tests/test_models.py tests/test_batched_engine.py tests/test_factor_advice.py 2>&1 | tee "$out/pytest.txt"
# End to end through gunicorn with BLOCKGRAD_DEVICE=cuda, one worker: the request sizes.
WEB_CONCURRENCY=1 timeout 240 python3 -m bench http_vs_floor small_requests v2_binary_infer 2>&1 | tee "$out/bench.txt"
# Issue 12's model scorer (MLP 2D -> 256 -> 1, N=512, D=64) in process on the GPU: engine vs plain loop and floor.
timeout 180 python3 -m bench model_scorer 2>&1 | tee "$out/bench-model.txt"
# Issue 10's default-factor rows on the GPU: in process (bench/inprocess.py follows
# BLOCKGRAD_DEVICE) and through gunicorn; the seed-loop row is CPU work and is left out.
WEB_CONCURRENCY=1 timeout 180 python3 -m bench default_factor_vs_16 default_factor_http_vs_floor \
  advice_leads_somewhere_fast 2>&1 | tee "$out/bench-default-factor.txt"
