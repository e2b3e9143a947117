# Sourced by tests/run_gpu_checks.sh (tested on the CPU by tests/environments/gpu/test_gpu_checks_steps.py): its steps under time limits
# cut to what is left before DEADLINE_S (seconds since the script started, bash's SECONDS), and the closing
# list of what did not run and what failed.
NOT_RUN=() FAILED=() ABSENT=()  # ABSENT: steps this machine's GPUs cannot hold (not a failure)
left() { echo $((DEADLINE_S - SECONDS)); }
# step NAME LIMIT_S MIN_S LOG TAIL COMMAND...: COMMAND (output to LOG, its last TAIL lines shown) under a time
# limit of LIMIT_S cut to what is left before the deadline (minus 10 s for the summary); not run where less
# than MIN_S is left. Records a failure or a timeout; returns COMMAND's exit status. Never in a pipeline
# (a subshell would lose the records).
step() {
    local name=$1 limit=$2 min=$3 log=$4 tail=$5
    shift 5
    local room=$(($(left) - 10))
    if [ "$room" -lt "$min" ]; then
        NOT_RUN+=("$name: ${room} s left before the ${DEADLINE_S} s deadline, it needs ${min} s")
        echo "== $name: not run (${room} s left before the deadline)"
        return 0
    fi
    [ "$room" -lt "$limit" ] && limit=$room
    echo "== $name (time limit ${limit} s)"
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$?
    tail -n "$tail" "$log"
    if [ "$rc" -eq 124 ]; then
        FAILED+=("$name: timed out after ${limit} s (log: $log)")
    elif [ "$rc" -ne 0 ]; then
        FAILED+=("$name: exit status $rc (log: $log)")
    fi
    return "$rc"
}
summary() {  # what did not run and what failed; exit status 1 where a step failed or the deadline left it out
    echo "== summary after ${SECONDS} s"
    local line
    for line in "${ABSENT[@]}"; do echo "not run here: $line"; done
    for line in "${NOT_RUN[@]}"; do echo "not run: $line"; done
    for line in "${FAILED[@]}"; do echo "FAILED: $line"; done
    if [ "${#NOT_RUN[@]}" -eq 0 ] && [ "${#FAILED[@]}" -eq 0 ]; then
        echo "every step this machine can hold ran and passed"
        return 0
    fi
    return 1
}
