#!/usr/bin/env bash
# PBS/Torque job: mpiexec over the nodes PBS assigned.
#   qsub -l select=2:ncpus=32:mpiprocs=32 -v CONFIG=input/gpt-small-cpu.json jobs/pbs.sh
#PBS -N zero3d
#PBS -l walltime=01:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"
CONFIG=${CONFIG:-input/quickstart.json}
ZERO3D=${ZERO3D:-build/zero3d}
NP=${NP:-$(wc -l < "${PBS_NODEFILE:-/dev/null}" 2>/dev/null || echo 1)}
OUTPUT=${OUTPUT:-output/zero3d-${PBS_JOBID:-local}}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
mpiexec -np "$NP" "$ZERO3D" train "$CONFIG" --output "$OUTPUT" ${ZERO3D_ARGS:-}
