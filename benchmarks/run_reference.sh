#!/bin/bash
# The reference benchmark (benchmarks/run_all.py) as one background job on a GPU host. The job keeps running
# when the shell that started it closes; its figures, logs and reports collect in runs/reference-results/.
#
#   bash benchmarks/run_reference.sh start     # start the job (nohup; pid in runs/reference.pid, log in
#                                              # runs/reference.log)
#   bash benchmarks/run_reference.sh wait      # follow the log until the job ends, then print its tail
#   bash benchmarks/run_reference.sh collect   # copy the run's reports into the results and pack them into
#                                              # runs/reference-results.tgz (also while the job runs)
#
# The job, about 30 minutes on one H200: tests/test_decode_gpu.py (beside the target's build) -> run_all target
# -> pipeline, bench, summary -> step_cost -> variant -> the speculators peer (when PEER_WHEELS names a folder
# of its wheels: benchmarks/peer_speculators.py lists them) -> extract_speed_reference (shards in RAM), profile,
# summary.
# Environment:
#   RUN_ALL_FLAGS         flags for every run_all part, e.g. "--no-draft-lm --bench-methods plain,chain,tree" to
#                         leave out the slow HF peers (split on spaces: no quoted values inside)
#   REFERENCE_STEP_COST=0 leave out step_cost (8B-shaped step costs, random weights, with the bench's tau projected)
#   REFERENCE_VARIANT=0   leave out the variant drafter (run_all --variant, default EAGLE 3.1: fc_norm + norm_output)
#   REFERENCE_SPEED=0     leave out extract_speed_reference and profile
#   REFERENCE_PEER_FIRST=1  run the peer right after the pipeline's training, before the bench
#   PEER_WHEELS           folder of speculators' wheels (default .whl); installed into runs/peer-site, a folder
#                         only the peer's process sees, so its pinned libraries never shadow eaglekit's
#   WAIT_S                `wait` returns after this many seconds even if the job runs on (default 0: no limit)
#   PYTHON                the Python with eaglekit's dependencies (default python3)
#   EAGLEKIT_COMMIT       the commit the JSON files name, for a copied tree without .git
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=runs/reference-results
WORK=runs/reference
LOG=runs/reference.log
PID=runs/reference.pid
FLAGS=${RUN_ALL_FLAGS:-}
WHEELS=${PEER_WHEELS:-.whl}
PYTHON=${PYTHON:-python3}

job() {
    log() { echo "[reference $(date +%T)] $*"; }
    run_all() {  # run_all.py PARTS LOGNAME
        "$PYTHON" benchmarks/run_all.py --parts "$1" $FLAGS --work "$WORK" --out "$RESULTS" > "$RESULTS/$2.log" 2>&1
        log "$1 rc=$?"
    }
    peer() {
        [ -d "$WHEELS" ] || { log "peer skipped: no wheels in $WHEELS"; return 0; }
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target runs/peer-site \
            "$WHEELS"/*.whl > "$RESULTS/peer.log" 2>&1
        EAGLEKIT_PEER_SITE="$PWD/runs/peer-site" "$PYTHON" benchmarks/run_all.py --parts peer,summary $FLAGS \
            --work "$WORK" --out "$RESULTS" >> "$RESULTS/peer.log" 2>&1
        log "peer rc=$?"
    }
    mkdir -p "$RESULTS"
    log start
    ("$PYTHON" -m pytest -x -q -p no:warnings tests/test_decode_gpu.py > "$RESULTS/test_decode_gpu.log" 2>&1
     echo "rc=$?" >> "$RESULTS/test_decode_gpu.log") &
    run_all target target
    wait
    log "test_decode_gpu $(tail -1 "$RESULTS/test_decode_gpu.log")"
    if [ "${REFERENCE_PEER_FIRST:-0}" = 1 ]; then
        run_all pipeline pipeline
        peer
    fi
    run_all pipeline,bench,summary bench
    [ "${REFERENCE_STEP_COST:-1}" = 1 ] && run_all step_cost,summary step_cost
    [ "${REFERENCE_VARIANT:-1}" = 1 ] && run_all variant,summary variant
    [ "${REFERENCE_PEER_FIRST:-0}" = 1 ] || peer
    [ "${REFERENCE_SPEED:-1}" = 1 ] && run_all extract_speed_reference,profile,summary extract_profile
    log DONE
}

running() {
    [ -f "$PID" ] && kill -0 "$(cat "$PID")" 2>/dev/null
}

collect() {
    local run="$WORK/run" into="$RESULTS/run"
    mkdir -p "$into"
    for f in run.json report.md report-training.png report-acceptance.png train/metrics.jsonl; do
        [ -f "$run/$f" ] && cp "$run/$f" "$into/"
    done
    [ -d "$run/bench" ] && cp -r "$run/bench" "$into/"
    local peer_log="$run/peer_speculators/peer/speculators_train.log"
    [ -f "$peer_log" ] && tail -c 200000 "$peer_log" > "$RESULTS/speculators_train.log"
    for m in reference_target draft_lm; do
        [ -f "$WORK/models/$m/training_report.json" ] && cp "$WORK/models/$m/training_report.json" "$RESULTS/$m.json"
    done
    [ -f "$LOG" ] && cp "$LOG" "$RESULTS/"
    tar czf "$RESULTS.tgz.tmp" "$RESULTS" && mv "$RESULTS.tgz.tmp" "$RESULTS.tgz"
    echo "packed $RESULTS.tgz"
}

follow() {
    local limit=${WAIT_S:-0}
    while running && { [ "$limit" = 0 ] || [ $SECONDS -lt "$limit" ]; }; do
        sleep 5
    done
    tail -20 "$LOG"
    running && echo "still running (pid $(cat "$PID")); \`$0 wait\` again" || true
}

case "${1:-}" in
    start)
        if running; then echo "already running (pid $(cat "$PID"))" >&2; exit 1; fi
        mkdir -p runs
        export -f job
        export RESULTS WORK FLAGS WHEELS PYTHON
        nohup setsid bash -c job > "$LOG" 2>&1 < /dev/null &
        echo $! > "$PID"
        echo "started (pid $(cat "$PID")); log: $LOG" ;;
    wait) follow ;;
    collect) collect ;;
    *) echo "usage: $0 start|wait|collect" >&2; exit 2 ;;
esac
