#!/usr/bin/env bash
# The checks that need a GPU, as one run (docs/tests.md, "On a GPU"): the codec's throughput on the card
# for every wire format, then every `gpu` test (tests/gpu and the CUDA tests of tests/core) on CUDA and
# NCCL. Logs and JSON go to OUT_DIR; the exit status is the test run's.
#
#     scripts/gpu_check.sh OUT_DIR
#
# Run from the repository root on a machine with torch for CUDA. DeepSpeed and FairScale may come as
# wheels in .whl/ (they are installed to /tmp/site first); --compile's tests are left out (-k), each
# compiles for about a minute: `python -m pytest -m gpu` runs them.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, deepspeed, fairscale; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'deepspeed', deepspeed.__version__, 'fairscale', fairscale.__version__)"; } 2>&1 | tee "$out/card.txt"
timeout "${CODEC_TIMEOUT_S:-120}" python3 -m scripts.bench_wire --codec_only --codec_device cuda \
    --codec_elements 100000000 --repeats 5 --out_dir "$out" 2>&1 | tee "$out/codec.log"
timeout "${TESTS_TIMEOUT_S:-450}" python3 -m pytest -m gpu -k "not compile" -q -p no:cacheprovider --durations 15 \
    --junitxml "$out/pytest_gpu.xml" tests/gpu tests/core 2>&1 | tee "$out/pytest_gpu.log"
