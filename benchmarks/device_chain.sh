#!/bin/bash
# The reference benchmark as one background chain on the lent GPU machine, collected over several device
# commands (at most 10 minutes each; the machine stays warm only ~30 s between commands, so issue the next
# one at once):
#
#   bash benchmarks/device_chain.sh start    # first command: starts the chain, then waits like `wait`
#   bash benchmarks/device_chain.sh wait     # every next command, until the log says CHAIN DONE
#
# The chain: tests/test_decode_gpu.py (beside the target build) -> run_all target -> pipeline, bench,
# summary -> where .whl/ holds speculators' wheels (benchmarks/peer_speculators.py lists them; name .whl in
# the device call's carry), run_all peer -> run_all extract_speed_reference (shards in RAM), profile, summary. Each
# command returns $OUT/chain.tgz (runs/chain: run_all's figures, logs, the run's reports and bench), re-packed
# every 60 s, so a command cut off by the device budget still brings back what was done.
# Environment: RUN_ALL_FLAGS (e.g. "--bench-methods plain,chain,tree" to leave out the slow HF peers;
# with --no-draft-lm for the target part too), CHAIN_SPEED=0 (leave out extract_speed_reference and
# profile), CHAIN_PEER_FIRST=1 (the peer right after the pipeline's training, before the bench: a budget
# that runs short then cuts the bench, not the peer), WAIT_S (default 560 s per command), EAGLEKIT_COMMIT
# (the commit the JSON files name: write the hash of the tree you send into the device command, since the
# machine's copy of .git may be stale).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src"
RESULTS=runs/chain
WORK=runs/reference
LOG=runs/chain.log
FLAGS=${RUN_ALL_FLAGS:-}

chain() {
    log() { echo "[chain $(date +%T)] $*"; }
    peer() {
        [ -d .whl ] || return 0
        # the peer's libraries go to a folder only the peer's process sees
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            > "$RESULTS/peer.log" 2>&1
        python3 -c "import pyarrow; print('pyarrow', pyarrow.__version__)" >> "$RESULTS/peer.log" 2>&1
        EAGLEKIT_PEER_SITE=/tmp/site python3 benchmarks/run_all.py --parts peer,summary $FLAGS --work "$WORK" \
            --out "$RESULTS" >> "$RESULTS/peer.log" 2>&1
        log "peer rc=$?"
    }
    mkdir -p "$RESULTS"
    log start
    (python3 -m pytest -x -q -p no:warnings tests/test_decode_gpu.py > "$RESULTS/test_decode_gpu.log" 2>&1
     echo "rc=$?" >> "$RESULTS/test_decode_gpu.log") &
    python3 benchmarks/run_all.py --parts target $FLAGS --work "$WORK" --out "$RESULTS" > "$RESULTS/target.log" 2>&1
    log "target rc=$?"
    wait
    log "test_decode_gpu $(tail -1 "$RESULTS/test_decode_gpu.log")"
    if [ "${CHAIN_PEER_FIRST:-0}" = 1 ]; then
        python3 benchmarks/run_all.py --parts pipeline $FLAGS --work "$WORK" --out "$RESULTS" > "$RESULTS/pipeline.log" 2>&1
        log "pipeline rc=$?"
        peer
    fi
    python3 benchmarks/run_all.py --parts pipeline,bench,summary $FLAGS --work "$WORK" --out "$RESULTS" > "$RESULTS/bench.log" 2>&1
    log "pipeline, bench rc=$?"
    [ "${CHAIN_PEER_FIRST:-0}" = 1 ] || peer
    if [ "${CHAIN_SPEED:-1}" = 1 ]; then
        python3 benchmarks/run_all.py --parts extract_speed_reference,profile,summary $FLAGS --work "$WORK" --out "$RESULTS" \
            > "$RESULTS/extract_profile.log" 2>&1
        log "extract_speed_reference, profile rc=$?"
    fi
    log "CHAIN DONE"
}

pack() {
    local run="$WORK/run" into="$RESULTS/run"
    mkdir -p "$into"
    for f in run.json report.md report-training.png report-acceptance.png train/metrics.jsonl; do
        [ -f "$run/$f" ] && cp "$run/$f" "$into/"
    done
    [ -d "$run/bench" ] && cp -r "$run/bench" "$into/"
    [ -f "$run/peer_speculators/peer/speculators_train.log" ] && tail -c 200000 "$run/peer_speculators/peer/speculators_train.log" \
        > "$RESULTS/speculators_train.log"
    for m in reference_target draft_lm; do
        [ -f "$WORK/models/$m/training_report.json" ] && cp "$WORK/models/$m/training_report.json" "$RESULTS/$m.json"
    done
    cp "$LOG" "$RESULTS/" 2>/dev/null
    tar czf "$OUT/chain.tgz.tmp" "$RESULTS" && mv "$OUT/chain.tgz.tmp" "$OUT/chain.tgz"
}

wait_for_chain() {
    local end=$((SECONDS + ${WAIT_S:-560})) packed=0
    while [ $SECONDS -lt $end ] && ! grep -q "CHAIN DONE" "$LOG" 2>/dev/null; do
        if [ $((SECONDS - packed)) -ge 60 ]; then pack; packed=$SECONDS; fi
        sleep 5
    done
    pack
    tail -20 "$LOG"
}

case "${1:-}" in
    start)
        mkdir -p runs
        export -f chain
        export RESULTS WORK FLAGS
        setsid nohup bash -c chain > "$LOG" 2>&1 < /dev/null &
        sleep 3
        wait_for_chain ;;
    wait) wait_for_chain ;;
    *) echo "usage: $0 start|wait" >&2; exit 2 ;;
esac
