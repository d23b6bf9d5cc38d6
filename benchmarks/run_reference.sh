#!/bin/bash
# The reference benchmark (benchmarks/run_all.py) as one background job on a GPU host. The job keeps running
# when the shell that started it closes; its figures, logs and reports collect in runs/<job>-results/.
#
#   bash benchmarks/run_reference.sh start [JOB]     # start the job (nohup; pid in runs/<job>.pid, log in
#                                                    # runs/<job>.log)
#   bash benchmarks/run_reference.sh wait [JOB]      # follow the log until the job ends, then print its tail
#   bash benchmarks/run_reference.sh collect [JOB]   # copy the run's reports into the results and pack them into
#                                                    # runs/<job>-results.tgz (also while the job runs)
#
# JOB `reference` (the default), about 30 minutes on one H200, in runs/reference and runs/reference-results:
# tests/test_decode_gpu.py (beside the target's build) -> run_all target -> pipeline, bench, summary -> step_cost
# -> variant -> the speculators peer (when PEER_WHEELS names a folder of its wheels: benchmarks/peer_speculators.py
# lists them) -> extract_speed_reference (shards in RAM), profile, summary.
#
# JOB `drafters`: the drafter types side by side, DSpark beside DFlash, cut to about 20 minutes on one H200
# (run_all --quick: a 600-step target, 500-step drafters; no HF peers, no draft LM; DRAFTERS_RECIPE=full: the
# reference recipe's 1,200-step target and 1,100-step drafters, about 5 minutes more), in runs/drafters and
# runs/drafters-results. Each part runs the summary after it, so summary.json/summary.md hold every figure measured
# so far, and each part's own JSON lands as it finishes (a job cut off keeps the parts before):
#   target        ~3 min    the reference target (run_all --quick --parts target), and meanwhile
#                           tests/test_decode_gpu.py (the compiled fused steps equal the eager ones, DSpark's too)
#                                                                                      reference_target.json
#   step_cost     ~4 min    8B-shaped steps (random weights, so right after the target: a job cut off later
#                           keeps them): plain, DFlash at k = 7, DSpark at k = 7 over every draft id and with its
#                           Markov bias on 64 candidates (draft_topk), both with the variants' 2 layers, each with
#                           its drafting part alone and its floor                      step_cost_8b.json
#   store         ~1.5 min  the run up to its training data: regen, extract, vocab
#   train         ~3 min    three processes side by side on the GPU: the run's EAGLE-3 drafter and the DSpark
#                           and DFlash variants (run_all --variant-only train)
#   drafters      ~2 min    each variant benched alone (run_all --variant-only bench), on the run's held-out
#                           prompts (as the run's bench below):
#                           variant drafter_type=dspark,block_size=8,draft_layers=2 (the same backbone): method
#                           dspark, a chain of 8 (every block slot drafts), its calibration; with bench's
#                           verify_thresholds option (when this eaglekit's bench has it), also a row per
#                           threshold (DSPARK_VERIFY_THRESHOLDS, about 15 s each once compiled)
#                                                                                      variant_dspark.json
#                           variant drafter_type=dflash,block_size=8,draft_layers=2: method dflash, a chain of 7
#                                                                                      variant_dflash.json
#   bench         ~2 min    the run's bench (after the variants: DSpark against DFlash needs only theirs): plain,
#                           chain and tree at T=0 and T=1 on 8 held-out prompts, 3 timed runs a prompt (the median
#                           kept) after one warm-up pass; plain is every speed-up's base  run/bench/bench.json
#   probes        ~2 min    benchmarks/block_probe.py on the DSpark drafter, then the DFlash one: decoded acceptance
#                           per position against the training forward's on the same answers
#                                                                      block_probe_dspark.json, block_probe_dflash.json
# Times are estimates for an H200 (the target, pipeline and bench were measured together at 8.5 minutes on an
# H100); most of step_cost's is compiling the 8B-shaped graphs, one fused step per (drafter, k).
#
# Environment:
#   RUN_ALL_FLAGS         flags for every run_all part, e.g. "--no-draft-lm --bench-methods plain,chain,tree" to
#                         leave out the slow HF peers (split on spaces: no quoted values inside; JOB drafters sets
#                         its own, these come after them)
#   REFERENCE_GPU_TESTS=0 leave out tests/test_decode_gpu.py (run beside the target's build)
#   REFERENCE_STEP_COST=0 leave out step_cost (8B-shaped step costs, random weights; JOB reference: with the bench's
#                         tau projected)
#   REFERENCE_VARIANT=0   leave out the variant drafter (run_all --variant, default EAGLE 3.1: fc_norm + norm_output)
#   REFERENCE_SPEED=0     leave out extract_speed_reference and profile
#   REFERENCE_PEER_FIRST=1  run the peer right after the pipeline's training, before the bench
#   PEER_WHEELS           folder of speculators' wheels (default .whl); installed into runs/peer-site, a folder
#                         only the peer's process sees, so its pinned libraries never shadow eaglekit's
#   DSPARK_VERIFY_THRESHOLDS  JOB drafters: the DSpark variant's bench verify_thresholds (default 0,0.3,0.5,0.7;
#                         empty: none)
#   STEP_COST_ARGS        JOB drafters: step_cost.py's flags (default: the shapes above; the published 5 layers:
#                         --dflash-layers 5 --dspark-layers 5; the Markov loop's candidates: --dspark-topk 0,K,...)
#   DRAFTERS_BENCH_METHODS  JOB drafters: the run's own bench methods (default plain,chain,tree; plain is the
#                         baseline of every variant's speed-up)
#   DRAFTERS_RECIPE       JOB drafters: quick (default) or full (run_all's own sizes, as JOB reference's)
#   DRAFTER_STEPS         JOB drafters: the DSpark and DFlash variants' training steps (default: the recipe's; e.g.
#                         1100 on the quick target and store, about 3 minutes more than 500)
#   WAIT_S                `wait` returns after this many seconds even if the job runs on (default 0: no limit)
#   PYTHON                the Python with eaglekit's dependencies (default python3)
#   EAGLEKIT_COMMIT       the commit the JSON files name, for a copied tree without .git
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
JOB=${2:-reference}
case "$JOB" in
    reference|drafters) ;;
    *) echo "unknown job '$JOB': reference or drafters" >&2; exit 2 ;;
esac
RESULTS=runs/$JOB-results
WORK=runs/$JOB
LOG=runs/$JOB.log
PID=runs/$JOB.pid
FLAGS=${RUN_ALL_FLAGS:-}
WHEELS=${PEER_WHEELS:-.whl}
PYTHON=${PYTHON:-python3}
VERIFY=${DSPARK_VERIFY_THRESHOLDS-0,0.3,0.5,0.7}
STEP_COST=${STEP_COST_ARGS:---shapes= --parts= --no-separate --dflash 7 --dflash-layers 2 --dspark 7 --dspark-layers 2 --dspark-topk 0,64}
RECIPE=${DRAFTERS_RECIPE:-quick}
case "$RECIPE" in
    quick|full) ;;
    *) echo "DRAFTERS_RECIPE=$RECIPE: quick or full" >&2; exit 2 ;;
esac
[[ ${DRAFTER_STEPS:-1} =~ ^[1-9][0-9]*$ ]] || { echo "DRAFTER_STEPS=$DRAFTER_STEPS: a step count >= 1" >&2; exit 2; }

log() { echo "[$JOB $(date +%T)] $*"; }

gpu_tests() {  # tests/test_decode_gpu.py into its log, its result into the job's (REFERENCE_GPU_TESTS=0: not run)
    [ "${REFERENCE_GPU_TESTS:-1}" = 1 ] || return 0
    "$PYTHON" -m pytest -x -q -p no:warnings tests/test_decode_gpu.py > "$RESULTS/test_decode_gpu.log" 2>&1
    echo "rc=$?" >> "$RESULTS/test_decode_gpu.log"
    log "test_decode_gpu $(tail -1 "$RESULTS/test_decode_gpu.log")"
}

run_all() {  # run_all.py PARTS LOGNAME [more run_all flags]
    local parts=$1 name=$2
    shift 2
    "$PYTHON" benchmarks/run_all.py --parts "$parts" "$@" $FLAGS --work "$WORK" --out "$RESULTS" \
        > "$RESULTS/$name.log" 2>&1
    log "$name: $parts rc=$?"
}

job() {
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
    gpu_tests &
    run_all target target
    wait
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

has_bench_option() {  # this eaglekit's bench stage takes option $1
    "$PYTHON" -c "import dataclasses, sys; from eaglekit.stages.bench import Config
sys.exit('$1' not in {f.name for f in dataclasses.fields(Config)})" 2>/dev/null
}

probe() {  # block_probe.py on variant $1's drafter: decoded against the training forward on the bench's prompts
    "$PYTHON" benchmarks/block_probe.py --work "$WORK" --drafter "$WORK/variant-$1/train" --backend static \
        --out "$RESULTS/block_probe_$1.json" > "$RESULTS/block_probe_$1.log" 2>&1
    log "block_probe $1 rc=$?"
}

drafters_job() {
    local quick="--no-draft-lm --bench-methods ${DRAFTERS_BENCH_METHODS:-plain,chain,tree} --bench-repeats 3" cut=()
    [ "$RECIPE" = quick ] && quick="--quick $quick"
    mkdir -p "$RESULTS"
    log start
    gpu_tests &
    run_all target,summary target $quick
    wait
    [ "${REFERENCE_STEP_COST:-1}" = 1 ] && run_all step_cost,summary step_cost $quick --step-cost-args="$STEP_COST"
    run_all store store $quick
    local steps=${DRAFTER_STEPS:+,max_steps=$DRAFTER_STEPS}
    local dspark="drafter_type=dspark,block_size=8,draft_layers=2$steps"
    local dflash="drafter_type=dflash,block_size=8,draft_layers=2$steps"
    # the run's drafter and the two variants train side by side (one GPU holds the three), then everything is
    # benched one at a time: no timing overlaps
    run_all pipeline pipeline $quick &
    run_all variant variant_dspark_train $quick --variant "$dspark" --variant-only train &
    run_all variant variant_dflash_train $quick --variant "$dflash" --variant-only train &
    wait
    if [ -n "$VERIFY" ] && has_bench_option verify_thresholds; then
        cut=(--variant-bench "verify_thresholds=$VERIFY")
    elif [ -n "$VERIFY" ]; then
        log "bench takes no verify_thresholds option: the DSpark variant is benched over its whole block only"
    fi
    run_all variant,summary variant_dspark $quick --variant "$dspark" --variant-only bench ${cut[@]+"${cut[@]}"}
    run_all variant,summary variant_dflash $quick --variant "$dflash" --variant-only bench
    run_all bench,summary bench $quick  # after the variants: DSpark against DFlash needs only theirs
    probe dspark  # after both variants: a job cut off here keeps the side by side
    probe dflash
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
    for variant in "$WORK"/variant*/; do  # each variant drafter's bench and training record
        [ -d "$variant" ] || continue
        mkdir -p "$RESULTS/$(basename "$variant")"
        [ -d "$variant/bench" ] && cp -r "$variant/bench" "$RESULTS/$(basename "$variant")/"
        [ -f "$variant/train/manifest.json" ] && \
            cp "$variant/train/manifest.json" "$RESULTS/$(basename "$variant")/train_manifest.json"
    done
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
    running && echo "still running (pid $(cat "$PID")); \`$0 wait $JOB\` again" || true
}

case "${1:-}" in
    start)
        if running; then echo "already running (pid $(cat "$PID"))" >&2; exit 1; fi
        mkdir -p runs
        entry=job
        [ "$JOB" = drafters ] && entry=drafters_job
        export -f log gpu_tests run_all job has_bench_option probe drafters_job
        export JOB RESULTS WORK FLAGS WHEELS PYTHON VERIFY STEP_COST RECIPE
        nohup setsid bash -c "$entry" > "$LOG" 2>&1 < /dev/null &
        echo $! > "$PID"
        echo "started $JOB (pid $(cat "$PID")); log: $LOG" ;;
    wait) follow ;;
    collect) collect ;;
    *) echo "usage: $0 start|wait|collect [reference|drafters]" >&2; exit 2 ;;
esac
