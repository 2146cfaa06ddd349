#!/usr/bin/env bash
# Local launch: mpirun on this machine, one rank per core, one BLAS thread per rank.
#   NP=2 CONFIG=input/quickstart.json [OUTPUT=dir] [ZERO3D_ARGS="--set ..."] jobs/run_local.sh [extra zero3d train args]
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
CONFIG=${CONFIG:-input/quickstart.json}
ZERO3D=${ZERO3D:-build/zero3d}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
output=()
[ -n "${OUTPUT:-}" ] && output=(--output "$OUTPUT")
# shellcheck disable=SC2086  # ZERO3D_ARGS is a list of arguments, split as the other scripts split it
exec mpirun -np "$NP" "$ZERO3D" train "$CONFIG" "${output[@]}" ${ZERO3D_ARGS:-} "$@"
