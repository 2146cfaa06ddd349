#!/usr/bin/env bash
# Local launch: mpirun on this machine, one rank per core, one BLAS thread per rank.
#   NP=2 CONFIG=input/quickstart.json jobs/run_local.sh [extra zero3d train args]
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
CONFIG=${CONFIG:-input/quickstart.json}
ZERO3D=${ZERO3D:-build/zero3d}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
exec mpirun -np "$NP" "$ZERO3D" train "$CONFIG" "$@"
