#!/bin/bash
# Lists a SLURM job's training processes for Prometheus (file_sd): process i serves
# RunConfig.prometheus_port + i on the node of task i. In the batch script, before srun:
#   bash monitoring/slurm_targets.sh 9400 /shared/prometheus-targets
# writes /shared/prometheus-targets/longt5-$SLURM_JOB_ID.json (prometheus-slurm.yml reads that
# directory). Tasks are placed by SLURM's default block distribution, as train.sbatch's srun
# places them: the first node's tasks are processes 0, 1, ..., then the next node's.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: bash monitoring/slurm_targets.sh PORT DIRECTORY" >&2
  exit 2
fi
port=$1
dir=$2
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
# Tasks per node in node order, e.g. '4(x8)' (4 on each of 8 nodes) or '2,1'.
counts=()
IFS=',' read -ra groups <<< "$SLURM_TASKS_PER_NODE"
for group in "${groups[@]}"; do
  if [[ $group =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
    for ((r = 0; r < BASH_REMATCH[2]; r++)); do counts+=("${BASH_REMATCH[1]}"); done
  else
    counts+=("$group")
  fi
done
targets=()
process=0
for i in "${!nodes[@]}"; do
  for ((t = 0; t < ${counts[i]:-0}; t++)); do
    targets+=("\"${nodes[i]}:$((port + process))\"")
    process=$((process + 1))
  done
done
mkdir -p "$dir"
file="$dir/longt5-$SLURM_JOB_ID.json"
# Written aside and renamed: Prometheus never reads half a file.
printf '[{"targets": [%s], "labels": {"slurm_job": "%s"}}]\n' \
  "$(IFS=,; echo "${targets[*]}")" "$SLURM_JOB_ID" > "$file.tmp"
mv "$file.tmp" "$file"
echo "$file"
