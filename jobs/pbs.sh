#!/usr/bin/env bash
# PBS Pro / Torque job: mpiexec over the slots PBS assigned. PBS sends SIGTERM before it kills
# a job (qdel, preemption, walltime with kill_delay): every rank finishes its step, saves a
# checkpoint and exits 75, and this script reruns the job (qrerun), which resumes from that
# checkpoint (training.resume "auto") in the same output directory.
#   qsub -l select=2:ncpus=32:mpiprocs=32 -v CONFIG=input/gpt-small-cpu.json jobs/pbs.sh
#PBS -N zero3d
#PBS -l walltime=01:00:00
#PBS -j oe
#PBS -r y
set -uo pipefail
cd "${PBS_O_WORKDIR:-.}"
CONFIG=${CONFIG:-input/quickstart.json}
ZERO3D=${ZERO3D:-build/zero3d}
# One rank per slot in PBS's node file; outside PBS (or with an empty file) NP, else 1.
if [ -z "${NP:-}" ]; then
  NP=1
  if [ -n "${PBS_NODEFILE:-}" ] && [ -s "$PBS_NODEFILE" ]; then NP=$(wc -l < "$PBS_NODEFILE"); fi
fi
# One directory per job name (PBS_JOBNAME), so that a rerun continues the same run.
OUTPUT=${OUTPUT:-output/${PBS_JOBNAME:-zero3d}}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
mpiexec -np "$NP" "$ZERO3D" train "$CONFIG" --output "$OUTPUT" --set training.resume=auto ${ZERO3D_ARGS:-}
rc=$?
if [ "$rc" -eq 75 ] && [ -n "${PBS_JOBID:-}" ]; then  # preempted after a save: run again from it
  echo "zero3d saved on the scheduler's signal; rerunning job $PBS_JOBID"
  qrerun "$PBS_JOBID"
  exit 0
fi
exit "$rc"
