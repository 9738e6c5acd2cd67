#!/usr/bin/env bash
# The pending GPU verifications and benchmarks, one phase per device command (each under 10 minutes), results in
# one tarball per phase under $OUT (the device returns few files). Run from the repository root on the H200:
#   bash tools/gpu_checks.sh tests-a    # GPU tests of the paths not yet run there: engine, sampling, penalties
#   bash tools/gpu_checks.sh tests-b    # ... capture, precompile, one trace, EAGLE and verify graphs
#   bash tools/gpu_checks.sh bench      # T1: seven back-to-back runs; with and without detokenization
#   bash tools/gpu_checks.sh spec-ab    # L1 and T1 with Triton specialising per-step kernels (the old way) vs not
#   bash tools/gpu_checks.sh spec-train # issue 16: train a larger target + an EAGLE head (carry data/cache/demo_corpus)
#   bash tools/gpu_checks.sh spec-bench # ... then, on the same warm machine, TPOT per proposer on held-out text
#   bash tools/gpu_checks.sh spec-pair-table # ... the kernel table of the trained pair's EAGLE verify step
#   bash tools/gpu_checks.sh spec-unroll # one target, EAGLE heads trained --unroll 1 and 3 side by side, TPOT of both
#   bash tools/gpu_checks.sh spec-cost  # the proposers' GPU tests, then a k = 4 verify step vs a plain decode step
#                                       # per proposer on the Qwen3-0.6B shape (carry data/cache/demo_corpus)
#   bash tools/gpu_checks.sh rej        # the rejection kernels: walk vs split, copy workload both ways, k = 8
#   bash tools/gpu_checks.sh spec-why   # model proposers' verify-step kernel tables at k = 2 and 4 (0.6B shape)
#   bash tools/gpu_checks.sh spec-demo  # the demo model drafting for itself and with an EAGLE head: step cost per k
#   bash tools/gpu_checks.sh spec-b64   # batch 64 with speculation off: plain vs EAGLE vs draft model engines, per step
#   bash tools/gpu_checks.sh spec16c    # the draft steps' advance kernel: unit kernels on CUDA, model proposers' GPU tests
#   bash tools/gpu_checks.sh spec16     # spec GPU tests, copy workload at k = 4, 8, 12, verify table, P1 phases
#   bash tools/gpu_checks.sh spec-table # kernel tables of those verify steps next to a plain decode step's (same carry)
#   bash tools/gpu_checks.sh gemv       # the GEMV kernel tests on CUDA, then its launch-shape sweep vs cuBLAS per
#                                       # 0.6B layer shape (the tuned table: $OUT/gemv/gemv_configs.json)
#   bash tools/gpu_checks.sh gemv-swap  # tensor-core GEMV both orientations: CUDA tests, sweep, L1/L2 swept vs shipped
#   bash tools/gpu_checks.sh gemv-pf    # GEMV_PREFETCH=1 / GEMV_GATED_ACT=1: CUDA tests, sweep, L1/L2 A/B
#   bash tools/gpu_checks.sh gemv-engine # GPU engine/capture/verify tests under GEMV_ENV, then the k = 4 verify step
#   bash tools/gpu_checks.sh final24    # kernels with prefetch on CUDA, L1/L2 A/B, GPU engine tests (one call)
#   bash tools/gpu_checks.sh l1-ab      # GEMV engine tests, then L1/L2: cuBLAS + old attention splits, cuBLAS + new,
#                                       # GEMV (GEMV_TABLE, default the committed table) + new; kernel table
#                                       # (L1_RUNS picks among base attn gemv fused norm both combo cdt pdl fold autotune;
#                                       # fused = the one-kernel q/k-norm + rope + KV write, norm = the layer norms in
#                                       # the GEMV's prologue, combo/cdt/autotune = Inductor options)
#   bash tools/gpu_checks.sh l1-runs    # only the L1/L2 runs named in L1_RUNS
#   bash tools/gpu_checks.sh pdl        # GRAPHRUNNER_PDL=1 and GRAPHRUNNER_ATTN_FOLD_MERGE=1: tests on CUDA, L1/L2 A/B
#   bash tools/gpu_checks.sh act        # GRAPHRUNNER_GEMV_ACT=1: tests on CUDA, L1/L2 A/B; P1 A/B (gc.freeze, prologues)
#   bash tools/gpu_checks.sh act-pdl    # GEMV_ACT + PDL (+ FUSED_ADD_NORM): GPU tests, L1/L2 A/B, T1 +- penalties
#   bash tools/gpu_checks.sh quick      # after a change of defaults: GPU engine/capture/precompile tests, L1/L2, imports
#   bash tools/gpu_checks.sh defaults   # the shipped defaults: L1/L2, kernel table, T1 +- penalties, GPU tests
#   bash tools/gpu_checks.sh fused-tests # qkv_prep and GEMV kernels on CUDA, then the GPU engine, capture and EAGLE
#                                        # tests with the fused attention prologue and the GEMV norm prologue on
#   bash tools/gpu_checks.sh pieces33   # eager pieces (compilation_config backend "eager"): GPU tests, then S1 in turns
#   bash tools/gpu_checks.sh lat33      # L1/L2 at batch 2/4/8: default, PDL late never, eager pieces; T1 of two
#   bash tools/gpu_checks.sh bench2     # T1 with and without penalties, P1 (with profile), L1 step breakdown
#   bash tools/gpu_checks.sh p1         # P1 alone (hit vs miss TTFT, with profile)
#   bash tools/gpu_checks.sh p1-phases  # the hit's attention per split count and tile height, P1 with host phases
#   bash tools/gpu_checks.sh p1-ab      # prefetching attention loop off / on: tests, attention sweep, P1 phases, L1/L2
#   bash tools/gpu_checks.sh l1-split   # short-context decode splits, L1/L2 A/B (prefetch, split min length), T1 +- cache
#   bash tools/gpu_checks.sh final15    # this session's defaults: kernel + GPU engine tests, P1 phases, L1/L2 +- prefetch
#   bash tools/gpu_checks.sh attn-spills # attention warps x tile x prefetch (the kernel spills at 4 warps, 64 keys)
#   bash tools/gpu_checks.sh attn-best  # then L1/L2 default vs ATTN_BEST="WARPS TILE PREFETCH", and P1 there
#   bash tools/gpu_checks.sh p1-rows    # P1 with 128-row split prefill tiles vs 64 (+ the attention tests on CUDA)
#   bash tools/gpu_checks.sh startup    # S1: cold, precompile, warm, eager
#   bash tools/gpu_checks.sh uncompiled # FULL graphs of the uncompiled model (level 0): GPU tests, L1/L2 and T1 against
#                                       # the default engine in turns
#   bash tools/gpu_checks.sh uncompiled-s1 # S1 of both engines: precompile each, then warm starts in turns
#   bash tools/gpu_checks.sh pair26     # issue 16: train the pair (carry data/cache/demo_corpus), EAGLE k=4 vs alone
#   bash tools/gpu_checks.sh pair26b    # (warm, after pair26) the target's shapes swept into a table copy: EAGLE again,
#                                       # plain and verify step breakdowns
#   bash tools/gpu_checks.sh final26    # eager fast paths and GPU engine/capture/spec tests, L1/L2 default vs uncompiled
#   bash tools/gpu_checks.sh untuned    # the heuristic row loop for untuned shapes vs cuBLAS, L1 on/off (0.6B, 1.7B), tests
#   bash tools/gpu_checks.sh verify26   # the narrowed untuned rule: GEMV/PDL/GEMV-engine/0.6B tests on CUDA, L1 on/off
#   bash tools/gpu_checks.sh verify27 sweep17  # verify26 trimmed; the 1.7B shapes swept, L1/L2 on them
#   bash tools/gpu_checks.sh pair27     # issue 16: a hidden-2048 target and its EAGLE head, EAGLE k = 4; then pair27b
#   bash tools/gpu_checks.sh head28     # issue 16: a k = 4 EAGLE verify step's kernels vs a plain step's, random targets
#   bash tools/gpu_checks.sh pair28     # issue 16: a 28-layer hidden-2048 target, its EAGLE head, k = 4; then pair28b
#   bash tools/gpu_checks.sh pair29     # issue 16: the draft model observing after the update, on pair28's target; then
#                                       # pair29b (the tree before it, k = 2, the verify step's kernels)
#   bash tools/gpu_checks.sh l2-17      # L2 b=8 on the 1.7B shape with and without the tensor-core rows, in turns
#   bash tools/gpu_checks.sh l1-17      # L1 on the 1.7B shape with and without its swept table rows, in turns
#   bash tools/gpu_checks.sh l2-30      # issue 17's L2: GEMV launch shapes of one program per SM or fewer, swept,
#                                       # then L2 at batch 8 with them and with the shipped table, in turns
#   bash tools/gpu_checks.sh lan31      # linear_add_norm's tests on CUDA, then the b=1 / b=8 kernel tables (PDL off)
#   bash tools/gpu_checks.sh pdl32      # issue 17: L1/L2 with kernels triggering their dependents after their wait
#                                       # (GRAPHRUNNER_PDL_LATE_TRIGGER) in turns; the steps' critical paths with PDL on
#   bash tools/gpu_checks.sh late32     # issue 17: PDL's late trigger from 5 tokens (the default), from 2, never; in
#                                       # turns: L1, L2 at batch 2/4/8, T1; test_pdl on CUDA
#   bash tools/gpu_checks.sh prep32     # issue 17: the attention prologue folded into decode attention
#                                       # (GRAPHRUNNER_ATTN_DECODE_PREP) at 4 and 8 warps: tests on CUDA, L1/L2 in turns
#   bash tools/gpu_checks.sh tc32       # issue 17: other tensor-core shapes for gate-up and qkv at 2-8 tokens (more,
#                                       # smaller programs), L2 at batch 8 per table in turns
#   bash tools/gpu_checks.sh ab41       # issue 17: empty split programs skip their store: A/B at max_model_len
#                                       # 40960 and 384 in turns (then ab41-tests: GPU tests, S1)
#   bash tools/gpu_checks.sh next37     # after eager pieces became the default: the 0.6B engine tests under it, S1
#                                       # warm of the default (twice), L2 at batch 2 and 4 with PDL late from 2 vs 5
#   bash tools/gpu_checks.sh acc47      # acc44 twice, T1 and the 0.6B GPU engine suite (issue 17's acceptance run)
#   bash tools/gpu_checks.sh acc44      # the shipped defaults' L1/L2 b=8 (then tests44: the gate-up mend on CUDA, 0.6B
#                                       # and GEMV-engine tests)
#   bash tools/gpu_checks.sh sp44       # decode attention's split target at batch 8 (264, 192, 128, 64): L2 b=8
#   bash tools/gpu_checks.sh qp44       # the qkv GEMV's partials summed by the prologue: CUDA tests, L2 b=8 per table
#   bash tools/gpu_checks.sh an44       # the add + norm kernels at 4, 8, 16 warps: L1/L2 b=8 in turns, tests at 8
#   bash tools/gpu_checks.sh fin44      # qkv partials on the 1.7B shape on/off, split target one round, GEMV engine tests
#   bash tools/gpu_checks.sh w46        # w45 in ABBA order (4, 8, 8, 4 warps) ROUNDS times, T1 4 warps first
#   bash tools/gpu_checks.sh w45        # add + norm at 8 warps (new default) vs 4: L1/L2 b=2/4/8 twice, T1 each, 06b tests
#   bash tools/gpu_checks.sh od43       # the gate-up in one wgmma tile, the LM head on the GEMV at 2-8 tokens: L1/L2
#   bash tools/gpu_checks.sh serve      # offline L1 and T1, then SV1 with the engine loop in a process (needs .whl/)
#   bash tools/gpu_checks.sh serve-thread  # SV1 with the loop in a thread of the server (the old layout)
#   bash tools/gpu_checks.sh tp         # on nvidia-h200-x2: TP tests (each test logged as it runs)
#   bash tools/gpu_checks.sh tp-symm    # on nvidia-h200-x2: symmetric-memory all-reduce tokens test, TP=2 TPOT vs NCCL
#   bash tools/gpu_checks.sh tp-killed  # on nvidia-h200-x2: the killed-worker test alone
#   bash tools/gpu_checks.sh tp-bench   # on nvidia-h200-x2: bench_tp, Qwen3-8B shape at TP=1 and TP=2
# Several phases run one after another in one call; DEADLINE=<seconds from now> clamps every command's time
# limit so the last phase still ends (and is tarred) inside the device call:
#   DEADLINE=560 bash tools/gpu_checks.sh tests-a tests-b
set -u
[ $# -ge 1 ] || { echo "phases: tests-a | tests-b | bench | spec-ab | spec-train | spec-bench | spec-pair-table | spec-unroll | spec-why | spec-demo | spec-b64 | spec-b64-host | spec-diag | host-probe | small-mixed | spec16c | spec-cost | spec-table | rej | spec16 | spec16b | gemv | gemv-swap | gemv-pf | gemv-engine | final24 | l1-ab | l1-runs | pdl | act | act-pdl | quick | defaults | fused-tests | p1 | p1-phases | p1-ab | l1-split | final15 | attn-spills | attn-best | p1-rows | bench2 | sizes-tests | sizes-t1 | l2-table | startup | uncompiled | uncompiled-s1 | pair26 | pair26b | final26 | untuned | verify26 | verify27 | sweep17 | pair27 | pair27b | head28 | pair28 | pair28b | pair29 | pair29b | l2-30 | l2-30b | partials30 | lan31 | pdl32 | late32 | prep32 | tc32 | next37 | merge38 | od43 | od43b | acc44 | acc47 | tests44 | sp44 | qp44 | fin44 | an44 | w45 | w46 | ab41 | ab41-tests | l2-17 | l1-17 | serve | serve-thread | tp | tp-symm | tp-killed | tp-bench" >&2; exit 2; }
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
END=$(( $(date +%s) + ${DEADLINE:-100000} ))
# T LIMIT cmd...: run cmd killed after LIMIT seconds, or sooner so that 15 s remain before the deadline
T() {
  local lim=$1 left=$(( END - $(date +%s) - 15 )); shift
  [ "$left" -lt "$lim" ] && lim=$left
  if [ "$lim" -le 5 ]; then echo "skipped (deadline): $*"; return 124; fi
  timeout --signal=KILL "$lim" "$@"
}
# lat NAME: L1 and L2 (batch 8) on the bench model under the caller's environment, into $R/NAME.{json,log}
lat() { T "${LAT_LIMIT:-130}" python3 tools/bench_latency.py --model /tmp/q06 --no-peer --workloads L1,L2 --batch-sizes 8 \
  --json "$R/$1.json" > "$R/$1.log" 2>&1; }
# lat3 NAME [ARGS]: L1 and L2 at batch 2, 4 and 8 (ARGS: more bench_latency arguments), into $R/NAME.{json,log}
lat3() { local name=$1; shift; T "${LAT_LIMIT:-130}" python3 tools/bench_latency.py --model /tmp/q06 --no-peer \
  --workloads L1,L2 --batch-sizes 2,4,8 "$@" --json "$R/$name.json" > "$R/$name.log" 2>&1; }
# t1 NAME: T1 (median of 3 runs in one process) on the bench model under the caller's environment, into $R/t1_NAME.*
t1() { T 100 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --runs 3 --json "$R/t1_$1.json" \
  > "$R/t1_$1.log" 2>&1; }
# l2b8 NAME: L2 at batch 8 alone on the bench model under the caller's environment, appended to $R/l2_NAME.{json,log}
l2b8() { T 80 python3 tools/bench_latency.py --model /tmp/q06 --no-peer --workloads L2 --batch-sizes 8 \
  --json "$R/l2_$1.json" >> "$R/l2_$1.log" 2>&1; }
model() { [ -d /tmp/q06 ] || python3 tools/make_bench_model.py --out /tmp/q06 --tokenizer > "$R/make_model.log" 2>&1; }
# random-weight proposers with the target's vocabulary: an 8-layer draft of the demo model's shape and an EAGLE
# head trained for two steps (a verify step's cost does not depend on what they propose: it is always 1 + k tokens)
proposers() {
  [ -d /tmp/q06draft ] || T 120 python3 tools/make_bench_model.py --out /tmp/q06draft --layers 8 --hidden 256 \
    --intermediate 768 --heads 8 --kv-heads 4 --head-dim 64 > "$R/make_draft.log" 2>&1
  [ -d /tmp/q06eagle ] || T 120 python3 tools/train_demo_model.py train-eagle --data data/cache/demo_corpus \
    --target /tmp/q06 --out /tmp/q06eagle --max-steps 2 --batch-size 4 --seq-len 128 > "$R/make_eagle.log" 2>&1
}
# train_target: issue 16's trained target on the demo corpus and tokenizer (the shipped demo model is its draft), in
# /tmp/target (carry data/cache/demo_corpus). Hidden 1024 (~300M parameters, 34x the draft): the tenth session's
# hidden 2048 (1,065M) fit only 314 steps in 4 minutes and ended weaker than its draft (perplexity 52.5 vs 32.6).
# Decode is latency-bound per layer at hidden 1024 (see pair27 for hidden 2048). TARGET_BATCH: sequences of 1,024
# tokens a step (32; hidden 2048 at 16 layers trained at 32, deeper ones may need fewer to fit: not tried).
train_target() {
  T 330 python3 tools/train_demo_model.py train --data data/cache/demo_corpus --out /tmp/target \
    --minutes "${TARGET_MINUTES:-4}" --hidden "${TARGET_HIDDEN:-1024}" --layers "${TARGET_LAYERS:-24}" \
    --heads "${TARGET_HEADS:-16}" --kv-heads "${TARGET_KV_HEADS:-8}" --batch-size "${TARGET_BATCH:-32}" \
    > "$R/train_target.log" 2>&1
}
# spec_b1 LIMIT METHOD DRAFT NAME: batch-1 TPOT and acceptance per draft position on held-out text for the proposer
# against /tmp/target alone at each k of SPEC_KS, 8 passages, the engines timed in turns, into $R/NAME.{json,log}
spec_b1() {
  T "$1" python3 tools/bench_spec.py --model /tmp/target --no-peer --method "$2" --draft-model "$3" \
    --workloads text --text-ids data/cache/demo_corpus/val.npy --batch-sizes 1 --k "${SPEC_KS:-2,3,4}" --interleave \
    --json "$R/$4.json" > "$R/$4.log" 2>&1
}
# q17: the Qwen3-1.7B-shaped bench model in /tmp/q17 (hidden 2048, intermediate 6144, 28 layers)
q17() { [ -d /tmp/q17 ] || python3 tools/make_bench_model.py --out /tmp/q17 --hidden 2048 --intermediate 6144 \
  --tokenizer > "$R/make_q17.log" 2>&1; }
# tc_table: /tmp/gemv_tc.json, the shipped table with the sweep17 tensor-core configs up to M = 8 added to the two
# shapes that leave M = 2-8 to cuBLAS (qkv 4096 x 2048, gate_up 12288 x 2048; isolated, 0.3-0.7 µs slower at M = 5)
tc_table() {
  python3 - <<'PY'
import json
rows = json.load(open("graphrunner/models/gemv_configs.json"))
tc = {(12288, 2048): dict(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=4),
      (4096, 2048): dict(block_n=64, block_k=256, split_k=2, num_warps=4, num_stages=4)}
for r in rows:
    if (r["N"], r["K"]) in tc:
        r["configs"].append(dict(tc[(r["N"], r["K"])], max_m=8, use_dot=True, swap_ab=True))
json.dump(rows, open("/tmp/gemv_tc.json", "w"))
PY
}
# l1_untuned: L1 on the 0.6B and 1.7B shapes with GRAPHRUNNER_GEMV_UNTUNED on, then off, into $R/l1_MODEL_uN.*
l1_untuned() {
  for m in q06 q17; do
    for u in 1 0; do
      GRAPHRUNNER_GEMV_UNTUNED=$u T 100 python3 tools/bench_latency.py --model /tmp/$m --no-peer --workloads L1 \
        --json "$R/l1_${m}_u$u.json" > "$R/l1_${m}_u$u.log" 2>&1
    done
  done
}
# gemv_tests: the GEMV, PDL and GEMV-engine tests on CUDA, then the 0.6B bf16 parity tests, into $R/pytest_*.log
gemv_tests() {
  T 240 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_gemv.py tests/test_pdl.py \
    tests/test_gpu_gemv_engine.py > "$R/pytest_gemv.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gemv.log"
  T 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py -k "06b" > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
}
wheels() {
  [ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH=$PYTHONPATH:/tmp/site ;; esac
}

for phase in "$@"; do
R=$OUT/$phase
mkdir -p "$R"
case $phase in
tests-a)
  # the kernel files without a gpu mark run on CUDA when it is there: the compiled kernels against their references
  T 200 python3 -m pytest -q -p no:cacheprovider --durations=10 tests/test_penalty_counts.py \
    tests/test_sampling_penalties.py tests/test_state_kernels.py tests/test_sampling_gumbel_split.py \
    > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  T 360 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=15 \
    tests/test_gpu_engine.py tests/test_engine_sampling.py > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  ;;
tests-b)
  T 560 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=15 \
    tests/test_gpu_capture.py tests/test_capture_precompile.py tests/test_spec_eagle.py \
    tests/test_spec_decode_graphs.py > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  ;;
bench)
  model
  # issue 19: seven back-to-back T1 runs in a fresh process (the first within 10% of the median), then T1 with
  # and without detokenization alternating in one process
  T 260 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --detokenize --runs 7 \
    --json "$R/t1_seven.json" > "$R/t1_seven.log" 2>&1
  T 260 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --both-detok --runs 3 \
    --json "$R/t1_detok.json" > "$R/t1_detok.log" 2>&1
  ;;
spec-ab)
  model
  # the cost of not specialising per-step kernels on batch sizes: L1 and T1 with Triton's default restored, then
  # as shipped (docs/DECISIONS.md, "Per-step kernels never meet a new Triton specialisation")
  for sp in 1 0; do
    GRAPHRUNNER_TRITON_SPECIALISE=$sp T 100 python3 tools/bench_latency.py --model /tmp/q06 --no-peer \
      --workloads L1 --json "$R/l1_spec$sp.json" > "$R/l1_spec$sp.log" 2>&1
    GRAPHRUNNER_TRITON_SPECIALISE=$sp T 150 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --runs 5 \
      --json "$R/t1_spec$sp.json" > "$R/t1_spec$sp.log" 2>&1
  done
  ;;
spec-train)
  # issue 16's trained pair (carry data/cache/demo_corpus: `train_demo_model.py prepare` on a CPU machine): the
  # target (train_target), then an EAGLE head for it. /tmp/target and /tmp/eagle live only on this machine: run
  # spec-bench in the next call while it is warm.
  train_target
  T 240 python3 tools/train_demo_model.py train-eagle --data data/cache/demo_corpus --target /tmp/target \
    --out /tmp/eagle --max-steps "${EAGLE_STEPS:-1500}" --unroll "${EAGLE_UNROLL:-1}" --minutes "${EAGLE_MINUTES:-3.5}" \
    > "$R/train_eagle.log" 2>&1
  ;;
spec-bench)
  # batch-1 TPOT and mean acceptance length on held-out text for each proposer at each k of SPEC_KS against the same
  # target without speculation, then batch 64 at k = 4 with disable_by_batch_size 32 (speculation and the model
  # proposers off there) for the model proposers; 8 passages per case, the engines of a comparison timed in turns
  # (--interleave: the host's speed drifts, host-probe)
  # SPEC_B64=0 skips batch 64; SPEC_METHODS picks a subset, so two GPUs of one machine can share the list (CUDA_VISIBLE_DEVICES, OUT apart)
  for m in ${SPEC_METHODS:-eagle draft_model ngram}; do
    d=graphrunner/demo_model; [ "$m" = eagle ] && d=/tmp/eagle
    spec_b1 240 "$m" "$d" "spec_$m"
    [ "$m" = ngram ] || [ "${SPEC_B64:-1}" = 0 ] && continue
    T 150 python3 tools/bench_spec.py --model /tmp/target --no-peer --method "$m" --draft-model "$d" \
      --workloads text --text-ids data/cache/demo_corpus/val.npy --batch-sizes 64 --k 4 \
      --disable-by-batch-size 32 --interleave --json "$R/spec_${m}_b64.json" > "$R/spec_${m}_b64.log" 2>&1
  done
  ;;
spec-unroll)
  # issue 16: does training the head on its own drafts (--unroll) raise draft positions 2-4 on the GPU-trained pair?
  # One target, then an unroll-1 and an unroll-UNROLL_B head trained side by side for EAGLE_STEPS steps (same data,
  # same seed), then batch-1 TPOT and acceptance per position of each head at k = SPEC_KS against no speculation
  # (the unrolled head first). Carry data/cache/demo_corpus.
  train_target
  for u in 1 "${UNROLL_B:-3}"; do
    T 240 python3 tools/train_demo_model.py train-eagle --data data/cache/demo_corpus --target /tmp/target \
      --out "/tmp/eagle_u$u" --max-steps "${EAGLE_STEPS:-800}" --unroll "$u" --minutes "${EAGLE_MINUTES:-2.5}" \
      > "$R/train_eagle_u$u.log" 2>&1 &
  done
  wait
  for u in "${UNROLL_B:-3}" 1; do
    SPEC_KS=${SPEC_KS:-4} spec_b1 150 eagle "/tmp/eagle_u$u" "spec_eagle_u$u"
  done
  ;;
spec-pair-table)
  # the kernel table of a k = 4 EAGLE verify step on the trained pair next to the target's plain decode step
  T 100 python3 tools/bench_step_breakdown.py --model /tmp/target --steps 40 --profile-steps 100 --json "$R/plain.json" \
    --trace /tmp/trace_plain.json > "$R/plain.log" 2>&1
  for m in ${SPEC_METHODS:-eagle}; do
    d=graphrunner/demo_model; [ "$m" = eagle ] && d=/tmp/eagle
    T 100 python3 tools/bench_step_breakdown.py --model /tmp/target --steps 40 --profile-steps 100 --speculative-method "$m" \
      --draft-model "$d" --json "$R/verify_$m.json" --trace "/tmp/trace_$m.json" > "$R/verify_$m.log" 2>&1
  done
  ;;
spec-cost)
  model
  # the rejection kernels on CUDA (that file runs on CUDA when it is there: both kernels against the reference)
  T 120 python3 -m pytest -q -p no:cacheprovider tests/test_rejection_sampler.py > "$R/pytest_rejection.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_rejection.log"
  T 240 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_spec_eagle.py \
    tests/test_spec_decode_graphs.py > "$R/pytest_spec.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_spec.log"
  GRAPHRUNNER_SPLIT_REJECTION=1 T 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_spec_decode_graphs.py \
    > "$R/pytest_spec_split_rejection.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_spec_split_rejection.log"
  proposers
  # the split-vocab rejection kernel (GRAPHRUNNER_SPLIT_REJECTION=1) against the one-program walk: n-gram verify steps
  GRAPHRUNNER_SPLIT_REJECTION=1 T 150 python3 tools/bench_spec.py --model /tmp/q06 --no-peer --method ngram \
    --workloads copy --batch-sizes 1 --k 4 --repeats 2 --json "$R/cost_ngram_split.json" > "$R/cost_ngram_split.log" 2>&1
  for m in draft_model eagle ngram; do
    d=/tmp/q06draft; [ "$m" = eagle ] && d=/tmp/q06eagle
    T 150 python3 tools/bench_spec.py --model /tmp/q06 --no-peer --method "$m" --draft-model "$d" \
      --workloads copy --batch-sizes 1 --k 4 --repeats 2 --json "$R/cost_$m.json" > "$R/cost_$m.log" 2>&1
  done
  ;;
spec-table)
  model
  [ "${SPEC_METHODS:-all}" = ngram ] || proposers
  # issue 16: the kernel table of a k = 4 verify step per proposer next to a plain decode step's (where the verify
  # step's extra time goes: the 5-token forward, the rejection sampler, the proposer's layers and glue)
  T 150 python3 tools/bench_step_breakdown.py --model /tmp/q06 --profile-steps 100 --json "$R/plain.json" \
    --trace /tmp/trace_plain.json > "$R/plain.log" 2>&1
  for m in ${SPEC_METHODS:-ngram eagle draft_model}; do
    d=/tmp/q06draft; [ "$m" = eagle ] && d=/tmp/q06eagle
    T 150 python3 tools/bench_step_breakdown.py --model /tmp/q06 --profile-steps 100 --speculative-method "$m" \
      --draft-model "$d" --json "$R/verify_$m.json" --trace "/tmp/trace_$m.json" > "$R/verify_$m.log" 2>&1
  done
  ;;
rej)
  model
  # issue 16: the verify step's rejection kernels (the walk cost 564 us of a k = 4 n-gram verify step in the
  # sixteenth session's kernel table): kernel times, the copy workload split vs walk and at k = 8, the verify
  # step's table with exclusive times (PDL off), then the rejection and spec GPU tests with the split kernel
  T 60 python3 tools/bench_sampler.py --rejection --batch-sizes 1,8,64 --k 4 --json "$R/rejection.json" \
    > "$R/rejection.log" 2>&1
  for sr in 1 0; do
    GRAPHRUNNER_SPLIT_REJECTION=$sr T 150 python3 tools/bench_spec.py --model /tmp/q06 --no-peer --method ngram \
      --workloads copy --batch-sizes 1 --k 4 --repeats 2 --json "$R/copy_split$sr.json" > "$R/copy_split$sr.log" 2>&1
  done
  GRAPHRUNNER_SPLIT_REJECTION=1 T 150 python3 tools/bench_spec.py --model /tmp/q06 --no-peer --method ngram \
    --workloads copy --batch-sizes 1 --k 8 --repeats 2 --json "$R/copy_split1_k8.json" > "$R/copy_split1_k8.log" 2>&1
  GRAPHRUNNER_SPLIT_REJECTION=1 GRAPHRUNNER_PDL=0 T 150 python3 tools/bench_step_breakdown.py --model /tmp/q06 \
    --profile-steps 100 --speculative-method ngram --json "$R/verify_ngram_split.json" \
    --trace /tmp/trace_ngram_split.json > "$R/verify_ngram_split.log" 2>&1
  GRAPHRUNNER_SPLIT_REJECTION=1 T 240 python3 -m pytest -q -p no:cacheprovider tests/test_rejection_sampler.py \
    tests/test_spec_decode_graphs.py > "$R/pytest_split.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_split.log"
  ;;
spec16)
  model
  # issue 16 after the split rejection default and the state-update kernels: the spec GPU tests and the kernel
  # files on CUDA, the copy workload at k = 4, 8, 12, the k = 4 verify table (PDL off), then P1 with phases
  # (issue 14's host-path changes of the fifteenth session)
  T 200 python3 -m pytest -q -p no:cacheprovider tests/test_spec_decode_units.py tests/test_rejection_sampler.py \
    > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  T 240 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_spec_decode_graphs.py \
    tests/test_spec_eagle.py tests/test_spec_ngram.py > "$R/pytest_spec_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_spec_gpu.log"
  for k in ${SPEC_KS:-4 8 12}; do
    T 120 python3 tools/bench_spec.py --model /tmp/q06 --no-peer --method ngram --workloads copy --batch-sizes 1 \
      --k "$k" --repeats 2 --json "$R/copy_k$k.json" > "$R/copy_k$k.log" 2>&1
  done
  GRAPHRUNNER_PDL=0 T 120 python3 tools/bench_step_breakdown.py --model /tmp/q06 --profile-steps 100 \
    --speculative-method ngram --json "$R/verify_ngram.json" --trace /tmp/trace_ngram.json > "$R/verify_ngram.log" 2>&1
  T 90 python3 tools/bench_prefix_cache.py --model /tmp/q06 --repeats 5 --phases --json "$R/p1.json" \
    > "$R/p1.log" 2>&1
  ;;
spec16b)
  model
  # after the stride fix (K and K + 1 no longer specialised): the variant-count GPU test and the kernel files on
  # CUDA, the copy workload at k = 8 (batch 64 with speculation off above 32) and k = 12
  T 150 python3 -m pytest -q -p no:cacheprovider tests/test_spec_decode_units.py tests/test_rejection_sampler.py \
    > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  T 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_specialisation.py tests/test_spec_ngram.py \
    > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  T 200 python3 tools/bench_spec.py --model /tmp/q06 --no-peer --method ngram --workloads copy --batch-sizes 1,64 \
    --disable-by-batch-size 32 --k 8 --repeats 2 --json "$R/copy_k8.json" > "$R/copy_k8.log" 2>&1
  T 120 python3 tools/bench_spec.py --model /tmp/q06 --no-peer --method ngram --workloads copy --batch-sizes 1 \
    --k 12 --repeats 2 --json "$R/copy_k12.json" > "$R/copy_k12.log" 2>&1
  ;;
spec-why)
  model
  proposers
  # where a model proposer's verify step goes as k grows (the trained pair's EAGLE step grew ~0.42 ms per draft,
  # the draft model's 1.3-2.3 ms): kernel tables and host time at k = 2 and 4 on the 0.6B shape (PDL off)
  for m in eagle draft_model; do
    d=/tmp/q06draft; [ "$m" = eagle ] && d=/tmp/q06eagle
    for k in 2 4; do
      GRAPHRUNNER_PDL=0 T 100 python3 tools/bench_step_breakdown.py --model /tmp/q06 --steps 30 --profile-steps 40 \
        --speculative-method "$m" --num-speculative-tokens $k --draft-model "$d" --json "$R/verify_${m}_k$k.json" \
        --trace /tmp/trace.json > "$R/verify_${m}_k$k.log" 2>&1
    done
  done
  ;;
spec-demo)
  # the trained pair's verify step grew 0.42 ms (EAGLE) and 1.3-2.3 ms (draft model) per draft where the 0.6B shape's
  # grows 75 and 185 us: the same draft model drafting for itself (every draft accepted), an EAGLE head for the demo
  # model, on held-out text at k = 2 and 4 (steps by mode printed), then a self-draft kernel table at k = 4
  T 100 python3 tools/train_demo_model.py train-eagle --data data/cache/demo_corpus --target graphrunner/demo_model \
    --out /tmp/demo_eagle --max-steps 300 > "$R/train_eagle.log" 2>&1
  for m in draft_model eagle; do
    d=graphrunner/demo_model; [ "$m" = eagle ] && d=/tmp/demo_eagle
    T 110 python3 tools/bench_spec.py --model graphrunner/demo_model --no-peer --method "$m" --draft-model "$d" \
      --workloads text --text-ids data/cache/demo_corpus/val.npy --batch-sizes 1 --k 2,4 --repeats 2 \
      --json "$R/spec_$m.json" > "$R/spec_$m.log" 2>&1
  done
  GRAPHRUNNER_PDL=0 T 90 python3 tools/bench_step_breakdown.py --model graphrunner/demo_model --steps 30 \
    --profile-steps 40 --speculative-method draft_model --draft-model graphrunner/demo_model \
    --json "$R/verify_self_k4.json" --trace /tmp/trace.json > "$R/verify_self_k4.log" 2>&1
  ;;
spec-b64)
  model
  proposers
  # issue 16's batch-64 check after disable_by_batch_size stopped the model proposers (the trained pair measured
  # EAGLE 0.85x, the draft model 1.03x): host and device per step of the plain engine and of each speculative one
  # with speculation off (0.6B shape, random proposers), bench_spec at b = 64; then a prefix-cache hit with a
  # 4-token suffix (a piecewise step: the trained pair's took ~15-20 ms)
  T 90 python3 tools/bench_step_breakdown.py --model /tmp/q06 --batch 64 --steps 40 --profile-steps 20 \
    --json "$R/b64_plain.json" --trace /tmp/trace.json > "$R/b64_plain.log" 2>&1
  for m in eagle draft_model; do
    d=/tmp/q06draft; [ "$m" = eagle ] && d=/tmp/q06eagle
    T 90 python3 tools/bench_step_breakdown.py --model /tmp/q06 --batch 64 --steps 40 --profile-steps 20 \
      --speculative-method "$m" --draft-model "$d" --disable-by-batch-size 32 --json "$R/b64_$m.json" \
      --trace /tmp/trace.json > "$R/b64_$m.log" 2>&1
  done
  T 150 python3 tools/bench_spec.py --model /tmp/q06 --no-peer --method eagle --draft-model /tmp/q06eagle \
    --workloads random --batch-sizes 64 --k 4 --disable-by-batch-size 32 --repeats 3 --json "$R/spec_eagle_b64.json" \
    > "$R/spec_eagle_b64.log" 2>&1
  T 90 python3 tools/bench_prefix_cache.py --model /tmp/q06 --prefix-len 200 --suffix-len 4 --repeats 5 --phases \
    --json "$R/p1_suffix4.json" > "$R/p1_suffix4.log" 2>&1
  ;;
spec-b64-host)
  model
  proposers
  # why the EAGLE engine's host step at batch 64 with speculation off took 1.63 ms against the draft model's 0.85
  # and the plain engine's 0.92 (spec-b64): each engine's timed steps under cProfile, and its process facts (threads,
  # collections during the timed steps, the collector's heap, torch's threads, the CPU set) in the log and JSON
  for m in eagle draft_model plain; do
    d=/tmp/q06draft; [ "$m" = eagle ] && d=/tmp/q06eagle
    a=(--speculative-method "$m" --draft-model "$d" --disable-by-batch-size 32); [ "$m" = plain ] && a=()
    T 100 python3 tools/bench_step_breakdown.py --model /tmp/q06 --batch 64 --steps 40 --profile-steps 0 "${a[@]}" \
      --cprofile "$R/cprofile_$m.txt" --json "$R/b64_$m.json" > "$R/b64_$m.log" 2>&1
  done
  ;;
spec-diag)
  # acceptance per draft position at k = 2 and 4 in each way of running a step (eager, piecewise, FULL), with the
  # demo model as target and a head trained on CPU for it (carry data/cache/demo_eagle and data/cache/demo_corpus;
  # tools/spec_acceptance.py says how to build the head): a k- or mode-dependent rate names the path that drafts
  # worse. Run spec-b64-host after it: its process facts now hold the interpreter probes (loop, call, op timings)
  T 200 python3 tools/spec_acceptance.py --model graphrunner/demo_model --draft-model data/cache/demo_eagle --k 2,4 \
    --modes eager,piecewise,full_and_piecewise --json "$R/spec_acceptance.json" > "$R/spec_acceptance.log" 2>&1
  ;;
host-probe)
  model
  # the interpreter ran ~2x slower after an engine's warm-up than before it, in every engine (spec-b64-host,
  # nineteenth session): the plain engine at batch 64 as it is, with Inductor's compile workers off, and with one
  # intra-op thread; each log's process facts say who burns CPU while the main thread sleeps
  for v in default compile1 omp1; do
    e=(); [ "$v" = compile1 ] && e=(TORCHINDUCTOR_COMPILE_THREADS=1); [ "$v" = omp1 ] && e=(OMP_NUM_THREADS=1)
    env "${e[@]}" timeout 100 python3 tools/bench_step_breakdown.py --model /tmp/q06 --batch 64 --steps 40 \
      --profile-steps 0 --json "$R/b64_plain_$v.json" > "$R/b64_plain_$v.log" 2>&1
  done
  ;;
small-mixed)
  model
  # the mixed FULL graphs of 2, 4 and 8 tokens (nineteenth session, CPU only when written): the capture tests
  # (graphs == eager, a cache hit leaving 2-8 tokens replays one), then the hit with a 4-token suffix, whose first
  # token ran piecewise before (~0.24 ms a layer of launches on the trained target)
  T 300 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_capture.py \
    > "$R/pytest_capture.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_capture.log"
  T 150 python3 tools/bench_prefix_cache.py --model /tmp/q06 --prefix-len 192 --suffix-len 4 --phases \
    --json "$R/prefix_suffix4.json" > "$R/prefix_suffix4.log" 2>&1
  ;;
spec16c)
  # the draft steps' advance as one Triton launch: the unit kernels on CUDA, then the model proposers' GPU tests
  # (EAGLE graphs == eager, FULL verify graphs for every proposer, the no-sync loop)
  T 120 python3 -m pytest -q -p no:cacheprovider tests/test_spec_decode_units.py > "$R/pytest_units.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_units.log"
  T 300 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_spec_eagle.py \
    tests/test_spec_decode_graphs.py > "$R/pytest_spec_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_spec_gpu.log"
  ;;
gemv)
  # issue 17: the small-M GEMV against its reference on CUDA (batch invariance under load included), then every
  # candidate launch shape at M = 1 and the best six at M = 1, 2, 4, 8 against cuBLAS, per 0.6B layer shape
  # (GEMV_SHAPES: others, e.g. "2048x1024,1024x1024,gate_up" for the trained spec target's qkv, o and gate-up)
  T 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py > "$R/pytest_gemv.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gemv.log"
  T 480 python3 tools/bench_kernels.py --only gemv --sweep --shapes "${GEMV_SHAPES:-qkv,o 2048,gate_up,down}" --ms 1,2,3,4,5,8 \
    --tuned-out "$R/gemv_configs.json" --json "$R/bench_gemv.json" > "$R/bench_gemv.log" 2>&1
  cp "$R/gemv_configs.json" /tmp/gemv_configs.json  # for l1-ab on the same warm machine (GEMV_TABLE=...)
  ;;
gemv-swap)
  # issue 17's L2 and issue 16's verify step (M = 5): the tensor-core GEMV in both orientations (swap_ab) against
  # its reference on CUDA, then its sweep over the wider launch space (row loop kept from the table), then L1/L2
  # with the swept table (/tmp/gemv_configs.json, for later phases on the same machine) and with the shipped one
  model &
  T 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py > "$R/pytest_gemv.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gemv.log"
  T "${SWEEP_LIMIT:-330}" python3 tools/bench_kernels.py --only gemv --sweep --loop-from-table \
    --shapes "${GEMV_SHAPES:-qkv,o 2048,gate_up,down}" --ms 1,2,3,4,5,8 \
    --tuned-out "$R/gemv_configs.json" --json "$R/bench_gemv.json" > "$R/bench_gemv.log" 2>&1
  cp "$R/gemv_configs.json" /tmp/gemv_configs.json
  wait
  GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_configs.json lat swept
  lat shipped
  ;;
gemv-pf)
  # GRAPHRUNNER_GEMV_PREFETCH=1 (each GEMV program asks L2 for its weight slice before its PDL wait) and
  # GRAPHRUNNER_GEMV_GATED_ACT=1 (the MLP as one op, silu(gate) * up in the gate-up kernel's epilogue): the GEMV and
  # gate-up kernel tests on CUDA with prefetch, the tensor-core sweep with it (row loop from the table), then L1/L2:
  # shipped, prefetch + its swept table, gated, both, shipped again (host drift)
  model &
  GRAPHRUNNER_GEMV_PREFETCH=1 T 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py \
    tests/test_gate_up_act.py > "$R/pytest_gemv.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gemv.log"
  GRAPHRUNNER_GEMV_PREFETCH=1 T "${SWEEP_LIMIT:-200}" python3 tools/bench_kernels.py --only gemv --sweep \
    --loop-from-table --shapes "${GEMV_SHAPES:-qkv,o 2048,gate_up,down}" --ms 1,2,3,4,5,8 \
    --tuned-out "$R/gemv_configs.json" --json "$R/bench_gemv.json" > "$R/bench_gemv.log" 2>&1
  cp "$R/gemv_configs.json" /tmp/gemv_configs_pf.json
  wait
  lat shipped
  GRAPHRUNNER_GEMV_PREFETCH=1 GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_configs_pf.json lat pf
  GRAPHRUNNER_GEMV_GATED_ACT=1 lat gated
  GRAPHRUNNER_GEMV_PREFETCH=1 GRAPHRUNNER_GEMV_GATED_ACT=1 GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_configs_pf.json lat pf-gated
  lat shipped2
  ;;
gemv-engine)
  # a new GEMV table or switch in the engine (GEMV_ENV, e.g. GRAPHRUNNER_GEMV_PREFETCH=1): GPU engine tests (HF
  # parity, graphs == eager, no sync), GEMV engine, capture and FULL verify-graph tests, then the n-gram k = 4
  # verify step (M = 5 at batch 1) against a plain step
  model
  ( [ -n "${GEMV_ENV:-}" ] && export ${GEMV_ENV}
    T 330 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_engine.py \
      tests/test_gpu_gemv_engine.py tests/test_gpu_capture.py tests/test_spec_decode_graphs.py > "$R/pytest_gpu.log" 2>&1
    echo "pytest rc=$?" >> "$R/pytest_gpu.log"
    T 150 python3 tools/bench_spec.py --model /tmp/q06 --no-peer --method ngram --workloads copy --batch-sizes 1 \
      --k 4 --repeats 2 --json "$R/cost_ngram.json" > "$R/cost_ngram.log" 2>&1 )
  ;;
final24)
  # the twenty-fourth session in one call: the GEMV and gate-up kernels on CUDA with GRAPHRUNNER_GEMV_PREFETCH=1,
  # L1/L2 shipped / prefetch / gated activation, the GPU engine, GEMV-engine and capture tests with the shipped
  # table (the swapped tensor-core configs), then L1/L2 prefetch + gated and shipped again
  model &
  GRAPHRUNNER_GEMV_PREFETCH=1 T 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_gemv.py \
    tests/test_gate_up_act.py > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  wait
  lat shipped
  GRAPHRUNNER_GEMV_PREFETCH=1 lat pf
  GRAPHRUNNER_GEMV_GATED_ACT=1 lat gated
  T 240 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_engine.py \
    tests/test_gpu_gemv_engine.py tests/test_gpu_capture.py > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  GRAPHRUNNER_GEMV_PREFETCH=1 GRAPHRUNNER_GEMV_GATED_ACT=1 lat pf-gated
  lat shipped2
  ;;
l1-ab|l1-runs)
  # l1-runs: only the L1/L2 runs named in L1_RUNS (no engine tests, no kernel table)
  model
  gt=${GEMV_TABLE:-graphrunner/models/gemv_configs.json}
  if [ "$phase" = l1-ab ]; then
    T 240 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_gemv_engine.py \
      > "$R/pytest_gemv_engine.log" 2>&1
    echo "pytest rc=$?" >> "$R/pytest_gemv_engine.log"
  fi
  for run in ${L1_RUNS:-base attn gemv}; do
    case $run in
      # the fused attention prologue is on by default since 2026-12-01: base/attn/gemv turn it off (as measured then)
      base) GRAPHRUNNER_FUSED_QKV_PREP=0 GRAPHRUNNER_GEMV=0 GRAPHRUNNER_ATTN_SPLIT_MIN_LEN=1024 \
        GRAPHRUNNER_ATTN_SPLIT_MIN_KEYS=256 lat base ;;
      attn) GRAPHRUNNER_FUSED_QKV_PREP=0 GRAPHRUNNER_GEMV=0 lat attn ;;
      gemv) GRAPHRUNNER_FUSED_QKV_PREP=0 GRAPHRUNNER_GEMV_CONFIGS=$gt lat gemv ;;
      fused) GRAPHRUNNER_GEMV_CONFIGS=$gt GRAPHRUNNER_FUSED_QKV_PREP=1 lat fused ;;
      # the defaults with the committed table, twice beside fused (GEMV_TABLE) to see the host drift: shipped, shipped2
      shipped|shipped2) lat "$run" ;;
      fused2) GRAPHRUNNER_GEMV_CONFIGS=$gt lat fused2 ;;
      norm) GRAPHRUNNER_FUSED_QKV_PREP=0 GRAPHRUNNER_GEMV_CONFIGS=$gt GRAPHRUNNER_GEMV_NORM=1 lat norm ;;
      both) GRAPHRUNNER_GEMV_CONFIGS=$gt GRAPHRUNNER_GEMV_NORM=1 GRAPHRUNNER_FUSED_QKV_PREP=1 lat both ;;
      combo) GRAPHRUNNER_GEMV_CONFIGS=$gt GRAPHRUNNER_INDUCTOR_CONFIG=combo_kernels=1 lat combo ;;
      cdt) GRAPHRUNNER_GEMV_CONFIGS=$gt GRAPHRUNNER_INDUCTOR_CONFIG=coordinate_descent_tuning=1 lat cdt ;;
      pdl) GRAPHRUNNER_GEMV_CONFIGS=$gt GRAPHRUNNER_PDL=1 lat pdl ;;
      fold) GRAPHRUNNER_GEMV_CONFIGS=$gt GRAPHRUNNER_ATTN_FOLD_MERGE=1 lat fold ;;
      # Inductor's Triton GEMM templates instead of the GEMV (they can fuse the RMSNorm prologue); slow to compile
      autotune) GRAPHRUNNER_GEMV=0 LAT_LIMIT=300 \
        GRAPHRUNNER_INDUCTOR_CONFIG=max_autotune_gemm=1,max_autotune_gemm_backends=TRITON lat autotune ;;
    esac
  done
  [ "$phase" = l1-ab ] && GRAPHRUNNER_GEMV_CONFIGS=$gt T 150 python3 tools/bench_step_breakdown.py --model /tmp/q06 \
    --json "$R/step_breakdown.json" > "$R/step_breakdown.log" 2>&1
  ;;
pdl)
  # programmatic dependent launch (GRAPHRUNNER_PDL=1) and the folded attention merge (GRAPHRUNNER_ATTN_FOLD_MERGE=1):
  # their kernels bit-equal with and without on CUDA, engine tokens equal through graphs and eager, then L1/L2
  # off / pdl / fold / both / off again, and the kernel table with both on
  model
  T 200 python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py tests/test_attention_fold_merge.py \
    > "$R/pytest_pdl.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_pdl.log"
  for run in off pdl fold both off2; do
    case $run in pdl) p=1 f=0 ;; fold) p=0 f=1 ;; both) p=1 f=1 ;; *) p=0 f=0 ;; esac
    GRAPHRUNNER_PDL=$p GRAPHRUNNER_ATTN_FOLD_MERGE=$f lat "l1_$run"
  done
  GRAPHRUNNER_PDL=1 GRAPHRUNNER_ATTN_FOLD_MERGE=1 T 150 python3 tools/bench_step_breakdown.py --model /tmp/q06 \
    --json "$R/step_breakdown.json" > "$R/step_breakdown.log" 2>&1
  ;;
act)
  # the MLP's silu(gate) * up in the down projection's GEMV prologue (GRAPHRUNNER_GEMV_ACT=1): kernel tests and the
  # GEMV engine tests with it on, on CUDA (+ the folded merge's tests, mended), L1/L2 off / act / act + PDL, then
  # P1 under the defaults, with gc.freeze(), without the fused attention prologue and without the GEMV (where the
  # miss's doubled time of 2026-12-01 comes from)
  model
  T 120 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_act.py tests/test_attention_fold_merge.py \
    > "$R/pytest_act.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_act.log"
  T 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_gemv_engine.py -k act_prologue \
    > "$R/pytest_act_engine.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_act_engine.log"
  for run in off act actpdl; do
    case $run in act) a=1 p=0 ;; actpdl) a=1 p=1 ;; *) a=0 p=0 ;; esac
    GRAPHRUNNER_GEMV_ACT=$a GRAPHRUNNER_PDL=$p LAT_LIMIT=100 lat "l1_$run"
  done
  for run in default gcfreeze noqkvprep nogemv; do
    case $run in
      gcfreeze) env="GRAPHRUNNER_GC_FREEZE=1" ;; noqkvprep) env="GRAPHRUNNER_FUSED_QKV_PREP=0" ;;
      nogemv) env="GRAPHRUNNER_GEMV=0" ;; *) env="GRAPHRUNNER_GC_FREEZE=0" ;;
    esac
    (export "$env"; T 70 python3 tools/bench_prefix_cache.py --model /tmp/q06 --repeats 3 --json "$R/p1_$run.json" \
      > "$R/p1_$run.log" 2>&1)
  done
  ;;
act-pdl)
  # before turning GRAPHRUNNER_GEMV_ACT=1 GRAPHRUNNER_PDL=1 (and GRAPHRUNNER_FUSED_ADD_NORM=1) on by default: the GPU
  # tests with all three on, then L1/L2 off / act + PDL / all three, and T1 +- penalties with all three
  model
  # the kernel files whole (their unmarked tests run the compiled kernels on CUDA), then the GPU engine tests
  T 150 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_pdl.py tests/test_gemv_act.py \
    tests/test_add_norm.py tests/test_gemv.py > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  GRAPHRUNNER_GEMV_ACT=1 GRAPHRUNNER_PDL=1 GRAPHRUNNER_FUSED_ADD_NORM=1 T 240 python3 -m pytest -q -p no:cacheprovider \
    -m gpu --durations=5 tests/test_gpu_engine.py tests/test_gpu_capture.py tests/test_gpu_gemv_engine.py \
    > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  for run in off actpdl all; do
    case $run in actpdl) a=1 n=0 ;; all) a=1 n=1 ;; *) a=0 n=0 ;; esac
    GRAPHRUNNER_GEMV_ACT=$a GRAPHRUNNER_PDL=$a GRAPHRUNNER_FUSED_ADD_NORM=$n LAT_LIMIT=100 lat "l1_$run"
  done
  GRAPHRUNNER_GEMV_ACT=1 GRAPHRUNNER_PDL=1 GRAPHRUNNER_FUSED_ADD_NORM=1 T 200 python3 tools/bench_throughput.py \
    --model /tmp/q06 --no-peer --penalties both --runs 2 --json "$R/t1_pen.json" > "$R/t1_pen.log" 2>&1
  ;;
sizes-tests)
  # the twenty-third session's capture changes (coarser FULL decode sizes, PiecewiseBackend.install shared with the
  # saved compilation's rebuild): the GPU capture and precompile tests
  model
  T 240 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_capture.py \
    tests/test_capture_precompile.py > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  ;;
sizes-t1)
  # T1 at 200 requests, where decode steps run at batch 200: the default sizes pad them to 224, the old step-8
  # sizes (passed as compilation_config's cudagraph_capture_sizes) do not; new, old, new in turns
  model
  OLD=1,2,4$(seq -s, -f ',%g' 8 8 256 | tr -d '\n' | sed 's/,,/,/g')
  i=0; for v in new old new; do i=$((i + 1))
    T 110 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --num-requests 200 --runs 3 \
      $( [ $v = old ] && echo --capture-sizes "$OLD" ) --json "$R/t1_200_${i}_$v.json" > "$R/t1_200_${i}_$v.log" 2>&1
  done
  ;;
l2-table)
  # issue 17's L2: the kernel tables of a batch-1 and a batch-8 decode step side by side (where batch 8's extra
  # ~0.4 ms goes)
  model
  for b in 1 8; do
    T 150 python3 tools/bench_step_breakdown.py --model /tmp/q06 --batch $b --json "$R/step_b$b.json" \
      --trace /tmp/trace_b$b.json > "$R/step_b$b.log" 2>&1
  done
  ;;
quick)
  # after a change of defaults: the GPU engine / capture / precompile tests, then L1/L2, and what imports cost
  model
  T 260 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_engine.py \
    tests/test_gpu_capture.py tests/test_capture_precompile.py > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  lat l1
  T 60 python3 -X importtime -c "from graphrunner import LLM" 2> "$R/importtime.log"
  python3 tools/import_table.py "$R/importtime.log" > "$R/import_table.txt" 2>&1
  ;;
defaults)
  # the shipped defaults (GEMV table, fused attention prologue): L1/L2 and the kernel table, T1 with and without
  # penalties, then the GPU tests the fused-tests phase did not run, and the prologue's kernel tests on CUDA
  model
  lat l1
  T 150 python3 tools/bench_step_breakdown.py --model /tmp/q06 --json "$R/step_breakdown.json" \
    > "$R/step_breakdown.log" 2>&1
  T 200 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --penalties both --runs 3 \
    --json "$R/t1_pen.json" > "$R/t1_pen.log" 2>&1
  T 60 python3 -m pytest -q -p no:cacheprovider tests/test_qkv_prep.py > "$R/pytest_qkv_prep.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_qkv_prep.log"
  T 300 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=10 tests/test_engine_sampling.py \
    tests/test_capture_precompile.py tests/test_spec_decode_graphs.py > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  ;;
fused-tests)
  # the fused attention prologue and the GEMV's norm prologue: kernels on CUDA, then the GPU engine tests with both on
  T 150 python3 -m pytest -q -p no:cacheprovider tests/test_qkv_prep.py tests/test_gemv.py \
    > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  GRAPHRUNNER_FUSED_QKV_PREP=1 GRAPHRUNNER_GEMV_NORM=1 T 400 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 \
    tests/test_gpu_engine.py tests/test_gpu_capture.py tests/test_spec_eagle.py tests/test_gpu_gemv_engine.py \
    > "$R/pytest_gpu_fused.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu_fused.log"
  ;;
p1)
  model
  T 150 python3 tools/bench_prefix_cache.py --model /tmp/q06 --repeats 5 --profile \
    --json "$R/p1.json" > "$R/p1.log" 2>&1
  ;;
p1-phases)
  model
  # issue 14: where a hit's TTFT goes. The hit's attention shape (64 new tokens over 4,160 keys) per split count and
  # tile height, then P1 with the host phase table (tools/phase_timer.py) and the profiles
  for rows in 64 128; do
    T 120 python3 tools/bench_attention_splits.py --batch-sizes 1 --contexts 4160 --query-len 64 \
      --split-rows $rows --max-splits 64 --splits 1,4,8,16,24,32,48,64 --max-model-len 4168 \
      --json "$R/attn_hit_rows$rows.json" > "$R/attn_hit_rows$rows.log" 2>&1
  done
  T 170 python3 tools/bench_prefix_cache.py --model /tmp/q06 --repeats 5 --phases --profile \
    --json "$R/p1.json" > "$R/p1.log" 2>&1
  ;;
p1-ab)
  model
  # issue 14 / 17: the prefetching key loop (GRAPHRUNNER_ATTN_PREFETCH) and the one-launch staged writes: kernel
  # tests on CUDA, the attention sweep (hit shape and decode) with the loop off / on, P1 with host phases and L1/L2
  # under each, then the GPU engine tests (HF tokens, graphs == eager, no sync) with the new defaults
  T 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_prefetch.py tests/test_state_staging.py \
    tests/test_state_kernels.py tests/test_kernel_specialisation.py > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  for pf in 0 1; do
    GRAPHRUNNER_ATTN_PREFETCH=$pf T 60 python3 tools/bench_attention_splits.py --batch-sizes 1 --contexts 4160 \
      --query-len 64 --splits 8,16 --max-model-len 4168 --json "$R/attn_hit_pf$pf.json" > "$R/attn_hit_pf$pf.log" 2>&1
    GRAPHRUNNER_ATTN_PREFETCH=$pf T 60 python3 tools/bench_attention_splits.py --batch-sizes 1,8 \
      --contexts 200,330,1024,4096 --splits 1 --json "$R/attn_dec_pf$pf.json" > "$R/attn_dec_pf$pf.log" 2>&1
  done
  for pf in 0 1; do
    GRAPHRUNNER_ATTN_PREFETCH=$pf T 90 python3 tools/bench_prefix_cache.py --model /tmp/q06 --repeats 5 --phases \
      --json "$R/p1_pf$pf.json" > "$R/p1_pf$pf.log" 2>&1
  done
  for pf in 0 1; do GRAPHRUNNER_ATTN_PREFETCH=$pf lat "lat_pf$pf"; done
  GRAPHRUNNER_ATTN_PREFETCH=${P1AB_PREFETCH:-1} T 400 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 \
    tests/test_gpu_engine.py tests/test_gpu_capture.py tests/test_prefix_cache.py > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  ;;
l1-split)
  model
  # issue 17 / 14: decode attention below 256 keys split or not (the prefetching loop on), L1/L2 with the loop off /
  # on and with GRAPHRUNNER_ATTN_SPLIT_MIN_LEN=128, then T1 with prefix caching off / on (P1's 2% at 0% hits)
  GRAPHRUNNER_ATTN_PREFETCH=1 T 60 python3 tools/bench_attention_splits.py --batch-sizes 1,8 --contexts 128,160,200,256 \
    --splits 1,2,3,4,6 --json "$R/attn_short.json" > "$R/attn_short.log" 2>&1
  GRAPHRUNNER_ATTN_PREFETCH=1 lat lat_pf1_a
  GRAPHRUNNER_ATTN_PREFETCH=0 lat lat_pf0
  GRAPHRUNNER_ATTN_PREFETCH=1 GRAPHRUNNER_ATTN_SPLIT_MIN_LEN=128 lat lat_pf1_min128
  GRAPHRUNNER_ATTN_PREFETCH=1 lat lat_pf1_b
  for pc in off on; do
    flag=""; [ $pc = off ] && flag=--no-prefix-caching
    GRAPHRUNNER_ATTN_PREFETCH=1 T 100 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --detokenize \
      --runs 3 $flag --json "$R/t1_cache_$pc.json" > "$R/t1_cache_$pc.log" 2>&1
  done
  ;;
final15)
  model
  # the fifteenth session's defaults (prefetching key loop, decode splits from 128 keys, one-launch staged writes):
  # kernel tests on CUDA and the GPU engine / capture / prefix-cache tests, P1 with host phases, L1/L2 with the loop
  # on (default) and off
  T 120 python3 -m pytest -q -p no:cacheprovider tests/test_attention_prefetch.py tests/test_state_staging.py \
    tests/test_attention_splits_env.py tests/test_kernel_specialisation.py > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  T 270 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=5 tests/test_gpu_engine.py \
    tests/test_gpu_capture.py tests/test_prefix_cache.py > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  T 90 python3 tools/bench_prefix_cache.py --model /tmp/q06 --repeats 5 --phases --json "$R/p1.json" \
    > "$R/p1.log" 2>&1
  lat lat_default
  GRAPHRUNNER_ATTN_PREFETCH=0 lat lat_pf0
  ;;
attn-spills)
  model
  # issue 17 / 14: the attention kernel spills at 4 warps and 64 keys per tile (tools/kernel_resources.py, sm_90
  # with triton 3.6): decode (b = 1, 8) and the prefix-cache hit's chunk per (warps, tile, prefetch); attn-best then
  # times the engine
  python3 tools/kernel_resources.py --json "$R/kernel_resources.json" > "$R/kernel_resources.log" 2>&1
  for w in 4 8; do for t in 32 64; do for pf in 0 1; do
    GRAPHRUNNER_ATTN_WARPS=$w GRAPHRUNNER_ATTN_TILE=$t GRAPHRUNNER_ATTN_PREFETCH=$pf T 40 python3 \
      tools/bench_attention_splits.py --batch-sizes 1,8 --contexts 200,330,1024 --splits 1 \
      --json "$R/attn_dec_w${w}_t${t}_pf$pf.json" > "$R/attn_dec_w${w}_t${t}_pf$pf.log" 2>&1
    GRAPHRUNNER_ATTN_WARPS=$w GRAPHRUNNER_ATTN_TILE=$t GRAPHRUNNER_ATTN_PREFETCH=$pf T 30 python3 \
      tools/bench_attention_splits.py --batch-sizes 1 --contexts 4160 --query-len 64 --splits 8,16 \
      --max-model-len 4168 --json "$R/attn_hit_w${w}_t${t}_pf$pf.json" > "$R/attn_hit_w${w}_t${t}_pf$pf.log" 2>&1
  done; done; done
  ;;
attn-best)
  model
  # after attn-spills: L1/L2 with the defaults and with ATTN_BEST="WARPS TILE PREFETCH" (default "8 64 1"), P1 there
  lat lat_default
  read -r bw bt bp <<< "${ATTN_BEST:-8 64 1}"
  GRAPHRUNNER_ATTN_WARPS=$bw GRAPHRUNNER_ATTN_TILE=$bt GRAPHRUNNER_ATTN_PREFETCH=$bp lat lat_best
  GRAPHRUNNER_ATTN_WARPS=$bw GRAPHRUNNER_ATTN_TILE=$bt GRAPHRUNNER_ATTN_PREFETCH=$bp T 90 python3 \
    tools/bench_prefix_cache.py --model /tmp/q06 --repeats 5 --phases --json "$R/p1_best.json" > "$R/p1_best.log" 2>&1
  ;;
p1-rows)
  model
  # split prefill tiles of 128 rows (GRAPHRUNNER_ATTN_SPLIT_ROWS) against the default 64: the kernel tests on CUDA
  # with 128, then P1 under each
  [ "${ATTN_TESTS:-1}" = 1 ] && GRAPHRUNNER_ATTN_SPLIT_ROWS=128 T 180 python3 -m pytest -q -x -p no:cacheprovider -m gpu \
    tests/test_attention_triton.py -k gpu_matrix > "$R/pytest_attn_rows128.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_attn_rows128.log"
  for rows in 128 64; do
    GRAPHRUNNER_ATTN_SPLIT_ROWS=$rows T 70 python3 tools/bench_prefix_cache.py --model /tmp/q06 --repeats 5 \
      --json "$R/p1_rows$rows.json" > "$R/p1_rows$rows.log" 2>&1
  done
  ;;
bench2)
  model
  T 200 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --penalties both --runs 2 \
    --json "$R/t1_pen.json" > "$R/t1_pen.log" 2>&1
  T 150 python3 tools/bench_prefix_cache.py --model /tmp/q06 --repeats 5 --profile \
    --json "$R/p1.json" > "$R/p1.log" 2>&1
  T 150 python3 tools/bench_step_breakdown.py --model /tmp/q06 --json "$R/step_breakdown.json" \
    --trace /tmp/step_trace.json > "$R/step_breakdown.log" 2>&1
  ;;
startup)
  model
  # S1: cold (empty caches), precompile, warm start from it, eager
  # GRAPHRUNNER_LOG_LEVEL=INFO: each start-up stage with its seconds (load, compile, captures, KV) in s1.log
  # The device's Python packages carry no bytecode caches and cannot take new ones (the fourteenth session's warm
  # start compiled 678 modules from source, 1.9 s under cProfile, of 7.7 s of imports), where a pip install writes them: a
  # writable cache prefix measures what an installed engine sees (set STARTUP_PYC=0 to measure without it)
  [ "${STARTUP_PYC:-1}" = 1 ] && export PYTHONPYCACHEPREFIX=/tmp/pyc && python3 -c "from graphrunner import LLM" 2>/dev/null
  # STARTUP_STEPS picks the measurements; STARTUP_PROFILE=1 adds a warm start under cProfile ($R/prof/warm_profile.txt)
  GRAPHRUNNER_LOG_LEVEL=INFO T 560 python3 tools/bench_startup.py --model /tmp/q06 \
    --steps "${STARTUP_STEPS:-precompile,warm,cold,eager}" ${STARTUP_PROFILE:+--profile-dir "$R/prof"} \
    --json "$R/s1.json" > "$R/s1.log" 2>&1
  ;;
uncompiled)
  model
  T 330 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests/test_gpu_capture.py \
    tests/test_gpu_engine.py -k "uncompiled or capture or modes or identical or synchronises" \
    > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  UC='{"level": 0, "cudagraph_mode": "FULL"}'
  lat default
  T 130 python3 tools/bench_latency.py --model /tmp/q06 --no-peer --workloads L1,L2 --batch-sizes 8 \
    --compilation-config "$UC" --json "$R/uncompiled.json" > "$R/uncompiled.log" 2>&1
  lat default2
  T 150 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --runs 3 --compilation-config "$UC" \
    --json "$R/t1_uncompiled.json" > "$R/t1_uncompiled.log" 2>&1
  T 150 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --runs 3 --json "$R/t1_default.json" \
    > "$R/t1_default.log" 2>&1
  ;;
pair26)
  # issue 16's trained pair as the seventeenth session trained it (target 4 minutes, EAGLE head 1,500 steps), then
  # EAGLE at k = SPEC_KS against the target alone with the shipped GEMV table. Carry data/cache/demo_corpus; run
  # pair26b next while the machine is warm (/tmp/target and /tmp/eagle live only here)
  train_target
  T 240 python3 tools/train_demo_model.py train-eagle --data data/cache/demo_corpus --target /tmp/target \
    --out /tmp/eagle --max-steps "${EAGLE_STEPS:-1500}" --minutes "${EAGLE_MINUTES:-3}" > "$R/train_eagle.log" 2>&1
  SPEC_KS=${SPEC_KS:-4} spec_b1 150 eagle /tmp/eagle spec_eagle_shipped
  ;;
pair26b)
  # the same pair with the target's untuned shapes (qkv 2048 x 1024, o 1024 x 1024: cuBLAS at every M in the shipped
  # table) swept into a copy of the table: EAGLE against the target alone again, then where a plain step and a
  # k = 4 verify step spend their time
  cp graphrunner/models/gemv_configs.json /tmp/gemv_target.json
  T "${SWEEP_LIMIT:-200}" python3 tools/bench_kernels.py --only gemv --sweep --shapes 2048x1024,1024x1024 \
    --ms 1,2,3,4,5,8 --tuned-out /tmp/gemv_target.json --json "$R/bench_gemv.json" > "$R/bench_gemv.log" 2>&1
  cp /tmp/gemv_target.json "$R/gemv_target.json"
  export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_target.json
  SPEC_KS=${SPEC_KS:-4} spec_b1 150 eagle /tmp/eagle spec_eagle_tuned
  T 90 python3 tools/bench_step_breakdown.py --model /tmp/target --profile-steps 100 --json "$R/step_plain.json" \
    --trace "$R/trace_plain.json" > "$R/step_plain.log" 2>&1
  T 90 python3 tools/bench_step_breakdown.py --model /tmp/target --steps 32 --profile-steps 60 --speculative-method eagle \
    --draft-model /tmp/eagle --num-speculative-tokens 4 --json "$R/step_eagle.json" --trace "$R/trace_eagle.json" \
    > "$R/step_eagle.log" 2>&1
  rm -f "$R"/trace_*.json
  ;;
final26)
  # the eager fast paths (rope's one-gather lookup, RMSNorm in one launch) and the opaque callers: kernel tests on
  # CUDA, the capture tests (every engine kind, the merged no-sync test), the uncompiled bf16 parity test, the spec
  # GPU tests; then L1/L2 default, uncompiled, default again
  model &
  T 60 python3 -m pytest -q -p no:cacheprovider tests/test_eager_fast_paths.py tests/test_add_norm.py \
    > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  wait
  T 300 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests/test_gpu_capture.py \
    tests/test_gpu_engine.py tests/test_spec_eagle.py tests/test_spec_decode_graphs.py \
    -k "uncompiled or capture or modes or identical or synchronises or eagle or graphs" > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  UC='{"level": 0, "cudagraph_mode": "FULL"}'
  lat default
  T 130 python3 tools/bench_latency.py --model /tmp/q06 --no-peer --workloads L1,L2 --batch-sizes 8 \
    --compilation-config "$UC" --json "$R/uncompiled.json" > "$R/uncompiled.log" 2>&1
  lat default2
  ;;
untuned)
  # GRAPHRUNNER_GEMV_UNTUNED: default_config's row loop against cuBLAS at M = 1-4 on shapes no table lists
  # (Qwen3-1.7B / 4B / 8B, Llama-3-8B / 3.2-1B layers, LM heads, the demo model), then L1 with the switch on and
  # off on the 0.6B shape (its LM head is the one untuned weight) and on the Qwen3-1.7B shape, then the GEMV kernel
  # tests and the GEMV / 0.6B GPU engine tests with the switch on (the default)
  model &
  q17 &
  wait
  T 150 python3 tools/bench_kernels.py --only gemv --ms 1,2,3,4 --shapes "${UNTUNED_SHAPES:-4096x2048,2048x2048,\
12288x2048,2048x6144,6144x2560,2560x4096,19456x2560,2560x9728,6144x4096,4096x4096,24576x4096,4096x12288,28672x4096,\
4096x14336,3072x2048,16384x2048,2048x8192,151936x1024,151936x2048,128256x4096,1024x256,256x512,1536x256,256x768,\
4096x256}" --json "$R/bench_untuned.json" > "$R/bench_untuned.log" 2>&1
  l1_untuned
  T 200 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_gemv.py tests/test_gpu_gemv_engine.py \
    > "$R/pytest_gemv.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gemv.log"
  T 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py -k "06b" > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  ;;
verify26)
  # what the twenty-sixth session could not run: the narrowed untuned rule (one token where K <= 8192, two up to
  # 4096 x 2048 elements) under the GEMV, PDL and GEMV-engine tests on CUDA and the 0.6B bf16 parity tests, then L1
  # on the 0.6B and Qwen3-1.7B shapes with the rule on and off
  model &
  q17 &
  wait
  gemv_tests
  l1_untuned
  ;;
verify27)
  # verify26's tests without its L1 runs: at batch 1 the narrowed rule routes every shape as run 4's first rule did
  # (M = 1 where K <= 8192), so run 4's L1 figures stand
  gemv_tests
  ;;
sweep17)
  # the Qwen3-1.7B layer shapes (also issue 16's hidden-2048 target with 32 heads, 16 KV heads of 64, and its LM
  # head: 4096 x 2048) swept at M = 1-8 into a copy of the shipped table, then L1/L2 on the 1.7B shape with it
  q17 &
  cp graphrunner/models/gemv_configs.json /tmp/gemv_17.json
  T "${SWEEP_LIMIT:-260}" python3 tools/bench_kernels.py --only gemv --sweep \
    --shapes "${GEMV_SHAPES:-12288x2048,2048x6144,4096x2048,2048x2048}" --ms 1,2,4,5,8 \
    --tuned-out /tmp/gemv_17.json --json "$R/bench_gemv17.json" > "$R/bench_gemv17.log" 2>&1
  cp /tmp/gemv_17.json "$R/gemv_17.json"
  wait
  GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_17.json T 130 python3 tools/bench_latency.py --model /tmp/q17 --no-peer \
    --workloads L1,L2 --batch-sizes 8 --json "$R/lat17_swept.json" > "$R/lat17_swept.log" 2>&1
  ;;
pair27)
  # issue 16 on a target whose layers read their weights at about the bandwidth floor: hidden 2048 with 32 heads and
  # 16 KV heads of 64 (the Qwen3-1.7B layer shapes, in the committed table since sweep17), TARGET_LAYERS deep; its
  # EAGLE head; EAGLE at k = 4 against the target alone. Carry data/cache/demo_corpus; run pair27b next while the
  # machine is warm
  export TARGET_HIDDEN=${TARGET_HIDDEN:-2048} TARGET_HEADS=${TARGET_HEADS:-32} TARGET_KV_HEADS=${TARGET_KV_HEADS:-16}
  export TARGET_LAYERS=${TARGET_LAYERS:-16} TARGET_MINUTES=${TARGET_MINUTES:-3.5}
  train_target
  T 200 python3 tools/train_demo_model.py train-eagle --data data/cache/demo_corpus --target /tmp/target \
    --out /tmp/eagle --max-steps "${EAGLE_STEPS:-1500}" --minutes "${EAGLE_MINUTES:-2}" > "$R/train_eagle.log" 2>&1
  SPEC_KS=${SPEC_KS:-4} spec_b1 150 eagle /tmp/eagle spec_eagle
  ;;
pair27b)
  # the pair27 pair, continued: the draft model (the shipped demo model) at k = 3, 4, EAGLE at k = 3, then where a
  # plain step and a k = 4 EAGLE verify step spend their time (within the target's 1,024 positions)
  SPEC_KS=3,4 spec_b1 200 draft_model graphrunner/demo_model spec_draft
  SPEC_KS=3 spec_b1 120 eagle /tmp/eagle spec_eagle_k3
  T 90 python3 tools/bench_step_breakdown.py --model /tmp/target --steps 40 --profile-steps 100 \
    --json "$R/step_plain.json" > "$R/step_plain.log" 2>&1
  T 90 python3 tools/bench_step_breakdown.py --model /tmp/target --steps 32 --profile-steps 60 \
    --speculative-method eagle --draft-model /tmp/eagle --num-speculative-tokens 4 --json "$R/step_eagle.json" \
    > "$R/step_eagle.log" 2>&1
  # PDL off: each kernel's exclusive time, so the head's share of the verify step adds up
  GRAPHRUNNER_PDL=0 T 90 python3 tools/bench_step_breakdown.py --model /tmp/target --steps 32 --profile-steps 60 \
    --speculative-method eagle --draft-model /tmp/eagle --num-speculative-tokens 4 \
    --json "$R/step_eagle_nopdl.json" > "$R/step_eagle_nopdl.log" 2>&1
  ;;
head28)
  # issue 16: where a k = 4 EAGLE verify step's time goes on random-weight targets of the pair27 shape (hidden 2048,
  # 32 / 16 heads of 64, vocab 4096) at 16 and 28 layers (a verify step's cost does not depend on the weights: it
  # is always 1 + k tokens), PDL off so each kernel's time is its own; chrome traces of 6 steps for the attribution
  for L in ${HEAD_LAYERS:-16 28}; do
    [ -d /tmp/t$L ] || T 120 python3 tools/make_bench_model.py --out /tmp/t$L --vocab 4096 --hidden 2048 \
      --intermediate 6144 --layers $L --heads 32 --kv-heads 16 --head-dim 64 --max-position-embeddings 1024 \
      > "$R/make_t$L.log" 2>&1
    [ -d /tmp/e$L ] || T 120 python3 tools/train_demo_model.py train-eagle --data data/cache/demo_corpus \
      --target /tmp/t$L --out /tmp/e$L --max-steps 2 --batch-size 4 --seq-len 128 > "$R/make_e$L.log" 2>&1
    for pdl in 1 0; do
      GRAPHRUNNER_PDL=$pdl T 90 python3 tools/bench_step_breakdown.py --model /tmp/t$L --steps 40 --profile-steps 6 \
        --trace "$R/trace_plain_${L}_p$pdl.json" --json "$R/plain_${L}_p$pdl.json" > "$R/plain_${L}_p$pdl.log" 2>&1
      GRAPHRUNNER_PDL=$pdl T 90 python3 tools/bench_step_breakdown.py --model /tmp/t$L --steps 32 --profile-steps 6 \
        --speculative-method eagle --draft-model /tmp/e$L --num-speculative-tokens 4 \
        --trace "$R/trace_eagle_${L}_p$pdl.json" --json "$R/eagle_${L}_p$pdl.json" > "$R/eagle_${L}_p$pdl.log" 2>&1
    done
  done
  ;;
pair28)
  # issue 16 on a Qwen3-1.7B-deep target (hidden 2048, 32 / 16 heads of 64, TARGET_LAYERS 28): train it and its
  # EAGLE head, then EAGLE k = 4 with the committed GEMV table and with tensor-core rows up to M = 8 for the two
  # shapes cuBLAS serves at M = 5 (qkv 4096 x 2048, gate_up 12288 x 2048: a Triton kernel keeps the PDL chain).
  # Carry data/cache/demo_corpus; run pair28b next while the machine is warm
  export TARGET_HIDDEN=${TARGET_HIDDEN:-2048} TARGET_HEADS=${TARGET_HEADS:-32} TARGET_KV_HEADS=${TARGET_KV_HEADS:-16}
  export TARGET_LAYERS=${TARGET_LAYERS:-28} TARGET_MINUTES=${TARGET_MINUTES:-3} TARGET_BATCH=${TARGET_BATCH:-16}
  tc_table
  train_target
  T 200 python3 tools/train_demo_model.py train-eagle --data data/cache/demo_corpus --target /tmp/target \
    --out /tmp/eagle --max-steps "${EAGLE_STEPS:-1500}" --minutes "${EAGLE_MINUTES:-2.5}" > "$R/train_eagle.log" 2>&1
  SPEC_KS=4 spec_b1 100 eagle /tmp/eagle spec_eagle
  GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_tc.json SPEC_KS=4 spec_b1 100 eagle /tmp/eagle spec_eagle_tc
  ;;
pair28b)
  # the pair28 pair, continued: the EAGLE head's fc shape (2048 x 4096) swept into a table copy; EAGLE k = 3, 4 and
  # the draft model k = 3 with it; a verify step's kernels; the speculative-decoding tests on CUDA
  cp "${PAIR_TABLE:-graphrunner/models/gemv_configs.json}" /tmp/gemv_28.json
  T 120 python3 tools/bench_kernels.py --only gemv --sweep --shapes 2048x4096 --ms 1,2,4,5,8 \
    --tuned-out /tmp/gemv_28.json --json "$R/bench_gemv_fc.json" > "$R/bench_gemv_fc.log" 2>&1
  cp /tmp/gemv_28.json "$R/gemv_28.json"
  export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_28.json
  SPEC_KS=3,4 spec_b1 150 eagle /tmp/eagle spec_eagle_fc
  SPEC_KS=3 spec_b1 100 draft_model graphrunner/demo_model spec_draft
  T 90 python3 tools/bench_step_breakdown.py --model /tmp/target --steps 32 --profile-steps 6 \
    --speculative-method eagle --draft-model /tmp/eagle --num-speculative-tokens 4 --trace "$R/trace_eagle.json" \
    --json "$R/step_eagle.json" > "$R/step_eagle.log" 2>&1
  unset GRAPHRUNNER_GEMV_CONFIGS
  # the new kernels' unit tests on CUDA, then the GPU-marked engine tests (a -k selection also picked CPU tests
  # meant for Triton's interpreter, which fail on a CUDA machine without it: twenty-eighth session)
  T 200 sh -c 'python3 -m pytest -q -p no:cacheprovider tests/test_spec_decode_units.py \
    tests/test_sampling_gumbel_split.py -k "observe or greedy" && python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_spec_eagle.py tests/test_spec_decode_graphs.py' > "$R/pytest_spec.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_spec.log"
  ;;
pair29)
  # issue 16, the draft model observing after the post-update (k draft-model passes a verify step, not k + 1): the
  # observation kernel and the state kernels on CUDA, the GPU-marked verify-graph tests, then pair28's target (28
  # layers of hidden 2048, 3 minutes) and the draft model's batch-1 TPOT against it at k = 3, 4. Carry data/cache
  # (demo_corpus, and old_tree: `git archive` of the tree before the change); run pair29b next while warm
  T 150 sh -c 'python3 -m pytest -q -p no:cacheprovider tests/test_spec_decode_units.py \
    -k "draft_observe or observe_index or advance" && python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_spec_decode_graphs.py' > "$R/pytest_spec.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_spec.log"
  export TARGET_HIDDEN=2048 TARGET_HEADS=32 TARGET_KV_HEADS=16 TARGET_LAYERS=28 TARGET_BATCH=16
  TARGET_MINUTES=${TARGET_MINUTES:-3} train_target
  SPEC_KS=3,4 spec_b1 170 draft_model graphrunner/demo_model spec_draft
  ;;
pair29b)
  # pair29's target, continued: the tree before the change (data/cache/old_tree) at k = 3, 4, then this tree at
  # k = 2 and the kernels of its k = 3 verify step
  ( cd data/cache/old_tree && PYTHONPATH=$PWD T 170 python3 tools/bench_spec.py --model /tmp/target --no-peer \
    --method draft_model --draft-model ../../../graphrunner/demo_model --workloads text \
    --text-ids ../demo_corpus/val.npy --batch-sizes 1 --k 3,4 --interleave --json "$R/spec_draft_old.json" \
    > "$R/spec_draft_old.log" 2>&1 )
  SPEC_KS=2 spec_b1 100 draft_model graphrunner/demo_model spec_draft_k2
  T 90 python3 tools/bench_step_breakdown.py --model /tmp/target --steps 32 --profile-steps 6 \
    --speculative-method draft_model --draft-model graphrunner/demo_model --num-speculative-tokens 3 \
    --trace "$R/trace_draft.json" --json "$R/step_draft.json" > "$R/step_draft.log" 2>&1
  ;;
l2-30)
  # issue 17's L2: the tensor-core GEMV's launch shapes with one program per SM or fewer (bench_kernels --dot-space
  # few, which the default sweep leaves out; the table's own config competes) for the 0.6B layer shapes, merged into
  # a copy of the shipped table, then L2 at batch 8 with it and with the shipped table, in turns
  model &
  cp graphrunner/models/gemv_configs.json "$R/gemv_configs.json"
  T "${SWEEP_LIMIT:-300}" python3 tools/bench_kernels.py --only gemv --sweep --loop-from-table --dot-space few \
    --shapes "${GEMV_SHAPES:-o 2048,down,qkv,gate_up}" --ms 1,2,4,8 --tuned-out "$R/gemv_configs.json" \
    --json "$R/bench_gemv.json" > "$R/bench_gemv.log" 2>&1
  wait
  for t in swept shipped swept shipped; do
    [ $t = swept ] && export GRAPHRUNNER_GEMV_CONFIGS=$R/gemv_configs.json || unset GRAPHRUNNER_GEMV_CONFIGS
    l2b8 $t
  done
  unset GRAPHRUNNER_GEMV_CONFIGS
  ;;
l2-30b)
  # l2-30's two winners in the committed table (qkv 4096 x 1024 and o 1024 x 2048 at M = 2-8) against the table
  # before them (git HEAD~, or GEMV_OLD), L1 + L2 then L2 twice more, in turns; then the GEMV and 0.6B parity tests
  model
  git show "${GEMV_OLD:-HEAD~}:graphrunner/models/gemv_configs.json" > /tmp/gemv_old.json
  i=0; for t in new old new old new old; do i=$((i + 1))
    [ $t = old ] && export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_old.json || unset GRAPHRUNNER_GEMV_CONFIGS
    w=L2; [ $i -le 2 ] && w=L1,L2
    T 90 python3 tools/bench_latency.py --model /tmp/q06 --no-peer --workloads $w --batch-sizes 8 \
      --json "$R/lat_${t}_$i.json" > "$R/lat_${t}_$i.log" 2>&1
  done
  unset GRAPHRUNNER_GEMV_CONFIGS
  gemv_tests
  ;;
partials30)
  # models/linear_add_norm.py on CUDA (the ops bit-equal to the unfused path at M = 1..9, opcheck), L2 at batch 8
  # with it on and off (GRAPHRUNNER_GEMV_PARTIALS), in turns, then the engine tests it touches (0.6B bf16 against
  # HF and graphs == eager, the fused add + norm graphs, every capture mode == eager on the tiny models)
  model &
  T 120 python3 -m pytest -q -p no:cacheprovider tests/test_linear_add_norm.py > "$R/pytest_lan.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_lan.log"
  wait
  for t in on off on off; do
    [ $t = on ] && p=1 || p=0
    GRAPHRUNNER_GEMV_PARTIALS=$p l2b8 $t
  done
  T 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py tests/test_add_norm.py \
    tests/test_gpu_capture.py -k "06b or fused_add_norm or modes or identical" > "$R/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gpu.log"
  ;;
lan31)
  # models/linear_add_norm.py on CUDA after the thirtieth session's launch_gemv refactor (the ops bit-equal to the
  # unfused path at M = 1..9, opcheck), then the batch-1 and batch-8 decode steps' kernel tables with PDL off
  model &
  T 300 python3 -m pytest -q -p no:cacheprovider tests/test_linear_add_norm.py > "$R/pytest_lan.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_lan.log"
  wait
  for b in 1 8; do
    GRAPHRUNNER_PDL=0 T 120 python3 tools/bench_step_breakdown.py --model /tmp/q06 --batch $b \
      --json "$R/step_b$b.json" > "$R/step_b$b.log" 2>&1
  done
  ;;
pdl32)
  # where PDL kernels trigger their dependents (before their wait, the default, or after it: GRAPHRUNNER_PDL_LATE_TRIGGER)
  # at L1 / L2 in turns; then the batch-1 and batch-8 steps with PDL on, each kernel charged what it adds to the
  # timeline (kernel_table.critical_path; chrome traces kept); then test_pdl on CUDA with every kernel triggering late
  model
  i=0; for v in early all qkv_prep early all qkv_prep; do i=$((i + 1))
    if [ $v = early ]; then unset GRAPHRUNNER_PDL_LATE_TRIGGER; else export GRAPHRUNNER_PDL_LATE_TRIGGER=$v; fi
    lat "late_${v}_$i"
  done
  unset GRAPHRUNNER_PDL_LATE_TRIGGER
  for b in 1 8; do
    T 120 python3 tools/bench_step_breakdown.py --model /tmp/q06 --batch $b --steps 32 --profile-steps 50 --iters 20 \
      --trace "$R/trace_b$b.json" --json "$R/step_b$b.json" > "$R/step_b$b.log" 2>&1
  done
  GRAPHRUNNER_PDL_LATE_TRIGGER=all T 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_pdl.py \
    > "$R/pytest_pdl_late.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_pdl_late.log"
  ;;
late32)
  # where PDL kernels trigger their dependents by launch size: GRAPHRUNNER_PDL_LATE_FROM 5 (the default), 2, and 0
  # (never late), in turns: L1 and L2 at batch 2, 4 and 8, then T1 once each for the default and 0; then test_pdl on
  # CUDA under the default
  model
  i=0; for v in 5 2 0 5 2 0; do i=$((i + 1))
    GRAPHRUNNER_PDL_LATE_FROM=$v T 110 python3 tools/bench_latency.py --model /tmp/q06 --no-peer --workloads L1,L2 \
      --batch-sizes 2,4,8 --json "$R/lat_from${v}_$i.json" > "$R/lat_from${v}_$i.log" 2>&1
  done
  for v in 5 0; do
    GRAPHRUNNER_PDL_LATE_FROM=$v T 90 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer \
      --json "$R/t1_from$v.json" > "$R/t1_from$v.log" 2>&1
  done
  T 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_pdl.py > "$R/pytest_pdl.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_pdl.log"
  ;;
prep32)
  # the q/k prologue folded into decode attention (GRAPHRUNNER_ATTN_DECODE_PREP=1, attention/decode_prep.py): its tests
  # on CUDA (bf16 against the prologue + attention references, the engine's tokens through FULL graphs), then L1 / L2
  # at batch 8 with it off and on, at the default 4 warps and at 8 (at 4 the folded kernel spills more), in turns
  model &
  T 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_decode_prep.py \
    > "$R/pytest_prep.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_prep.log"
  wait
  i=0; for v in 0:0 1:0 1:8 0:0 1:0 1:8; do i=$((i + 1)); p=${v%:*}; w=${v#*:}  # (fold, warps; 0 = the rule: 4)
    GRAPHRUNNER_ATTN_DECODE_PREP=$p GRAPHRUNNER_ATTN_WARPS=$w lat "prep${p}_warps${w}_$i"
  done
  ;;
tc32)
  # the thirty-second session's critical path charges gate-up with its activation 7.5 us a layer at batch 8 (96
  # programs of 64 rows on 132 SMs, one a SM) and qkv 4.0 (64 programs, 160 KB shared each): tables whose
  # tensor-core rows (2-8 tokens) use more, smaller programs, timed in the step (L2 at batch 8) in turns with the
  # shipped table; the late PDL trigger (default from 5 tokens) is what they run under
  model
  python3 - <<'PY'
import json
base = json.load(open("graphrunner/models/gemv_configs.json"))
variants = {"gu32": {(6144, 1024): dict(block_n=32, block_k=256, num_stages=3)},
            "gu64k128": {(6144, 1024): dict(block_n=64, block_k=128, num_stages=4)},
            "qkv32": {(4096, 1024): dict(block_n=32, block_k=256, num_stages=3)},
            "both32": {(6144, 1024): dict(block_n=32, block_k=256, num_stages=3),
                       (4096, 1024): dict(block_n=32, block_k=256, num_stages=3)}}
for name, changes in variants.items():
    rows = json.loads(json.dumps(base))
    for r in rows:
        for c in r["configs"]:
            if (r["N"], r["K"]) in changes and c["use_dot"]:
                c.update(changes[(r["N"], r["K"])])
    json.dump(rows, open(f"/tmp/gemv_{name}.json", "w"))
PY
  for round in 1 2; do
    for t in shipped gu32 gu64k128 qkv32 both32; do
      if [ $t = shipped ]; then unset GRAPHRUNNER_GEMV_CONFIGS; else export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_$t.json; fi
      l2b8 "$t"
    done
  done
  unset GRAPHRUNNER_GEMV_CONFIGS
  ;;
l2-17)
  # the twenty-eighth session's tensor-core rows (qkv 4096 x 2048 and gate_up 12288 x 2048 up to M = 8, chosen on a
  # verify step) at L2 batch 8 on the Qwen3-1.7B shape, against the table without them (cuBLAS there), in turns
  q17
  python3 - <<'PY'
import json
rows = json.load(open("graphrunner/models/gemv_configs.json"))
for r in rows:
    if "note" in r:
        r["configs"] = [c for c in r["configs"] if not c["use_dot"]]
json.dump(rows, open("/tmp/gemv_no_tc.json", "w"))
PY
  for t in new old new old; do
    [ $t = old ] && export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_no_tc.json || unset GRAPHRUNNER_GEMV_CONFIGS
    T 80 python3 tools/bench_latency.py --model /tmp/q17 --no-peer --workloads L2 --batch-sizes 8 \
      --json "$R/l2_$t.json" >> "$R/l2_$t.log" 2>&1
  done
  unset GRAPHRUNNER_GEMV_CONFIGS
  ;;
l1-17)
  # L1 on the Qwen3-1.7B shape with the committed table (its layer shapes swept, sweep17) and without those four
  # rows (the untuned rule's row loop at M = 1), in turns: new, old, new
  q17
  python3 - <<'PY'
import json
rows = json.load(open("graphrunner/models/gemv_configs.json"))
old = [r for r in rows if (r["N"], r["K"]) not in {(12288, 2048), (2048, 6144), (4096, 2048), (2048, 2048)}]
json.dump(old, open("/tmp/gemv_no17.json", "w"))
PY
  for t in new old new; do
    [ $t = old ] && export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_no17.json || unset GRAPHRUNNER_GEMV_CONFIGS
    T 70 python3 tools/bench_latency.py --model /tmp/q17 --no-peer --workloads L1 --json "$R/l1_$t.json" \
      >> "$R/l1_$t.log" 2>&1
  done
  unset GRAPHRUNNER_GEMV_CONFIGS
  ;;
pieces33)
  # the eager piece compiler (compilation_config backend "eager", capture/saved_graph.py): its GPU tests (every graph
  # mode's tokens equal eager's, the 0.6B bf16 tokens bit-equal to eager's, the warm start without Dynamo on CUDA, the
  # rope and norm ops on CUDA; and test_pdl, late32's tests: every kernel late against early), then S1: precompile
  # and warm start of eager pieces and of the default, in turns
  model &
  T 300 python3 -m pytest -q -rf -p no:cacheprovider -m "gpu or not gpu" --durations=8 tests/test_gpu_capture.py \
    tests/test_saved_graph.py tests/test_eager_fast_paths.py tests/test_pdl.py > "$R/pytest_pieces.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_pieces.log"
  T 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_engine.py -k uncompiled \
    > "$R/pytest_pieces_06b.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_pieces_06b.log"
  wait
  export PYTHONPYCACHEPREFIX=/tmp/pyc && python3 -c "from graphrunner import LLM" 2>/dev/null
  GRAPHRUNNER_LOG_LEVEL=INFO T 300 python3 tools/bench_startup.py --model /tmp/q06 \
    --steps "${STARTUP_STEPS:-precompile-eager-pieces,warm-eager-pieces,precompile,warm,warm-eager-pieces,warm}" \
    --json "$R/s1.json" > "$R/s1.log" 2>&1
  ;;
lat33)
  # the step under the shipped default (PDL late from 5 tokens), with the late trigger never (LATE_FROM 0: last
  # session's early-everywhere baseline) and with eager pieces: L1 and L2 at batch 2, 4 and 8, in turns, twice; then
  # T1 (median of 3) for the default and for eager pieces
  model
  EP='{"backend": "eager"}'
  for i in 1 2; do
    LAT_LIMIT=110 lat3 "default_$i"
    GRAPHRUNNER_PDL_LATE_FROM=0 LAT_LIMIT=110 lat3 "late_from0_$i"
    LAT_LIMIT=110 lat3 "eager_pieces_$i" --compilation-config "$EP"
  done
  T 100 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --runs 3 --json "$R/t1_default.json" \
    > "$R/t1_default.log" 2>&1
  T 100 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --runs 3 --compilation-config "$EP" \
    --json "$R/t1_eager_pieces.json" > "$R/t1_eager_pieces.log" 2>&1
  ;;
next37)
  # what the thirty-seventh session's device time did not reach: test_gpu_engine's 0.6B tests with eager pieces the
  # default (HF's tokens, and eager pieces bit-equal to eager), the default's warm start on this host (measured
  # with the flag on an H100: 8.5-9.2 s), and whether 2-4 tokens gain from the late PDL trigger (LATE_FROM=2)
  model
  T 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_engine.py -k 06b \
    > "$R/pytest_06b.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_06b.log"
  export PYTHONPYCACHEPREFIX=/tmp/pyc && python3 -c "from graphrunner import LLM" 2>/dev/null
  GRAPHRUNNER_LOG_LEVEL=INFO T 200 python3 tools/bench_startup.py --model /tmp/q06 --steps precompile,warm,warm \
    --json "$R/s1.json" > "$R/s1.log" 2>&1
  for i in 1 2; do
    for from in 5 2; do
      GRAPHRUNNER_PDL_LATE_FROM=$from T 80 python3 tools/bench_latency.py --model /tmp/q06 --no-peer \
        --workloads L2 --batch-sizes 2,4 --json "$R/l2_from${from}_$i.json" > "$R/l2_from${from}_$i.log" 2>&1
    done
  done
  ;;
merge38)
  # the split merge unrolled and the seq_len load hoisted (bit-equal; predicted L1 -10 to -25 us, L2 b=8 -13 to
  # -32 us, L1 at max_model_len 40960 (16-split FULL graphs) -20 to -50 us) against the tree before them (base38/
  # held that tree's two attention files, carried untracked and not kept: rerun only with it rebuilt), in turns; the
  # folded merge (GRAPHRUNNER_ATTN_FOLD_MERGE=1) again now that its merge is unrolled too
  model
  B=/tmp/base38tree
  [ -d $B ] || { mkdir -p $B && cp -r graphrunner capture model_states tools $B/ && cp base38/*.py $B/graphrunner/attention/; }
  T 80 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_attention_fold_merge.py \
    tests/test_attention_triton.py tests/test_attention_splits_env.py > "$R/pytest_attn.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_attn.log"
  for t in new base; do
    d=$PWD; [ $t = base ] && d=$B
    (cd $d && PYTHONPATH=$d T 50 python3 tools/bench_attention_splits.py --batch-sizes 1,8 --contexts 200,330 \
      --splits 4,5,16 --json "$R/splits_$t.json" > "$R/splits_$t.log" 2>&1)
  done
  for run in base_1 new_1 fold_1 base40960 new40960 base_2 new_2 fold_2; do
    d=$PWD; f=0; long=""
    case $run in base*) d=$B ;; esac
    case $run in fold*) f=1 ;; esac
    case $run in *40960) long="--max-model-len 40960" ;; esac
    # shellcheck disable=SC2086
    (cd $d && PYTHONPATH=$d GRAPHRUNNER_ATTN_FOLD_MERGE=$f T 75 python3 tools/bench_latency.py --model /tmp/q06 \
      --no-peer --workloads L1,L2 --batch-sizes 8 $long --json "$R/$run.json" > "$R/$run.log" 2>&1)
  done
  ;;
od43)
  # issue 17, forty-third session: the fused gate-up + activation in one wgmma tile a program
  # (GRAPHRUNNER_GEMV_GATED_ONE_DOT=1; its two 32-row dots compile to mma.sync) and the LM head on the tensor-core
  # GEMV at 2-8 tokens (cuBLAS and its memset there): CUDA tests, kernels alone, then L1/L2 b=8 in turns
  model
  T 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -rfE tests/test_gate_up_act.py tests/test_spec_ngram.py \
    tests/test_gemv.py > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  T 120 python3 - > "$R/kernels.log" 2>&1 <<'PY'
import json, torch, triton
import torch.nn.functional as F
from graphrunner.models import gemv, gate_up_act
from graphrunner.models.gemv import GemvConfig
dev = torch.device("cuda")
def t(fn):
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=200)
w = torch.randn(6144, 1024, device=dev, dtype=torch.bfloat16) / 32
for m in (2, 8):
    x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    for st in (3, 4):
        cfg = GemvConfig(64, 256, 1, num_stages=st, use_dot=True, swap_ab=True)
        for od in (False, True):
            print(f"gate_up_act M={m} stages {st} one_dot {od}: {t(lambda: gate_up_act.gate_up_act_triton(x, w, None, cfg, one_dot=od)):.2f} us", flush=True)
lm = torch.randn(151936, 1024, device=dev, dtype=torch.bfloat16) / 32
cands = [GemvConfig(64, 256, 1, num_stages=s, use_dot=True, swap_ab=True) for s in (3, 4)] + \
        [GemvConfig(128, 128, 1, num_stages=4, use_dot=True, swap_ab=True), GemvConfig(128, 256, 1, num_stages=3, use_dot=True, swap_ab=True)]
res = {}
for m in (2, 4, 8):
    x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    print(f"lm_head M={m} cuBLAS {t(lambda: F.linear(x, lm)):.2f} us", flush=True)
    for c in cands:
        us = t(lambda: gemv.gemv_triton(x, lm, None, c)); res.setdefault(c, []).append(us)
        print(f"lm_head M={m} {c}: {us:.2f} us", flush=True)
pick = min(res, key=lambda c: sum(res[c]))
rows = json.load(open("graphrunner/models/gemv_configs.json"))
row = gemv._heuristic_config(151936, 1024, torch.cuda.get_device_properties(0).multi_processor_count)
rows.append({"N": 151936, "K": 1024, "configs": [dict(vars(row), max_m=1), dict(vars(pick), max_m=8)]})
json.dump(rows, open("/tmp/gemv_lm.json", "w"), indent=1)
print("picked", pick)
PY
  for round in 1 2; do
    for v in shipped onedot lm both; do
      unset GRAPHRUNNER_GEMV_CONFIGS GRAPHRUNNER_GEMV_GATED_ONE_DOT
      case $v in onedot|both) export GRAPHRUNNER_GEMV_GATED_ONE_DOT=1 ;; esac
      case $v in lm|both) [ -f /tmp/gemv_lm.json ] && export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_lm.json ;; esac
      lat "${v}_$round"
    done
  done
  unset GRAPHRUNNER_GEMV_CONFIGS GRAPHRUNNER_GEMV_GATED_ONE_DOT
  GRAPHRUNNER_GEMV_GATED_ONE_DOT=1 T 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/test_gpu_engine.py -k 06b > "$R/pytest_06b_onedot.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_06b_onedot.log"
  T 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_capture.py -k many_split \
    > "$R/pytest_many_split.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_many_split.log"
  ;;
od43b)
  # (after od43) the new defaults (one-dot gate-up, the LM head's tensor-core row): the kernel and 0.6B engine
  # tests, then L1/L2 b=8 in turns: new, new with the gate-up row at 4 stages, old (two dots, no LM head row)
  model
  T 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_engine.py -k 06b > "$R/pytest_06b.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_06b.log"
  python3 - <<'PY'
import json
rows = json.load(open("graphrunner/models/gemv_configs.json"))
json.dump([r for r in rows if r["N"] != 151936], open("/tmp/gemv_old.json", "w"))
for r in rows:
    for c in r["configs"]:
        if (r["N"], r["K"]) == (6144, 1024) and c["use_dot"]:
            c["num_stages"] = 4
json.dump(rows, open("/tmp/gemv_st4.json", "w"))
PY
  for round in 1 2; do
    for v in new st4 old; do
      unset GRAPHRUNNER_GEMV_CONFIGS GRAPHRUNNER_GEMV_GATED_ONE_DOT
      case $v in st4) export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_st4.json ;;
        old) export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_old.json GRAPHRUNNER_GEMV_GATED_ONE_DOT=0 ;; esac
      lat "${v}_$round"
    done
  done
  unset GRAPHRUNNER_GEMV_CONFIGS GRAPHRUNNER_GEMV_GATED_ONE_DOT
  ;;
acc44)
  # issue 17, forty-fourth session: the acceptance figure under the shipped defaults (L1/L2 b=8)
  model
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > "$R/gpu.txt" 2>&1
  lat shipped
  ;;
acc47)
  # issue 17, forty-seventh session: the acceptance figures under the shipped defaults on the card that came (the
  # call exits first unless it is an H200): L1/L2 b=8 twice, T1 (median of 3), then the 0.6B GPU engine suite
  model
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > "$R/gpu.txt" 2>&1
  lat shipped_1
  lat shipped_2
  t1 shipped
  T 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_engine.py > "$R/pytest_engine.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_engine.log"
  ;;
tests44)
  # the review mend of the gate-up kernel (one shared K loop) on CUDA, the 0.6B engine tests, the GEMV engine tests
  # (their table splits the qkv weight's K: the qkv partials path)
  model
  T 120 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -rfE tests/test_gate_up_act.py \
    > "$R/pytest_gate_up.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gate_up.log"
  # the qkv partials' producer through gemv_partials(out=) (the forty-fourth session's review mend)
  T 120 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -rfE tests/test_qkv_partials.py \
    > "$R/pytest_qkv_partials.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_qkv_partials.log"
  T 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_engine.py -k 06b > "$R/pytest_06b.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_06b.log"
  T 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_gemv_engine.py \
    > "$R/pytest_gemv_engine.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gemv_engine.log"
  ;;
sp44)
  # issue 17, forty-fourth session: decode attention's split target (GRAPHRUNNER_ATTN_TARGET_PROGRAMS; at batch 8 of
  # 8 KV heads 264 = 5 splits, 192 = 3, 128 = 2, 64 = none and no merge kernel): L2 b=8 in turns, twice
  model
  for round in 1 2; do
    for tp in 264 128 64 192; do
      GRAPHRUNNER_ATTN_TARGET_PROGRAMS=$tp l2b8 "t$tp"
    done
  done
  ;;
qp44)
  # issue 17, forty-fourth session: the qkv GEMV's split-K partials summed by the attention prologue
  # (models/qkv_partials.py): CUDA tests, then L2 b=8 in turns with the qkv row's 2-8-token config split 2 or 4
  # (partials on), split 2 with partials off (the GEMV's own tail), and the shipped unsplit row; the 0.6B engine
  # tests with the split-2 row
  model
  T 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -rfE tests/test_qkv_partials.py \
    tests/test_qkv_prep.py > "$R/pytest_kernels.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_kernels.log"
  python3 - <<'PY'
import json
for splits in (2, 4):
    rows = json.load(open("graphrunner/models/gemv_configs.json"))
    for r in rows:
        for c in r["configs"]:
            if (r["N"], r["K"]) == (4096, 1024) and c["use_dot"]:
                c["split_k"] = splits
    json.dump(rows, open(f"/tmp/gemv_qkv{splits}.json", "w"))
PY
  for round in 1 2; do
    for v in shipped qkv2 qkv4 qkv2tail; do
      unset GRAPHRUNNER_GEMV_CONFIGS GRAPHRUNNER_QKV_PARTIALS
      case $v in qkv2) export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_qkv2.json ;;
        qkv4) export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_qkv4.json ;;
        qkv2tail) export GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_qkv2.json GRAPHRUNNER_QKV_PARTIALS=0 ;; esac
      l2b8 "$v"
    done
  done
  unset GRAPHRUNNER_GEMV_CONFIGS GRAPHRUNNER_QKV_PARTIALS
  GRAPHRUNNER_GEMV_CONFIGS=/tmp/gemv_qkv2.json T 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/test_gpu_engine.py -k 06b > "$R/pytest_06b_qkv2.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_06b_qkv2.log"
  ;;
an44)
  # issue 17, forty-fourth session: the add + norm kernels' warps (GRAPHRUNNER_ADD_NORM_WARPS; 4 shipped): L1 and
  # L2 b=8 in turns, then the add + norm tests on CUDA at 8 warps
  model
  for w in 4 8 16 8 4; do
    GRAPHRUNNER_ADD_NORM_WARPS=$w lat "w${w}_$(date +%s)"
  done
  GRAPHRUNNER_ADD_NORM_WARPS=8 T 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -rfE \
    tests/test_add_norm.py tests/test_linear_add_norm.py > "$R/pytest_w8.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_w8.log"
  ;;
w46)
  # issue 17, forty-sixth session: w45 again in ABBA order (4, 8, 8, 4 warps; w45 ran 8 first on a cold machine and its
  # L1 and T1 read worse for it), ROUNDS (1) times; T1 for each, 4 warps first (compare device_p50_ms, not host time)
  model
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > "$R/gpu.txt" 2>&1
  for i in $(seq "${ROUNDS:-1}"); do
    GRAPHRUNNER_ADD_NORM_WARPS=4 LAT_LIMIT=100 lat3 "w4a_$i"
    LAT_LIMIT=100 lat3 "w8a_$i"
    LAT_LIMIT=100 lat3 "w8b_$i"
    GRAPHRUNNER_ADD_NORM_WARPS=4 LAT_LIMIT=100 lat3 "w4b_$i"
  done
  GRAPHRUNNER_ADD_NORM_WARPS=4 t1 w4
  t1 w8
  ;;
w45)
  # issue 17, forty-fifth session: the add + norm kernels at 8 warps (the new default) against 4 (the old one): the
  # acceptance figure, L1 and L2 at batch 2/4/8 in turns, ROUNDS (2) times; T1 (median of 3) for each; the 0.6B engine tests
  model
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > "$R/gpu.txt" 2>&1
  for i in $(seq "${ROUNDS:-2}"); do
    LAT_LIMIT=100 lat3 "w8_$i"
    GRAPHRUNNER_ADD_NORM_WARPS=4 LAT_LIMIT=100 lat3 "w4_$i"
  done
  t1 w8
  GRAPHRUNNER_ADD_NORM_WARPS=4 t1 w4
  T 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_engine.py -k 06b > "$R/pytest_06b.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_06b.log"
  ;;
fin44)
  # (after qp44) the opcheck fix and the GEMV engine tests (their table splits qkv: the partials path in every graph
  # mode); the qkv partials on the 1.7B shape, whose shipped qkv row splits K at 2-8 tokens (so the partials path is
  # its default now): L2 b=8 on / off in turns; then the split target at batch 8, one round
  T 60 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_qkv_partials.py -k opcheck \
    > "$R/pytest_opcheck.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_opcheck.log"
  T 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_gemv_engine.py \
    > "$R/pytest_gemv_engine.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_gemv_engine.log"
  q17
  for round in 1 2; do
    for p in 1 0; do
      GRAPHRUNNER_QKV_PARTIALS=$p T 90 python3 tools/bench_latency.py --model /tmp/q17 --no-peer --workloads L2 \
        --batch-sizes 8 --json "$R/q17_p${p}_$round.json" > "$R/q17_p${p}_$round.log" 2>&1
    done
  done
  model
  for tp in 264 64 128 264; do
    GRAPHRUNNER_ATTN_TARGET_PROGRAMS=$tp l2b8 "t$tp"
  done
  ;;
ab41)
  # issue 17, forty-first session: empty split programs store no acc and the merges do not read it (bit-equal;
  # predicted at max_model_len 40960: L1 -10 to -20 us; measured in the forty-second session: -18 us) against the
  # tree before, in turns. The base tree is this one with the change undone by tools/ab41_base.py.
  model
  B=/tmp/base41tree
  [ -d $B ] || { mkdir -p $B && cp -r graphrunner capture model_states tools $B/ && python3 tools/ab41_base.py $B; } \
    || { echo "no base tree" > "$R/base.log"; rm -rf $B; }
  T "${AB41_TEST_S:-100}" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -rfE \
    tests/test_attention_triton.py tests/test_attention_fold_merge.py \
    -k "past_the_last or nan or folded_merge_is_bit or gpu_decode or gpu_fp16" > "$R/pytest_attn.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_attn.log"
  for run in ${AB41_RUNS:-base40960_1 new40960_1 base40960_2 new40960_2 base_1 new_1}; do
    d=$PWD; long=""
    case $run in base*) d=$B ;; esac
    case $run in *40960*) long="--max-model-len 40960" ;; esac
    # shellcheck disable=SC2086
    (cd $d && PYTHONPATH=$d T 75 python3 tools/bench_latency.py --model /tmp/q06 \
      --no-peer --workloads L1,L2 --batch-sizes 8 $long --json "$R/$run.json" > "$R/$run.log" 2>&1)
  done
  ;;
ab41-tests)
  # (warm, after ab41) the GPU tests around the change: the capture tests, the 0.6B engine tests (HF's tokens,
  # eager pieces bit-equal to eager), then S1 warm
  model
  T 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_capture.py > "$R/pytest_capture.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_capture.log"
  T 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_gpu_engine.py -k 06b > "$R/pytest_06b.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_06b.log"
  export PYTHONPYCACHEPREFIX=/tmp/pyc && python3 -c "from graphrunner import LLM" 2>/dev/null
  GRAPHRUNNER_LOG_LEVEL=INFO T 200 python3 tools/bench_startup.py --model /tmp/q06 \
    --steps precompile,warm,warm --json "$R/s1.json" > "$R/s1.log" 2>&1
  ;;
uncompiled-s1)
  model
  export PYTHONPYCACHEPREFIX=/tmp/pyc && python3 -c "from graphrunner import LLM" 2>/dev/null
  GRAPHRUNNER_LOG_LEVEL=INFO T 300 python3 tools/bench_startup.py --model /tmp/q06 \
    --steps "${STARTUP_STEPS:-precompile-uncompiled,warm-uncompiled,precompile,warm,warm-uncompiled,warm}" \
    --json "$R/s1.json" > "$R/s1.log" 2>&1
  ;;
serve)
  model
  wheels
  # the offline figures SV1 is held against, in the same run: L1 and T1 (with detokenization, as the server does)
  T 120 python3 tools/bench_latency.py --model /tmp/q06 --no-peer --workloads L1 --json "$R/l1.json" \
    > "$R/l1.log" 2>&1
  T 150 python3 tools/bench_throughput.py --model /tmp/q06 --no-peer --detokenize --json "$R/t1.json" \
    > "$R/t1.log" 2>&1
  T 270 python3 tools/bench_sv1.py --model /tmp/q06 --engine-process --offline-l1 "$R/l1.json" \
    --offline-t1 "$R/t1.json" --log "$R/serve_proc.log" --json "$R/sv1_process.json" > "$R/sv1_process.out" 2>&1
  ;;
serve-thread)
  model
  wheels
  T 270 python3 tools/bench_sv1.py --model /tmp/q06 --no-engine-process --log "$R/serve_thread.log" \
    --json "$R/sv1_thread.json" > "$R/sv1_thread.out" 2>&1
  ;;
tp)
  # one architecture first, verbose and unbuffered straight to the log (never through `tail`: a killed pipeline
  # returns nothing), with Python's stacks dumped when a test runs past 120 s (a hang shows where it waits)
  # each rank logs its start-up stages, graphs and steps; a stalled step or start-up fails after 150 s (not 600) and
  # prints the workers' stacks, as does a worker that gets no plan for 90 s
  GRAPHRUNNER_LOG_LEVEL=DEBUG GRAPHRUNNER_TP_TIMEOUT_S=150 GRAPHRUNNER_TP_STACKS_AFTER_S=90 \
  T 280 python3 -m pytest -v -s -x -p no:cacheprovider -m gpu -o faulthandler_timeout=120 --durations=10 \
    tests/test_gpu_tensor_parallel.py -k "qwen3 or rank0 or killed" > "$R/pytest_tp_first.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_tp_first.log"
  GRAPHRUNNER_LOG_LEVEL=INFO GRAPHRUNNER_TP_TIMEOUT_S=150 GRAPHRUNNER_TP_STACKS_AFTER_S=90 \
  T 280 python3 -m pytest -v -s -p no:cacheprovider -m gpu -o faulthandler_timeout=120 --durations=10 \
    tests/test_gpu_tensor_parallel.py tests/test_sampling_vocab_parallel.py -k "not qwen3 and not rank0 and not killed" \
    > "$R/pytest_tp_rest.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_tp_rest.log"
  ;;
tp-symm)
  # issue 18: the one-shot symmetric-memory all-reduce (GRAPHRUNNER_TP_ALLREDUCE=symm_mem) against NCCL: its tokens
  # test, then TP=2 decode with it (TP=1 and TP=2-with-NCCL as in tp-bench, the model reused when present)
  GRAPHRUNNER_LOG_LEVEL=INFO T 200 python3 -m pytest -v -s -p no:cacheprovider -m gpu --durations=5 \
    tests/test_gpu_tensor_parallel.py -k symmetric > "$R/pytest_tp_symm.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_tp_symm.log"
  if [ "${TP_SYMM_BENCH:-1}" = 1 ]; then  # TP_SYMM_BENCH=0: the test only
    T 300 python3 tools/bench_tp.py --out /tmp/qwen3-8b-random --tp-sizes 2 --check-prompts 0 \
      --json "$R/bench_tp_nccl.json" > "$R/bench_tp_nccl.log" 2>&1
    GRAPHRUNNER_TP_ALLREDUCE=symm_mem T 300 python3 tools/bench_tp.py --out /tmp/qwen3-8b-random --tp-sizes 2 \
      --json "$R/bench_tp_symm.json" > "$R/bench_tp_symm.log" 2>&1
  fi
  ;;
tp-killed)
  GRAPHRUNNER_LOG_LEVEL=INFO T 150 python3 -m pytest -v -s -p no:cacheprovider -m gpu --durations=5 \
    tests/test_gpu_tensor_parallel.py -k killed > "$R/pytest_tp_killed.log" 2>&1
  echo "pytest rc=$?" >> "$R/pytest_tp_killed.log"
  ;;
tp-bench)
  T 560 python3 tools/bench_tp.py --out /tmp/qwen3-8b-random --tp-sizes 1,2 \
    --t1-requests "${TP_T1:-256}" --max-num-seqs 256 --json "$R/bench_tp.json" \
    > "$R/bench_tp.log" 2>&1
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt" 2>&1
tar -czf "$OUT/$phase.tgz" -C "$OUT" "$phase" && rm -rf "$R"
done
