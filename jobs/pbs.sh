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
# PBS signals every process of the job, this shell too: a trap keeps it alive (bash runs it once
# mpiexec returns) so that it can requeue. The ranks get the default disposition and save.
trap 'echo "jobs/pbs.sh: SIGTERM received; waiting for the ranks to save"' TERM
rm -f "$OUTPUT/requeue"
mpiexec -np "$NP" "$ZERO3D" train "$CONFIG" --output "$OUTPUT" --set training.resume=auto ${ZERO3D_ARGS:-}
rc=$?
# 75, or the note zero3d leaves beside it (mpiexec signalled with its ranks may exit 0 instead).
if { [ "$rc" -eq 75 ] || [ -e "$OUTPUT/requeue" ]; } && [ -n "${PBS_JOBID:-}" ]; then  # preempted after a save: run again from it
  echo "zero3d saved on the scheduler's signal; rerunning job $PBS_JOBID"
  qrerun "$PBS_JOBID"
  exit 0
fi
exit "$rc"
