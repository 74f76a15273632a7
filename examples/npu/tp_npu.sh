#!/usr/bin/env bash
# Launch examples/npu/tp_npu.py on one Ascend node (8 NPUs by default). Extra arguments are passed on.
#   NPROC=8 bash examples/npu/tp_npu.sh [--steps 10] [--device npu]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Ascend runtime environment (CANN): source set_env.sh if it is not already in the environment.
if [ -z "${ASCEND_HOME_PATH:-}" ] && [ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]; then
  source /usr/local/Ascend/ascend-toolkit/set_env.sh
fi
torchrun --nproc_per_node "${NPROC:-8}" --master_port "${MASTER_PORT:-29500}" examples/npu/tp_npu.py --tp-size 2 --pp-size 2 "$@"
