#!/usr/bin/env bash
# Progress under a launcher writing into a pipe: ringzero-run forwards each rank's lines as they
# come, and the GPT demo writes its stdout a line at a time, so its first step line arrives while
# it trains, well before its last line. Before, stdout into a pipe was block-buffered and every
# line came out when the ranks exited, within milliseconds of each other.
#
#   live_output.sh RINGZERO_RUN RINGZERO_GPT
set -euo pipefail
run=$1
gpt=$2
first="" last=""
while IFS= read -r line; do
  now=$(date +%s%3N)
  [[ -z $first && $line == step* ]] && first=$now
  last=$now
done < <("$run" -n 2 -- "$gpt" --steps 30 --log-every 1 --sample 0 2>/dev/null)
if [[ -z $first ]]; then
  echo "live_output: no step line came out" >&2
  exit 1
fi
spread=$((last - first))
echo "live_output: the first step line came ${spread} ms before the last line"
if ((spread < 300)); then
  echo "live_output: the lines came out together, at the end (block-buffered)" >&2
  exit 1
fi
