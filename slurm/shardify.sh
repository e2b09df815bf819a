#!/bin/bash
# Submit the sharding of SRC into OUT as an array of N tasks plus a merge job that runs when all succeeded.
#
#   slurm/shardify.sh SRC OUT N [shardify write options ...]
#   slurm/shardify.sh /data/train.jsonl /shared/ds/train 32 --shuffle --seed 1 --max-size 1G
#
# sbatch options for both jobs: SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT, ... in the environment, or
# SBATCH_ARGS="--qos=... --cpus-per-task=8" for the array job. Prints the two job ids; the last line is the
# merge job's id.
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,9p' "$0" >&2
  exit 2
fi
SRC=$1 OUT=$2 N=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
case "$N" in ''|*[!0-9]*|0) echo "N must be a positive number, not '$N'" >&2; exit 2 ;; esac
# the jobs get this environment (sbatch's default --export=ALL): no quoting trouble with commas in paths
export SRC OUT SHARDIFY_ARGS="$*"
unset PARTS
# shellcheck disable=SC2086
array=$(sbatch --parsable --array="0-$((N - 1))" ${SBATCH_ARGS:-} "$here/shardify_array.sbatch")
array=${array%%;*}
# shellcheck disable=SC2086
merge=$(sbatch --parsable --dependency="afterok:$array" --kill-on-invalid-dep=yes ${MERGE_SBATCH_ARGS:-} \
  "$here/shardify_merge.sbatch")
merge=${merge%%;*}
echo "array job $array: $N tasks writing parts of $SRC to $OUT"
echo "merge job $merge (after all of $array succeed)"
echo "$merge"
