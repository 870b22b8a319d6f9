#!/usr/bin/env bash
# The load lane: runs the command given (the suite) with two busy-loop processes beside it, one pinned to each of the
# first two cores, at the same priority, as another job on a shared CI host would be; they stop with the command,
# whose exit status this returns. `make test-load`; docs/testing.md.
set -u
cores=$(nproc)
busy=()
for core in 0 1; do
    taskset -c $((core % cores)) bash -c 'while :; do :; done' &
    busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null; wait "${busy[@]}" 2>/dev/null' EXIT
"$@"
