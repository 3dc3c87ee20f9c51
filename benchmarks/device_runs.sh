#!/bin/bash
# The GPU runs still owed, as named plans for one device call each (a call is limited to
# 10 minutes and returns at most 8 files, so each plan packs its results into one archive).
#
#   bash benchmarks/device_runs.sh PLAN        # on the GPU machine; OUT defaults to ./device-out
#
# Plans (nvidia-h200-x2 unless marked "one GPU", which also run on nvidia-h200; plans that use
# GPUs one by one give each job its own compilation cache, so cold start-up stays cold).
# Still owed after session 5: tpcheck (its f32 default and bf16 runs hit a 45 s limit, now
# 90 s) and va1 again (throughput-nano with SKIP_TEMP needs repeats).
#   engine  GPU0: HF peer batch, then the engine's startup/latency/batch128/decode256 with the
#           ratio to it, then throughput-nano. GPU1: throughput-1k, then the kernel-decode/prefill grid.
#   tp      TP=1 vs TP=2 in one run: collective-matmul, latency with decode traces, then the
#           exposed collective time of those traces; TP=2 latency again with CUDA graphs
#           over collectives and conditionals.
#   tp1k    TP=1 vs TP=2 in one run: throughput-1k.
#   tpsame  TP=1 vs TP=2 in one run: latency (with decode traces) and throughput-1k; then one
#           GPU's latency and decode256 without CUDA graphs.
#   tpgraphs TP=1 vs TP=2 latency with decode traces, host summaries; TP=2 without CUDA graphs.
#   next    what session 4 left: TP=2 decode with synchronous collectives and with XLA's
#           overlap options, the collective matmul, the kernel grid's 32k rows, greedy
#           agreement in bf16 (batched vs alone).
#   va      TP=1/TP=2 latency with stable buffer addresses for CUDA graphs (SKIP_TEMP), with
#           host summaries; TP=2 with XLA's one-shot all-reduce kernel instead of NCCL; both.
#   va1     one GPU: latency, decode256 and throughput-nano with and without stable buffer
#           addresses for CUDA graphs (SKIP_TEMP).
#   tpcheck greedy tokens of TP=2 against TP=1: f32 default, f32 and bf16 with the TP latency recipe.
#   warm    one GPU: 8B start-up with a cold, then a warm compilation cache.
#   ab1, ab2, ab3  one GPU, three calls in a row: this tree against .baseline/ (compare_trees.py):
#           start-up, latency, throughput-nano and throughput-1k, 3+ runs each, interleaved; f32
#           agreement with transformers; peak host memory of loading 8B safetensors, both trees.
#   lab     GPU0: latency_lab (where batch-1 decode time goes), then throughput-1k with a trace of
#           8 steady decode steps and its kernel breakdown. GPU1: the kernel's tile-size sweep
#           (the data behind block_sizes.py).
#   s7a, s7b, s7c  one GPU, session 7 (carry .whl and .cache/smollm2-tokenizer): s7a the attention
#           frontier sweep, the GEMV table and the structured-output host cost; s7b the FP8 HLO check,
#           the verify step's cost and fp8 latency/throughput-1k; s7c bf16 latency and throughput-1k
#           with and without a JSON schema (half scale).
#   s8fp8   one GPU, session 8 (carry .whl): fp8 weights + fp8 KV with W8A8 programs compiled
#           without Triton GEMMs: cold start-up, latency, throughput-1k at max_num_seqs 1024 with
#           a trace of 8 steady decode steps, its kernel and host tables; then, if time is left,
#           throughput-1k at 896 (no preemption).
#   s8spec  one GPU (carry .whl): speculative decoding through the engine loop at batch 1 (8B shapes):
#           plain async decode, asynchronous and synchronous verify steps at k = 5, and the
#           low-gain switch's cost, combined with the CPU-measured acceptance.
#   s8lat, s8lat2  one GPU, session 8, batch-1 decode (carry .whl), two calls with a step between:
#           s8lat (~5 min) latency_lab's per-kernel breakdown of the batch-1 step, bf16 and fp8
#           weights, then gemv_decode's sweep (new fp8 candidates, bf16 in the dense [K, N] layout).
#           Then adopt its table here: cp <files>/s8lat/gemv_decode/gpu_gemv_table.json
#           pallas_kernels/quantized_matmul/ (commit it). s8lat2 (~4 min) engine latency bf16 and
#           fp8 weights + fp8 KV with the adopted table, and latency_lab again without traces.
#   s8final one GPU, session 8's last call (carry .whl): the FP8 engine (cold start, latency,
#           throughput-1k at 1024 sequences with a trace), then the GEMV sweep at M = 8 and 1, its
#           table adopted in place for engine latency in bf16 and fp8, then prefill_peers with the
#           time left.
#   s9a     one GPU, session 9 (carry .whl): fp8 throughput-1k at 1024 sequences with a trace of 6
#           steady decode steps (kernel and host tables) and a cProfile of 24 more, then latency_lab.
#   s9b     one GPU, session 9 (carry .whl): s8spec's engine run, then the fp8-page tile sweep.
#   s9c     one GPU, session 9 (carry .whl and .gpu/fp8mma, a helper's tree): the FP8-dot decode
#           modes, the fresh-prefill path in the engine, EAGLE-3's cost at batch 1.
#   s9d     one GPU, session 9's last call (carry .whl): fp8 throughput-1k (trace + cProfile), async
#           verify at k = 7/15, engine latency bf16/fp8, then bf16 throughput-1k with the time left.
#   s9eagle one GPU (carry .whl), session 9: EAGLE-3 at batch 1 (8B shapes, a random head of the
#           Llama-3.1-8B heads' shapes): the verify step with and without the target's features,
#           the head's round and the synchronous cycle for k = 1/3/5 (spec_decode.py eagle3),
#           then the engine loop with a random head checkpoint at k = 3/5 (eagle3-engine).
#   s10a    one GPU, session 10 (carry .whl): bf16 throughput-1k at 384 sequences (a bf16-sized
#           batch) with its phase split, the batch-1 breakdown with the fused-write kernel beside
#           the default, the donated input slot's A/B, prefill attention against cuDNN.
#   s10b    one GPU, session 10 (carry .whl): fp8 throughput-1k at 1024 sequences with the step
#           buckets every 128 rows (greedy admission, as session 9 measured it), then bf16 at 1024
#           sequences under "reserve" and "greedy" admission, same call.
#   s10c    one GPU, session 10 (carry .whl): the GEMV sweep with the bit-conversion forms over
#           every projection at M 1-16, its table adopted in place for fp8 engine latency, then bf16
#           throughput-1k at 1024 sequences under "reserve" admission with the time left.
#   s10d    one GPU, session 10 (carry .whl): fp8 throughput-1k with a trace of 3 prefill-carrying
#           steps of the admission ramp and its kernel table (where the prefill phase's time goes).
#   s11a    one GPU, queued by session 10 (carry .whl): the W8A8 MLP block with float32 against
#           bfloat16 GEMM outputs (w8a8_epilogue.py), the donated input slot's A/B (step_dispatch.py,
#           fixed), then bf16 throughput-1k at 1024 sequences under "greedy" and "reserve" admission in
#           one call (same buckets: session 10's two were in different calls and bucket sets).
#   s12a    one GPU, queued by session 11: the e4m3-wgmma Mosaic GPU decode kernel against the
#           engine's Triton kernel over fp8 pages (fp8_wgmma_decode.py), then steps of several
#           fresh prompts (8x1000, 4x2000, 2x4000) through Triton, the one-prompt fresh path and the
#           several-prompt one, over bf16 and fp8 pages (prefill_peers.py).
#   s12b    one GPU (carry .whl): s11a with "reserve" now learning its ratio from finished requests.
#   s12c    one GPU: fp8 throughput-1k (fp8 weights + fp8 KV, 1024 sequences) with static activation
#           scales (calibrated on random prompts in the run) against dynamic ones, in one call.
#   s13a    one GPU (carry .whl), queued by session 12: the static-scale fp8 engine's programs
#           compiled one by one (compile_time.py, each bucket's seconds flushed before the next; the
#           W8A8 buckets first) with an HLO/PTX dump of what was compiled, to name the program
#           ptxas takes minutes on; then bf16 throughput-1k at 1024 under the projected admission.
#   s13b    one GPU (carry .whl): fp8 throughput-1k at 1024 with static against dynamic scales
#           (session 13 found why session 12's static engine never finished warming up: committed
#           scales made each program compile twice; fixed, and the engine log now counts such
#           recompilations, "compiled again at their first run", which must be 0 here).
#   s13c    one GPU: where moderate-batch decode steps go (latency_lab --batches 16,32,64,128 at 1536
#           tokens of context, fp8 and bf16 weights, traced): fp8 steps of 16-128 sequences ran
#           5-11 ms in session 12's throughput-1k, 1.5-3x a weight-and-K/V-read estimate; the 16-64-row
#           steps again as W8A8 (--w8a8-min-tokens 16), to place FP8_W8A8_MIN_TOKENS by measurement.
#   s13d    one GPU (carry .whl), session 13: W8A8 programs without XLA's dot merger (the merged
#           gate/up and q/k/v weights were copied every step): fp8 throughput-1k at 1024 with it
#           off, the FP8 HLO check (no weight concatenation), latency_lab at 64 and 128 sequences
#           with the merger off (traced) and on (XLA_FLAGS, timed), then throughput-1k with it on.
#   s13e    one GPU, session 13: compile time of the fp8 engine's programs with dynamic against
#           static activation scales, same call (each with an XLA dump of the 2048-token program,
#           summarized on the machine by hlo_dump_summary.py), then latency_lab at 32 and 64
#           sequences as weight-only and as W8A8 (where FP8_W8A8_MIN_TOKENS belongs, merger off).
#   s14b    one GPU, queued by session 13: the decode kernel's tiles at moderate batches, where it
#           reads at 75-81% inside whole steps (16-32 sequences at 1.5k tokens; issue 21's B=32
#           goal is 88%): kernel_frontier.py's decode sweep at 16/32 sequences x 1.5k/4k tokens
#           (adopt with adopt_frontier_run.py if it wins), then latency_lab at 16 and 32 sequences.
#   s14c    one GPU (carry .whl), queued by session 13: the 8B engine's cold start-up restored from
#           an Orbax checkpoint (engine_throughput.py --via-orbax: a converted model's arrays come
#           back committed; before session 13's fix every program compiled twice at warm-up), then
#           cold from random weights, each with an empty compilation cache; "twice" must read 0.
#   s15b    one GPU, queued by session 15: the fresh-prefill windows compiled once, early (Mosaic GPU kernels
#           now hash by content, so warm-up's shared kernels are found in jaxlib's cache by the steps):
#           the 8B bf16 cold start-up (s15a: 72.9 s), then the 8192-, 2048- and 1024-token programs compiled
#           alone with attention "auto" without and with --shared-kernels, and "pallas_gpu" (no branches).
#   s15a    one GPU, session 15: where the 8B cold start-up goes (90 s in s14c, longest program = the pool's
#           wall): bf16 start-up with warm-up lowering in one thread (each program's lowering and compile
#           seconds logged), then with XLA's autotuning at level 1 (no buffer checks) and at 0 (none),
#           each with an empty compilation cache.
#   s16b    one GPU, session 16: prefill attention re-checked after session 10's restructured
#           timing path (prefill_peers.py: Triton, the fresh path, the branchless window and cuDNN at
#           4k-32k, the ragged batch and 8 x 1000), the numbers behind issue 21's prefill goal.
#   s16c    one GPU, session 16: the fresh-prefill path with cuDNN's flash attention for its windows (each
#           prompt on its own length: no conditional, no window ladder) against the bundled-kernel path
#           and cuDNN alone (prefill_peers.py), then inside the engine (prefill_engine.py: compile, TTFT,
#           a prefill-heavy mix, first-token agreement) with the time left.
#   s16d    one GPU, queued by session 16: s16c found cuDNN computing every query row of a padded window,
#           so cuDNN now runs inside the bundled path's window ladder; prefill_peers.py on the shapes
#           where the windows matter (4k, the ragged batch, 8 x 1000, 8k, 16k), then, with END past ~400,
#           prefill_engine.py with both paths (compile, TTFT at 4k/16k/32k, the prefill mix): what
#           decides HOPPER_AUTO_IMPL. Session 17 added the cuDNN segments path (packed layout, no windows).
#   s17a    one GPU, session 17: start-up with the segments path as "auto", its shortest prompt, throughput-1k.
#   s17b    one GPU, session 17: prompts of >= 1000 tokens on the segments path: start-up again, fp8 throughput-1k.
#   s17c    one GPU, session 17: segment slots capped by the step's rows, at 16k/32k and in the engine.
#   s17d    one GPU, session 17: s16d's engine comparison again (segments path vs the window path).
#   s18a    one GPU, queued by session 17: the segments path's parts (scatter, slots) at 4k-32k.
#   s18b    one GPU: the segments path at 4k-16k against its cuDNN call alone, and its kernels traced.
#   s18c    one GPU: Triton's rows written into cuDNN's output (no select, no zero fill), A/B against
#           .baseline/ (HEAD before it: `git archive` of the code dirs, carried) in the kernel, decode and engine.
#   s18d    one GPU: s18c's kernel and decode A/B again, padding rows zeroed by a small kernel (not a scatter).
#   s18e    one GPU: s18c's engine A/B again, on the final code.
#   s18f    one GPU: the segments path checked against the reference on the GPU; throughput-1k bf16.
#   s18g    one GPU: one layer's K/V write, XLA's two scatters against one Pallas launch (gpu_write_kv.py).
#   s19a    one GPU: the default decode kernel's prefetch / Pallas merge / splits at few sequences
#           (decode_small_batch.py), s18g, the batch-1 bf16 step under XLA dot-merging and fusion options.
#   s19b    one GPU: s19a's decode kernel A/B again in interleaved rounds; the bf16 steps of 8, 32 and 128
#           sequences with gate/up merged (the engine's default from session 19) and with XLA's default.
#   s19c    one GPU: the decode kernel at the session-19 split counts against session 18's; the engine's
#           batch-1 latency in bf16, this tree against .baseline/ (session 18's code, carried), then fp8.
#   s19d    one GPU: the engine's bf16 latency (final code); the batch-1 fp8-weight step with gate/up merged
#           (XLA's dot merger at 1 GB) and without.
#   s19e    one GPU: the engine's fp8 batch-1 latency with gate/up merged (while MERGED_DOTS_QUANTIZATIONS
#           held fp8) and with XLA's default (XLA_FLAGS), one after the other (run by hand as these two commands).
#   s20a    one GPU: the residual add + RMSNorm kernel against XLA's two kernels (residual_norm_gpu.py); the
#           batch-1 and 32-sequence bf16 steps, this tree against .baseline/ (session 19's model, carried).
#           The kernel, its model wiring and its benchmark are at commit ceafa34 (slower: reverted after it).
#   s20b    one GPU: the engine's bf16 batch-1 latency, this tree, .baseline/, this tree; then fp8.
#   s20c    one GPU: s20a's batch-1 step again, both trees, with XLA's split-K GEMVs and without.
#   s20d-f  one GPU, by hand (session 20): latency_lab.py --weights bf16 --steps 16 --repeats 5 with
#           --xla-options xla_gpu_enable_pdl=true (and _pdl_launch, concurrent graph regions): no effect;
#           with --attention pallas_gpu_fused (s20e: the fused kernel's old sizes), and from two copies of
#           the tree whose fused sizes had prefetch off + the Pallas merge (s20f var1) and two stages as
#           well (var2: what block_sizes.fused_kernel_mechanisms now sets).
#   s20g    one GPU: one live sequence in the 8x8 bucket at 384 and 32k tokens, the default kernel against the
#           fused one at their tuned and other split counts (the 32k part ran out of time); the engine's bf16
#           latency, this tree of then ("auto" took the fused kernel for steps of <= 8 slots: not kept)
#           against .baseline/ (session 19's code).
#   s20h, s20i  one GPU, by hand: small_bucket_decode.py --contexts 32768 --chained 16 --splits 32 (before the
#           one-live split rule); decode_small_batch.py --rounds 1 --shapes 8x16384 (after it).
#   s21a    one GPU: what session 20 left unmeasured: the engine's bf16 batch-1 latency with the one-live
#           split rule (this tree, with a trace of 8 of its decode steps: where the engine's step and
#           latency_lab.py's differ) against .baseline/ (session 19's code); the 8x8 bucket
#           at 384, 4k and 32k tokens; B=8 16k with all slots live, this tree against .baseline/.
#   s22a    one GPU: the decode matmul's fused W8A8 mode (JAXINFER_DECODE_MATMUL=wgmma-fused) in the engine's
#           fp8 batch-1 latency, traced beside XLA's W8A16; wgmma and wgmma-f16 untraced; the fp8 projection sweep.
#   s22b    one GPU: the K/V write as one Pallas launch against XLA's scatters (.baseline), bf16 latency traced
#           and decode256; the fused W8A8 mode at its new sizes, traced; fp8 latency with the new write.
#   s23a    one GPU: the fp8 projection sweep timed on the device (queued by session 22).
#   s23b    one GPU: throughput-1k in fp8 (weights + KV) and bf16, each with 3 decode-only and 2
#           prefill-carrying steps traced: where a step's time goes, by kind, in each JSON.
#   s23c    one GPU: fp8 throughput-1k with the W8A8 GEMMs writing bf16 against float32 (.baseline = the
#           commit before, with this commit's engine_throughput.py), both traced; bf16 decode at 384
#           sequences with and without XLA's dot merger; the FP8 HLO check at the W8A8 buckets.
#   s24a    one GPU: s23d's Nsight Compute reports kept as .ncu-rep, each also printed as its details page
#           and as per-SASS-instruction source counters (stall samples by instruction), fp8 and bf16 pages.
#   s25a    one GPU, session 25, at commit 4bee89e (the option it measures, fp8_v_widening="registers", was
#           removed after it: slower at every shape): kernel_frontier's fp8 stage (both V paths side by side),
#           fp8 throughput-1k with V widened in registers (a copy of the tree with that default) and as
#           committed, then the Nsight Compute report of fp8 pages at 384 x 1k with V in registers.
#   s26a    one GPU (queued by session 25, ~8 min): kernel_frontier's fp8 stage with V pages stored dim-major
#           beside the engine's fp8 pages and bf16 pages (v_layout.py), then the Nsight Compute report of the
#           dim-major kernel at 384 x 1k, summarised per opcode (kernel_ncu.py --sass), with the time left.
#   s26b    one GPU (queued by session 25, ~6 min): fp8 throughput-1k with V pages dim-major
#           (JAXINFER_V_LAYOUT=dim_major) and token-major, interleaved in one call, both traced.
#           Both ran in session 26 at a0cc3cc (benchmarks/results/session26_h100.md): dim-major lost, its V^T
#           tile loaded a byte a value; fixed after (s26c), so both are to run again.
#   s26c    one GPU (~6 min): s26a again with the dim-major V^T tile's columns built as a plain range (no
#           select from jnp's %, which hid their contiguity: s26a's V^T was loaded one byte at a time),
#           5 shapes (SHAPES= fewer), the sweep as time allows, then the Nsight Compute report at 384 x 1k.
#   s28b    one GPU, one call (~7 min, END=420): the dim-major V write with whole pages (df275d0) timed beside
#           token-major's (kv_write_gpu.py), then s28a's fp8 throughput-1k A/B (dim-major first this time).
#   s28a    one GPU, one call (~9 min, END=540): s27a's engine A/B again in the other order (fp8 throughput-1k with
#           token-major V pages first, then dim-major), kv_write_gpu.py (what the dim-major V write costs beside
#           token-major's, decode- and prefill-like), then fp8 batch-1 latency with each layout, as time allows.
#   s27a    one GPU, one call (~9 min, END=590): the dim-major A/B after the V^T fix: kernel_frontier's fp8 stage
#           (fixed columns only: bf16, fp8 token-major, fp8 V dim-major; 6 shapes, two of them ending mid-block
#           as the engine's contexts do, so their walks end in a masked block), then fp8 throughput-1k with
#           JAXINFER_V_LAYOUT=dim_major and token_major (untraced). s26a/s26b do the same in two calls, with
#           the tile sweep, Nsight Compute and traces. SHAPES=, FRONTIER_S= (the first stage's limit,
#           default 210 s) and TP1K=0 (no engine runs) trim it for a session with less device time.
#   s23d    one GPU: Nsight Compute's full report of the decode attention kernel over fp8 and bf16 pages
#           (384 sequences at 1k tokens: throughput-1k's decode steps; 32 at 4k).
#   s23e    one GPU: bf16 throughput-1k with XLA's dot merger off from 33 to 1023 rows and the basic sampler
#           without logprobs, against the commit before (.baseline), both traced (the traces tell the two
#           apart); then s23d's fp8 Nsight Compute report at 384 x 1k.
#   s22c    one GPU: s22b's A/B of the K/V write with the slots found in the write's launch, bf16 (traced,
#           decode256) and fp8.
#   s21b    one GPU: the TMA + wgmma decode matmul (JAXINFER_DECODE_MATMUL=wgmma / wgmma-f16) in the engine's
#           batch-1 latency: fp8 weights + fp8 KV with each and without, bf16 with it and without (the
#           kernel's runs traced over 8 decode steps); then wgmma_gemv.py's tile sweep at 8 and 16 tokens.
set -u
PLAN=${1:?plan: engine, tp, tp1k, tpsame, tpgraphs, next, va, va1, tpcheck, warm, lab, ab1, ab2, ab3, s7a, s7b, s7c, s8fp8, s8spec, s8lat, s8lat2, s8final, s9a, s9b, s9c, s9d, s9eagle, s10a, s10b, s10c, s10d, s11a, s12a, s12b, s12c, s13a, s13b, s13c, s13d, s13e, s14b, s14c, s15a, s15b, s16b, s16c, s16d, s17a, s17b, s17c, s17d, s18a, s18b, s18c, s18d, s18e, s18f, s18g, s19a, s19b, s19c, s19d, s19e, s20a, s20b, s20c, s20g, s21a, s21b, s22a, s22b, s22c, s23a, s23b, s23c, s23d, s23e, s24a, s25a, s26a, s26b, s26c, s27a, s28a or s28b}
OUT=${OUT:-$PWD/device-out}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/$PLAN"
R=$OUT/$PLAN
END=${END:-590}  # seconds into the call by which the plan ends (a session with less device time lowers it)
cd "$(dirname "$0")/.."

on_gpu() {  # on_gpu GPU LOG TIMEOUT CMD...: one job on one GPU with its own compile cache
    local gpu=$1 log=$2 limit=$3; shift 3
    # SIGINT first, so Python runs its finally blocks and writes what it has measured.
    CUDA_VISIBLE_DEVICES=$gpu JAX_COMPILATION_CACHE_DIR=/tmp/jcc$gpu timeout -s INT -k 15 "$limit" "$@" >"$R/$log" 2>&1
    echo "exit $? after ${SECONDS}s" >>"$R/$log"
}

wheels() {  # the packages the GPU machine lacks (llguidance, flask, ...), from .whl/ (carried)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

case $PLAN in
engine)
    (on_gpu 0 hf.log 130 python3 benchmarks/hf_peer.py --shape llama-3.1-8b --workloads batch --out "$R/hf"
     on_gpu 0 engine.log 280 python3 benchmarks/engine_throughput.py --out "$R/engine" \
        --workloads startup,latency,batch128,decode256 --hf "$R/hf/hf_peer.json"
     on_gpu 0 nano.log 110 python3 benchmarks/engine_throughput.py --out "$R/engine" --resume --workloads throughput-nano) &
    (on_gpu 1 throughput1k.log 250 python3 benchmarks/engine_throughput.py --out "$R/engine1k" --workloads throughput-1k
     on_gpu 1 kernels.log 270 python3 benchmarks/kernel_attention.py --out "$R/kernels" \
        --stages check,ceilings,prefill,copies,decode) &
    wait ;;
tp)
    timeout 330 python3 benchmarks/tensor_parallel.py --out "$R/tp" --tp 2 --max-num-seqs 384 --max-model-len 2048 \
        --profile --workloads collective-matmul,latency >"$R/tp.log" 2>&1
    python3 benchmarks/profile_collectives.py "$R/tp" --steps 32 --json "$R/decode_profile.json" >>"$R/tp.log" 2>&1
    # The same TP=2 decode with every op kind XLA can put in a CUDA graph, collectives and the
    # sampler's conditional included: does launching ~900 kernels a step one by one cost the gap?
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES,CONDITIONAL,WHILE" \
    timeout 200 python3 benchmarks/tensor_parallel.py --out "$R/tp_graphs" --tp 2 --tp-sizes 2 --max-num-seqs 384 \
        --max-model-len 2048 --profile --workloads latency >"$R/tp_graphs.log" 2>&1
    python3 benchmarks/profile_collectives.py "$R/tp_graphs" --steps 32 --json "$R/decode_profile_graphs.json" >>"$R/tp_graphs.log" 2>&1 ;;
tp1k)
    timeout 560 python3 benchmarks/tensor_parallel.py --out "$R/tp" --tp 2 --max-num-seqs 384 --max-model-len 2048 \
        --workloads throughput-1k >"$R/tp.log" 2>&1 ;;
lab)
    (on_gpu 0 profile1k.log 330 python3 benchmarks/engine_throughput.py --out "$R/profile1k" \
        --workloads throughput-1k --profile-steps 8
     python3 benchmarks/profile_collectives.py "$R/profile1k" --steps 8 --top 12 \
        --json "$R/throughput-1k_decode_kernels.json" >>"$R/profile1k.log" 2>&1
     on_gpu 0 lab.log 200 python3 benchmarks/latency_lab.py --out "$R/lab") &
    on_gpu 1 sweep.log 540 python3 benchmarks/kernel_attention.py --out "$R/sweep" --stages check,ceilings,sweep &
    wait ;;
tpsame)
    timeout -s INT -k 15 400 python3 benchmarks/tensor_parallel.py --out "$R/tp" --tp 2 --max-num-seqs 384 \
        --max-model-len 2048 --profile --workloads latency,throughput-1k >"$R/tp.log" 2>&1
    python3 benchmarks/profile_collectives.py "$R/tp" --steps 32 --json "$R/decode_profile.json" >>"$R/tp.log" 2>&1
    # Batch-1 decode and batch-256 dispatch without CUDA graphs: do graph updates cost the host
    # more per step than launching the kernels one by one?
    XLA_FLAGS=--xla_gpu_enable_command_buffer= on_gpu 0 nocmdbuf.log 130 python3 benchmarks/engine_throughput.py \
        --out "$R/nocmdbuf" --workloads latency,decode256 ;;
tpgraphs)
    # TP=1 vs TP=2 latency in one run, tp programs with collectives inside CUDA graphs
    # (jaxinfer.compile_options.graph_options), with decode traces and their summary.
    timeout -s INT -k 15 300 python3 benchmarks/tensor_parallel.py --out "$R/tp" --tp 2 --max-num-seqs 384 \
        --max-model-len 2048 --profile --workloads latency >"$R/tp.log" 2>&1
    python3 benchmarks/profile_collectives.py "$R/tp" --steps 32 --json "$R/decode_profile.json" >>"$R/tp.log" 2>&1
    python3 benchmarks/profile_host.py "$R/tp" --steps 32 --top 40 --json "$R/decode_host.json" >>"$R/tp.log" 2>&1
    # TP=2 with no CUDA graphs at all: kernels launched one by one, no graph updates.
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout -s INT -k 15 150 python3 benchmarks/tensor_parallel.py \
        --out "$R/tp_nographs" --tp 2 --tp-sizes 2 --max-num-seqs 384 --max-model-len 2048 --profile \
        --workloads latency >"$R/tp_nographs.log" 2>&1
    python3 benchmarks/profile_collectives.py "$R/tp_nographs" --steps 32 >>"$R/tp_nographs.log" 2>&1
    python3 benchmarks/profile_host.py "$R/tp_nographs" --steps 32 --top 40 --json "$R/decode_host_nographs.json" \
        >>"$R/tp_nographs.log" 2>&1 ;;
next)
    # Owed after session 4 (about 9.5 minutes): TP=2 decode with synchronous collectives (can
    # they then join the CUDA graphs?) and with XLA's overlap options (the decode half of
    # "overlap chosen per phase by measurement"), the collective matmul, and the kernel
    # grid's 32k-context rows, which session 4's grid did not reach.
    TP="python3 benchmarks/tensor_parallel.py --tp 2 --max-num-seqs 384 --max-model-len 2048"
    timeout -s INT -k 15 160 $TP --out "$R/tp" --profile --workloads latency >"$R/tp.log" 2>&1
    python3 benchmarks/profile_host.py "$R/tp" --steps 32 --top 25 >>"$R/tp.log" 2>&1
    timeout -s INT -k 15 90 $TP --out "$R/tp_sync" --tp-sizes 2 --profile --workloads latency \
        --xla-option xla_gpu_disable_async_collectives=ALLREDUCE,ALLGATHER,REDUCESCATTER >"$R/tp_sync.log" 2>&1
    python3 benchmarks/profile_host.py "$R/tp_sync" --steps 32 --top 25 >>"$R/tp_sync.log" 2>&1
    timeout -s INT -k 15 75 $TP --out "$R/tp_overlap" --tp-sizes 2 --workloads latency \
        --xla-option xla_gpu_enable_latency_hiding_scheduler=true \
        --xla-option xla_gpu_multi_streamed_windowed_einsum=true \
        --xla-option xla_gpu_threshold_for_windowed_einsum_mib=0 >"$R/tp_overlap.log" 2>&1
    timeout -s INT -k 15 70 $TP --out "$R/tp_cm" --workloads collective-matmul >"$R/tp_cm.log" 2>&1
    # One GPU each: the kernel grid's 32k rows; greedy agreement batched vs alone in bf16 (issue 4).
    on_gpu 0 kernels32k.log 120 python3 benchmarks/kernel_attention.py --out "$R/kernels32k" \
        --stages ceilings,decode --contexts 32768 &
    (on_gpu 1 agreement_tiny.log 40 python3 benchmarks/agreement.py --out "$R/agreement_tiny"
     on_gpu 1 agreement_8b.log 80 python3 benchmarks/agreement.py --out "$R/agreement_8b" --shape llama-3.1-8b) &
    wait ;;
va)
    # Session 5: TP=2 decode is host-bound on CUDA graphs (about 68 a GPU a step, because each
    # NCCL all-reduce ends a graph, and 45 of them re-pointed every step at ~31 µs each).
    # 1. Stable temporaries (SKIP_TEMP: VMM allocator, fixed virtual addresses): TP=1 and TP=2
    #    latency with host summaries.
    # 2. XLA's own one-shot all-reduce kernel (Triton, over NVLink peer memory) instead of
    #    NCCL: can the graphs then hold the all-reduces, one graph a step?
    # 3. Both.
    TP="python3 benchmarks/tensor_parallel.py --tp 2 --max-num-seqs 384 --max-model-len 2048"
    CK="--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE"
    XLA_FLAGS="--xla_gpu_command_buffer_update_mode=SKIP_TEMP" timeout -s INT -k 15 170 $TP --out "$R/tp_skiptemp" \
        --profile --workloads latency >"$R/tp_skiptemp.log" 2>&1
    python3 benchmarks/profile_host.py "$R/tp_skiptemp" --steps 32 --top 25 >>"$R/tp_skiptemp.log" 2>&1
    XLA_FLAGS="$CK" timeout -s INT -k 15 100 $TP --out "$R/tp_ck" --tp-sizes 2 --profile --workloads latency \
        >"$R/tp_ck.log" 2>&1
    python3 benchmarks/profile_host.py "$R/tp_ck" --steps 32 --top 25 >>"$R/tp_ck.log" 2>&1
    XLA_FLAGS="$CK --xla_gpu_command_buffer_update_mode=SKIP_TEMP" timeout -s INT -k 15 80 $TP --out "$R/tp_ck_skiptemp" \
        --tp-sizes 2 --workloads latency >"$R/tp_ck_skiptemp.log" 2>&1 ;;
va1)
    # One GPU: do stable buffer addresses cut the dispatch cost (CUDA-graph updates, 4.2-6.7 ms
    # a step at batch 256; 47% of a throughput-nano step)? XLA 0.11.2's
    # xla_gpu_command_buffer_update_mode=SKIP_TEMP maps temporaries at fixed virtual addresses
    # through the VMM allocator (SKIP_PROFILED, which also remaps parameters, made batch-1
    # latency worse in session 5). Default and SKIP_TEMP on the same machine. Page pools fixed
    # at the sizes measured with the default allocator: the VMM allocator reports no limit.
    E="python3 benchmarks/engine_throughput.py --workloads latency,decode256 --num-pages 27446"
    N="python3 benchmarks/engine_throughput.py --resume --workloads throughput-nano --num-pages 35419"
    for mode in ALWAYS_UPDATE SKIP_TEMP; do
        on_gpu 0 engine_$mode.log 110 env XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$mode" $E --out "$R/engine_$mode"
        on_gpu 0 nano_$mode.log 70 env XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$mode" $N --out "$R/engine_$mode"
    done ;;
tpcheck)
    # Greedy tokens of TP=2 against TP=1 (tiny fixture, both batched), in f32 by default and
    # with the latency recipe's XLA options (docs/SHARDING.md), and in bf16 with them.
    RECIPE="--xla_gpu_command_buffer_update_mode=SKIP_TEMP --xla_gpu_experimental_use_collective_kernels=ALL_REDUCE"
    A="python3 benchmarks/agreement.py --against-tp 2"
    timeout -s INT -k 10 90 $A --dtype float32 --out "$R/f32_default" >"$R/f32_default.log" 2>&1
    XLA_FLAGS="$RECIPE" timeout -s INT -k 10 90 $A --dtype float32 --out "$R/f32_recipe" >"$R/f32_recipe.log" 2>&1
    XLA_FLAGS="$RECIPE" timeout -s INT -k 10 90 $A --out "$R/bf16_recipe" >"$R/bf16_recipe.log" 2>&1 ;;
warm)
    # Start-up of the 8B engine with a cold, then a warm persistent compilation cache (the
    # program set changed in session 4: 11 forward + 14 sampler programs).
    on_gpu 0 startup_cold.log 120 python3 benchmarks/engine_throughput.py --out "$R/engine" --workloads startup
    on_gpu 0 startup_warm.log 90 python3 benchmarks/engine_throughput.py --out "$R/engine" --resume --workloads startup ;;
ab1|ab2|ab3)
    # Before/after of a refactor on one GPU (benchmarks/compare_trees.py): the old tree sits in
    # .baseline/ (git archive of the base commit; carried, ignored). Runs accumulate in /tmp/ab,
    # which lives as long as the machine stays warm, so the three calls must follow each other.
    AB=/tmp/ab
    compare() { python3 benchmarks/compare_trees.py run --base .baseline --new . --raw $AB "$@" >>"$R/compare.log" 2>&1; }
    case $PLAN in
    ab1)  # cold start-ups, latency and nano once per tree; f32 agreement with transformers; loader memory
        compare --workloads startup,latency,throughput-nano --order base,new --timeout-s 200
        timeout -s INT -k 15 90 python3 benchmarks/agreement.py --out "$R/agreement_hf" --against-hf \
            --dtype float32 --num-prompts 18 --max-tokens 32 >"$R/agreement_hf.log" 2>&1
        timeout -s INT -k 15 280 python3 benchmarks/loader_memory.py --out "$R/loader_memory" --tree . \
            --tree .baseline --checkpoint /tmp/loader-ckpt --timeout-s 125 >"$R/loader_memory.log" 2>&1 ;;
    ab2)  compare --workloads latency,throughput-1k,throughput-nano --order base,new,base --timeout-s 190 ;;
    ab3)  compare --workloads latency,throughput-1k,throughput-nano --order new,base,new --timeout-s 190 ;;
    esac
    python3 benchmarks/compare_trees.py summarize --raw $AB --out "$R/summary" >>"$R/compare.log" 2>&1
    tar czf "$R/raw.tgz" --exclude='jax-cache-*' -C $AB . ;;
s7a)
    # Session 7, first of two calls in a row (one GPU): the attention kernels' measured table
    # (kernel_frontier.py: parallel-compiled sweep of the issue-21 goal shapes against the frozen
    # old kernel and cuDNN), the weight-only GEMV table (gemv_decode.py), and the host cost of
    # structured-output masks on this machine's 16 cores.
    wheels
    on_gpu 0 frontier2.log 280 python3 benchmarks/kernel_frontier.py --out "$R/frontier2" --budget-s 258 --quick-check \
        --repeats 16 --reserve-s 55 --stage2-needs-s 200 --mosaic-steps 2
    on_gpu 0 gemv.log 155 python3 benchmarks/gemv_decode.py --out "$R/gemv_decode" --budget-s 125
    on_gpu 0 so_host.log 70 python3 benchmarks/structured_output_host.py --out "$R/so_host" \
        --tokenizer .cache/smollm2-tokenizer --steps 200 ;;
s7b)
    # Session 7, second call: the FP8 HLO assertions and crossover, the verify step's cost for
    # k = 2/4/8 at batch 1 (8B shapes), then latency and throughput-1k with fp8 weights and an
    # fp8 KV cache (fp8 weights alone if the fp8 cache fails to build).
    wheels
    on_gpu 0 fp8_hlo.log 75 python3 benchmarks/fp8_hlo_check.py --out "$R/fp8_hlo"
    on_gpu 0 spec.log 150 python3 benchmarks/spec_decode.py step-cost --out "$R/spec" --ks 2 4 8 \
        --acceptance benchmarks/results/spec_acceptance_cpu.json benchmarks/results/spec_acceptance_cpu_k4.json
    start=$SECONDS
    on_gpu 0 fp8.log 230 python3 benchmarks/engine_throughput.py --out "$R/fp8" --quantization fp8 \
        --kv-cache-dtype fp8 --workloads latency,throughput-1k
    if ! grep -q "throughput-1k" "$R/fp8/engine_throughput.json" 2>/dev/null && (( SECONDS - start < 90 )); then
        on_gpu 0 fp8_weights.log 200 python3 benchmarks/engine_throughput.py --out "$R/fp8_weights" \
            --quantization fp8 --workloads latency,throughput-1k
    fi ;;
s8spec)
    wheels
    on_gpu 0 spec_engine.log 230 python3 benchmarks/spec_decode.py engine --out "$R/spec_engine" --ks 5 \
        --acceptance benchmarks/results/spec_acceptance_cpu.json ;;
s7c)
    # Session 7, third call: bf16 latency, then throughput-1k unconstrained and with every request
    # under a JSON schema, at half scale (500 requests x 500 / 500: the device time left).
    wheels
    on_gpu 0 bf16.log 170 python3 benchmarks/engine_throughput.py --out "$R/bf16" --workloads latency,throughput-1k \
        --scale 0.5 --structured-fraction 1.0 --structured-tokenizer .cache/smollm2-tokenizer ;;
s8fp8)
    # Session 8: the FP8 engine (fp8 weights + fp8 KV). Start-up is cold (a fresh cache dir):
    # 43 programs, the 7 forwards of 128-8192 tokens W8A8 without Triton GEMMs
    # (jaxinfer.compile_options; 324 s cold with them in session 8). max_num_seqs 1024: token
    # buckets 8..8192 (11 forwards), sequence buckets 8..1024, so a decode of ~1000 sequences runs
    # the (1024, 1024) bucket. The fp8 pool (58,219 pages x 32 at 0.95) holds 1.86M tokens: 1000
    # requests x 63 pages is 63,000, so the last steps may preempt (counted in the results);
    # 896 x 63 = 56,448 fits, hence the second run.
    wheels
    on_gpu 0 fp8.log 400 python3 benchmarks/engine_throughput.py --out "$R/fp8" --quantization fp8 \
        --kv-cache-dtype fp8 --workloads startup,latency,throughput-1k --max-num-seqs 1024 --profile-steps 8
    python3 benchmarks/profile_collectives.py "$R/fp8" --steps 8 --top 25 \
        --json "$R/fp8/throughput-1k_decode_kernels.json" >>"$R/fp8.log" 2>&1
    # Decode steps spent 27% of their wall time in dispatch in session 8: where the host's goes.
    python3 benchmarks/profile_host.py "$R/fp8" --steps 8 --top 30 \
        --json "$R/fp8/throughput-1k_decode_host.json" >>"$R/fp8.log" 2>&1
    if (( SECONDS < 300 )); then
        on_gpu 0 fp8_896.log $(( 520 - SECONDS )) python3 benchmarks/engine_throughput.py --out "$R/fp8_896" \
            --quantization fp8 --kv-cache-dtype fp8 --workloads throughput-1k --max-num-seqs 896
    fi ;;
s8lat)
    # Session 8, first call: where the batch-1 step's time goes (a trace of the jitted step loop
    # parsed per kernel kind, bf16 and fp8 weights in one run), then the GEMV sweep whose table
    # decides where the weight layer runs our kernels.
    wheels
    on_gpu 0 lab.log 200 python3 benchmarks/latency_lab.py --out "$R/lab" --steps 16 --repeats 5
    # 276 sweep programs (run 2: 168, compiled and timed in 57 s), new candidates in the first rounds.
    on_gpu 0 gemv.log 155 python3 benchmarks/gemv_decode.py --out "$R/gemv_decode" --budget-s 140 ;;
s8lat2)
    # Session 8, second call, after the s8lat table is committed: latency through the engine (small
    # buckets: a 128-token prompt chunked into 64-token steps, so no W8A8 program compiles; the
    # decode program is the same 8x8 bucket as with the defaults), bf16 then fp8 weights + fp8 KV,
    # then the step loops again with the adopted table (no traces).
    wheels
    for q in bf16 fp8; do
        flags=(); [[ $q == fp8 ]] && flags=(--quantization fp8 --kv-cache-dtype fp8)
        on_gpu 0 "latency_$q.log" 90 python3 benchmarks/engine_throughput.py --out "$R/latency_$q" \
            --workloads latency --max-num-seqs 8 --max-num-batched-tokens 64 "${flags[@]}"
    done
    on_gpu 0 lab.log 120 python3 benchmarks/latency_lab.py --out "$R/lab" --steps 16 --repeats 5 --no-trace ;;
s8final)
    # Session 8's last call, in priority order within ~9 minutes of device time.
    wheels
    on_gpu 0 fp8.log 250 python3 benchmarks/engine_throughput.py --out "$R/fp8" --quantization fp8 \
        --kv-cache-dtype fp8 --workloads startup,latency,throughput-1k --max-num-seqs 1024 --profile-steps 8
    python3 benchmarks/profile_collectives.py "$R/fp8" --steps 8 --top 25 \
        --json "$R/fp8/throughput-1k_decode_kernels.json" >>"$R/fp8.log" 2>&1
    on_gpu 0 gemv.log 95 python3 benchmarks/gemv_decode.py --out "$R/gemv_decode" --budget-s 75 --ms 8,1
    # Adopt the sweep's table in this copy of the tree, so the engine runs below use it.
    [[ -f "$R/gemv_decode/gpu_gemv_table.json" ]] && cp "$R/gemv_decode/gpu_gemv_table.json" pallas_kernels/quantized_matmul/
    for q in bf16 fp8; do
        flags=(); [[ $q == fp8 ]] && flags=(--quantization fp8 --kv-cache-dtype fp8)
        on_gpu 0 "latency_$q.log" 70 python3 benchmarks/engine_throughput.py --out "$R/latency_$q" \
            --workloads latency --max-num-seqs 8 --max-num-batched-tokens 64 "${flags[@]}"
    done
    left=$(( 530 - SECONDS ))
    (( left > 60 )) && on_gpu 0 prefill.log "$left" python3 benchmarks/prefill_peers.py --out "$R/prefill_peers" \
        --budget-s $(( left - 30 )) ;;
s9a)
    # Session 9, first call: where the host's time goes at ~1000 sequences (fp8 throughput-1k with a
    # trace of 6 steady decode steps and then a cProfile of 24), then the batch-1 step's per-kernel
    # breakdown (bf16 and fp8 weights).
    wheels
    on_gpu 0 fp8.log 270 python3 benchmarks/engine_throughput.py --out "$R/fp8" --quantization fp8 \
        --kv-cache-dtype fp8 --workloads throughput-1k --max-num-seqs 1024 --profile-steps 6 --host-profile-steps 24
    python3 benchmarks/profile_collectives.py "$R/fp8" --steps 6 --top 25 \
        --json "$R/fp8/throughput-1k_decode_kernels.json" >>"$R/fp8.log" 2>&1
    python3 benchmarks/profile_host.py "$R/fp8" --steps 6 --top 40 \
        --json "$R/fp8/throughput-1k_decode_host.json" >>"$R/fp8.log" 2>&1
    left=$(( 560 - SECONDS ))
    (( left > 60 )) && on_gpu 0 lab.log "$left" python3 benchmarks/latency_lab.py --out "$R/lab" --steps 16 --repeats 5 ;;
s9b)
    # Session 9, second call: asynchronous verify steps through the engine at batch 1, then the
    # fp8-page tile sweep (adopt with adopt_frontier_run.py).
    wheels
    on_gpu 0 spec_engine.log 230 python3 benchmarks/spec_decode.py engine --out "$R/spec_engine" --ks 5 \
        --acceptance benchmarks/results/spec_acceptance_cpu.json
    left=$(( 570 - SECONDS ))
    (( left > 90 )) && on_gpu 0 ka.log "$left" python3 benchmarks/kernel_frontier.py --out "$R/ka" \
        --only ceilings,fp8 --budget-s $(( left - 50 )) ;;
s9eagle)
    wheels
    on_gpu 0 eagle3.log 300 python3 benchmarks/spec_decode.py eagle3 --out "$R/eagle3" --ks 1 3 5 --budget-s 200
    # The random head (~0.85 GB) is written under $R: removed before packing.
    on_gpu 0 eagle3_engine.log 240 python3 benchmarks/spec_decode.py eagle3-engine --out "$R/eagle3_engine" --ks 3 5 --budget-s 150
    rm -rf "$R/eagle3_engine/eagle3-head" ;;
s9c)
    # Session 9, third call: the FP8-dot modes of the fp8-page decode kernel (from the helper's tree,
    # carried as .gpu/fp8mma: not merged, it conflicts with gpu_tile's refactor), the fresh-prefill
    # path inside the engine (compile time, TTFT, a prefill-heavy mix), EAGLE-3's cost at batch 1.
    wheels
    (cd .gpu/fp8mma && on_gpu 0 fp8mma.log 200 python3 benchmarks/fp8_mma_decode.py --out "$R/fp8mma" \
        --modes off,qk,swap,swap_qk --repeats 8)
    on_gpu 0 prefill_engine.log 230 python3 benchmarks/prefill_engine.py --out "$R/pe" --budget-s 170
    left=$(( 575 - SECONDS ))
    (( left > 60 )) && on_gpu 0 eagle3.log "$left" python3 benchmarks/spec_decode.py eagle3 --out "$R/eagle3" \
        --ks 3 5 --budget-s $(( left - 40 )) ;;
s9d)
    # Session 9's last call, in priority order: fp8 throughput-1k on the merged tree (host path in
    # bulk, the forward's inputs through a donated slot, Hopper's fresh-prefill default) with its
    # trace and cProfile; async verify steps at the new default k = 7 (and 15); engine latency in
    # bf16 and fp8 (RoPE tables made once a step); bf16 throughput-1k with the time left.
    wheels
    on_gpu 0 fp8.log 200 python3 benchmarks/engine_throughput.py --out "$R/fp8" --quantization fp8 \
        --kv-cache-dtype fp8 --workloads startup,throughput-1k --max-num-seqs 1024 --profile-steps 6 --host-profile-steps 24
    python3 benchmarks/profile_collectives.py "$R/fp8" --steps 6 --top 25 \
        --json "$R/fp8/throughput-1k_decode_kernels.json" >>"$R/fp8.log" 2>&1
    python3 benchmarks/profile_host.py "$R/fp8" --steps 6 --top 40 \
        --json "$R/fp8/throughput-1k_decode_host.json" >>"$R/fp8.log" 2>&1
    on_gpu 0 spec_engine.log 110 python3 benchmarks/spec_decode.py engine --out "$R/spec_engine" --ks 7 15 \
        --modes async --acceptance benchmarks/results/spec_replay.smollm2.json
    for q in bf16 fp8; do
        flags=(); [[ $q == fp8 ]] && flags=(--quantization fp8 --kv-cache-dtype fp8)
        on_gpu 0 "latency_$q.log" 70 python3 benchmarks/engine_throughput.py --out "$R/latency_$q" \
            --workloads latency --max-num-seqs 8 --max-num-batched-tokens 64 "${flags[@]}"
    done
    left=$(( 585 - SECONDS ))
    (( left > 100 )) && on_gpu 0 bf16.log "$left" python3 benchmarks/engine_throughput.py --out "$R/bf16" \
        --workloads startup,throughput-1k --max-num-seqs 1024 ;;
s10a)
    # Session 10, first call: the owed measurements, most wanted first.
    wheels
    on_gpu 0 bf16.log 230 python3 benchmarks/engine_throughput.py --out "$R/bf16_384" \
        --workloads throughput-1k --max-num-seqs 384
    on_gpu 0 lab.log 190 python3 benchmarks/latency_lab.py --out "$R/lab" --steps 16 --repeats 5 \
        --attention pallas_gpu_fused
    on_gpu 0 dispatch.log 80 python3 benchmarks/step_dispatch.py --out "$R/dispatch" \
        --variants fresh,staged,same-inputs --iters 30 --rounds 3
    left=$(( 585 - SECONDS ))
    (( left > 40 )) && on_gpu 0 peers.log "$left" python3 benchmarks/prefill_peers.py --out "$R/peers" \
        --shapes 4096,16384,32768 --impls cudnn,ours,fresh_path --budget-s $(( left - 20 )) ;;
s10b)
    wheels
    on_gpu 0 fp8.log 220 python3 benchmarks/engine_throughput.py --out "$R/fp8" --quantization fp8 \
        --kv-cache-dtype fp8 --workloads startup,throughput-1k --max-num-seqs 1024 --admission greedy
    for a in reserve greedy; do
        on_gpu 0 "bf16_$a.log" 190 python3 benchmarks/engine_throughput.py --out "$R/bf16_$a" \
            --workloads throughput-1k --max-num-seqs 1024 --admission "$a"
    done ;;
s10c)
    wheels
    on_gpu 0 gemv.log 250 python3 benchmarks/gemv_decode.py --out "$R/gemv_decode" --ms 1,8,4,16,2 --budget-s 230
    if [[ -f "$R/gemv_decode/gpu_gemv_table.json" ]]; then
        cp "$R/gemv_decode/gpu_gemv_table.json" pallas_kernels/quantized_matmul/gpu_gemv_table.json
    fi
    on_gpu 0 latency_fp8.log 75 python3 benchmarks/engine_throughput.py --out "$R/latency_fp8" \
        --workloads latency --max-num-seqs 8 --max-num-batched-tokens 64 --quantization fp8 --kv-cache-dtype fp8
    left=$(( 590 - SECONDS ))
    (( left > 150 )) && on_gpu 0 bf16_reserve.log "$left" python3 benchmarks/engine_throughput.py \
        --out "$R/bf16_reserve" --workloads throughput-1k --max-num-seqs 1024 --admission reserve ;;
s10d)
    wheels
    on_gpu 0 fp8.log 200 python3 benchmarks/engine_throughput.py --out "$R/fp8" --quantization fp8 \
        --kv-cache-dtype fp8 --workloads throughput-1k --max-num-seqs 1024 --profile-prefill-steps 3
    python3 benchmarks/profile_collectives.py "$R/fp8/profile_throughput-1k_prefill" --steps 3 --top 30 \
        --json "$R/fp8/throughput-1k_prefill_kernels.json" >>"$R/fp8.log" 2>&1 ;;
s11a|s12b)
    wheels
    on_gpu 0 w8a8.log 90 python3 benchmarks/w8a8_epilogue.py --out "$R/w8a8" --ms 1024,8192 --layers 4
    on_gpu 0 dispatch.log 80 python3 benchmarks/step_dispatch.py --out "$R/dispatch" \
        --variants fresh,staged,same-inputs --iters 30 --rounds 3
    # The first compiles (~65 s cold) and runs (~110 s); the second finds the programs cached.
    on_gpu 0 bf16_greedy.log 210 python3 benchmarks/engine_throughput.py --out "$R/bf16_greedy" \
        --workloads throughput-1k --max-num-seqs 1024 --admission greedy
    left=$(( END - SECONDS ))
    (( left > 130 )) && on_gpu 0 bf16_reserve.log "$left" python3 benchmarks/engine_throughput.py \
        --out "$R/bf16_reserve" --workloads throughput-1k --max-num-seqs 1024 --admission reserve ;;
s12a)
    on_gpu 0 wgmma.log 300 python3 benchmarks/fp8_wgmma_decode.py --out "$R/fp8wgmma" --budget-s 240
    left=$(( END - SECONDS ))
    (( left > 120 )) && on_gpu 0 peers.log "$left" python3 benchmarks/prefill_peers.py --out "$R/pp_multi" \
        --shapes 8x1000,4x2000,2x4000 --impls ours,fresh_single,fresh_path,fresh_branchless --kv-dtypes bf16,fp8 \
        --min-fresh-tokens 960 --budget-s $(( left - 40 )) ;;
s12c)
    wheels
    for scales in static dynamic; do
        left=$(( END - SECONDS )); limit=$left
        [[ $scales == static ]] && limit=300  # leave the second its share
        (( left > 150 )) && on_gpu 0 fp8_$scales.log "$limit" python3 \
            benchmarks/engine_throughput.py --out "$R/fp8_$scales" --workloads throughput-1k --max-num-seqs 1024 \
            --quantization fp8 --kv-cache-dtype fp8 --activation-scales $scales --profile-prefill-steps 1
    done ;;
s13a)
    wheels
    # The largest buckets first: W8A8 runs there (jaxinfer.compile_options.uses_fp8_w8a8).
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$R/xla_dump --xla_dump_hlo_as_text" \
    on_gpu 0 compile_static.log 330 python3 benchmarks/compile_time.py --out "$R/compile_static" \
        --quantization fp8 --kv-cache-dtype fp8 --activation-scales static --max-num-seqs 1024 \
        --tokens 8192,4096,2048,1024,512,256
    # Its own archive beside the plan's (files over 16 MB do not come back; the list of the largest does).
    (cd "$R" && [[ -d xla_dump ]] && ls -laS xla_dump | head -40 >xla_dump_largest.txt \
        && tar czf "$OUT/$PLAN-xla_dump.tgz" xla_dump && rm -rf xla_dump)
    left=$(( END - SECONDS ))
    (( left > 150 )) && on_gpu 0 bf16_projected.log "$left" python3 benchmarks/engine_throughput.py \
        --out "$R/bf16_projected" --workloads throughput-1k --max-num-seqs 1024 --admission reserve ;;
s13b)
    wheels
    for scales in static dynamic; do
        left=$(( END - SECONDS )); limit=$left
        [[ $scales == static ]] && limit=$(( left / 2 + 60 ))
        (( left > 150 )) && on_gpu 0 fp8_$scales.log "$limit" python3 \
            benchmarks/engine_throughput.py --out "$R/fp8_$scales" --workloads throughput-1k --max-num-seqs 1024 \
            --quantization fp8 --kv-cache-dtype fp8 --activation-scales $scales
    done ;;
s13c)
    on_gpu 0 lab.log $(( END - 20 )) python3 benchmarks/latency_lab.py --out "$R/lab" --weights fp8,bf16 \
        --batches 16,32,64,128 --batch-context 1536 --w8a8-min-tokens 16 --steps 8 --repeats 3 ;;
s13d)
    wheels
    on_gpu 0 fp8_merger_off.log 210 python3 benchmarks/engine_throughput.py --out "$R/fp8_merger_off" \
        --workloads throughput-1k --max-num-seqs 1024 --quantization fp8 --kv-cache-dtype fp8
    on_gpu 0 hlo.log 75 python3 benchmarks/fp8_hlo_check.py --out "$R/hlo" --buckets 16,128,1024 --layers 2
    on_gpu 0 lab_unmerged.log 80 python3 benchmarks/latency_lab.py --out "$R/lab_unmerged" --weights fp8 \
        --batches 64,128 --batch-context 1536 --steps 8 --repeats 3
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_dot_merger_threshold_mb=32" \
    on_gpu 0 lab_merged.log 60 python3 benchmarks/latency_lab.py --out "$R/lab_merged" --weights fp8 \
        --batches 64,128 --batch-context 1536 --steps 8 --repeats 3 --no-trace
    left=$(( END - SECONDS ))
    (( left > 150 )) && XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_dot_merger_threshold_mb=32" \
    on_gpu 0 fp8_merger_on.log "$left" python3 benchmarks/engine_throughput.py --out "$R/fp8_merger_on" \
        --workloads throughput-1k --max-num-seqs 1024 --quantization fp8 --kv-cache-dtype fp8 ;;
s13e)
    for scales in dynamic static; do
        XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$R/dump_$scales --xla_dump_hlo_as_text" \
        on_gpu 0 compile_${scales}_2048.log 100 python3 benchmarks/compile_time.py --out "$R/compile_$scales" \
            --quantization fp8 --kv-cache-dtype fp8 --activation-scales $scales --max-num-seqs 1024 --tokens 2048
        python3 benchmarks/hlo_dump_summary.py "$R/dump_$scales" >"$R/dump_$scales.json" 2>&1
        ls -laS "$R/dump_$scales" | head -12 >"$R/dump_${scales}_largest.txt"; rm -rf "$R/dump_$scales"
    done
    on_gpu 0 compile_dynamic.log 110 python3 benchmarks/compile_time.py --out "$R/compile_dynamic" \
        --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 1024 --tokens 8192,4096,1024,512,256 --tag rest
    left=$(( END - SECONDS ))
    (( left > 60 )) && on_gpu 0 lab.log "$left" python3 benchmarks/latency_lab.py --out "$R/lab" --weights fp8 \
        --batches 32,64 --batch-context 1536 --w8a8-min-tokens 32 --steps 8 --repeats 3 --no-trace ;;
s14b)
    # No "check" here: it took 287 of the 320 s budget in session 15 (every case passed) and the sweep never ran.
    on_gpu 0 frontier.log $(( END - 150 )) python3 benchmarks/kernel_frontier.py --out "$R/frontier" \
        --only ceilings,decode --shapes 16x1536,32x1536,16x4096,32x4096 --budget-s $(( END - 220 ))
    left=$(( END - SECONDS ))
    (( left > 90 )) && on_gpu 0 lab.log "$left" python3 benchmarks/latency_lab.py --out "$R/lab" --weights bf16 \
        --batches 16,32 --batch-context 1536 --steps 8 --repeats 3 ;;
s14c)
    wheels
    on_gpu 0 orbax.log 300 python3 benchmarks/engine_throughput.py --out "$R/orbax" --workloads startup \
        --max-num-seqs 1024 --via-orbax /tmp/orbax8b
    rm -rf /tmp/orbax8b /tmp/jcc0
    left=$(( END - SECONDS ))
    (( left > 120 )) && on_gpu 0 random.log "$left" python3 benchmarks/engine_throughput.py --out "$R/random" \
        --workloads startup --max-num-seqs 1024 ;;
s15a)
    for level in default 1 0; do
        rm -rf /tmp/jcc0
        flags="${XLA_FLAGS:-}"; [[ $level != default ]] && flags="$flags --xla_gpu_autotune_level=$level"
        left=$(( END - SECONDS ))
        (( left > 100 )) && XLA_FLAGS="$flags" on_gpu 0 autotune_$level.log $(( left < 160 ? left : 160 )) \
            python3 benchmarks/engine_throughput.py --out "$R/autotune_$level" --workloads startup --max-num-seqs 1024
    done ;;
s15b)
    rm -rf /tmp/jcc0
    on_gpu 0 startup.log 180 python3 benchmarks/engine_throughput.py --out "$R/startup" --workloads startup \
        --max-num-seqs 1024
    for variant in auto auto_shared pallas_gpu; do
        rm -rf /tmp/jcc0
        extra=""; [[ $variant == auto_shared ]] && extra="--shared-kernels"
        left=$(( END - SECONDS ))
        (( left > 90 )) && on_gpu 0 compile_$variant.log $(( left < 130 ? left : 130 )) python3 \
            benchmarks/compile_time.py --out "$R/compile_$variant" --attention-impl ${variant%_shared} $extra \
            --max-num-seqs 1024 --tokens 8192,2048,1024 --tag $variant
    done ;;
s16b)
    on_gpu 0 prefill.log $(( END - 20 )) python3 benchmarks/prefill_peers.py --out "$R/prefill_peers" \
        --shapes 4096,8192,16384,32768,ragged,8x1000 --impls cudnn,ours,fresh_path,fresh_branchless \
        --min-fresh-tokens 1000 --budget-s $(( END - 90 )) ;;
s16c)
    on_gpu 0 prefill.log 240 python3 benchmarks/prefill_peers.py --out "$R/prefill_peers" \
        --shapes 4096,ragged,16384,8x1000,8192,32768 \
        --impls cudnn,fresh_single,fresh_cudnn_single,fresh_cudnn --min-fresh-tokens 1000 --budget-s 200
    left=$(( END - SECONDS ))
    (( left > 120 )) && on_gpu 0 engine.log "$left" python3 benchmarks/prefill_engine.py --out "$R/prefill_engine" \
        --impls pallas_gpu_fresh_prefill,pallas_gpu_fresh_prefill_cudnn --prompt-lens 4096,16384 --mix-requests 16 \
        --max-num-batched-tokens 16384 --budget-s $(( left - 45 )) ;;
s16d)
    peers=$(( END < 400 ? END - 10 : 250 ))
    on_gpu 0 prefill.log $peers python3 benchmarks/prefill_peers.py --out "$R/prefill_peers" \
        --shapes 4096,ragged,8x1000,8192,16384 \
        --impls cudnn,fresh_single,fresh_segments_single,fresh_segments,fresh_cudnn_single,ours \
        --min-fresh-tokens 1000 --budget-s $(( peers - 30 ))
    left=$(( END - SECONDS ))
    (( left > 200 )) && on_gpu 0 engine.log "$left" python3 benchmarks/prefill_engine.py --out "$R/prefill_engine" \
        --impls pallas_gpu_fresh_prefill,pallas_gpu_fresh_prefill_cudnn_segments,pallas_gpu_fresh_prefill_cudnn \
        --budget-s $(( left - 45 )) ;;
s17a)
    # The segments path as Hopper's "auto" (session 17): cold start-up with no Mosaic GPU windows; how
    # short a fresh prompt it should take (min 256, 8 or 32 segments a step; bf16 and fp8 pages); and
    # throughput-1k in bf16 through LLM.
    rm -rf /tmp/jcc0
    on_gpu 0 startup.log 190 python3 benchmarks/engine_throughput.py --out "$R/startup" --workloads startup \
        --max-num-seqs 1024
    on_gpu 0 prefill8.log 100 python3 benchmarks/prefill_peers.py --out "$R/prefill_peers_8" \
        --shapes 8x1000,16x500,32x256,ragged --impls ours,fresh_segments --min-fresh-tokens 256 \
        --max-fresh-prompts 8 --kv-dtypes bf16,fp8 --budget-s 80
    on_gpu 0 prefill32.log 70 python3 benchmarks/prefill_peers.py --out "$R/prefill_peers_32" \
        --shapes 8x1000,16x500,32x256,ragged --impls fresh_segments --min-fresh-tokens 256 \
        --max-fresh-prompts 32 --budget-s 55
    left=$(( END - SECONDS ))
    (( left > 150 )) && on_gpu 0 throughput1k.log "$left" python3 benchmarks/engine_throughput.py \
        --out "$R/engine1k" --workloads throughput-1k ;;
s17b)
    # Hopper's auto on the segments path with prompts of >= 1000 tokens: throughput-1k's prefill steps
    # (8 x 1000) now take it. Cold start-up again (s17a: 59.1 s, with unchanged samplers 50% slower
    # summed than session 16's run), then throughput-1k in fp8 (weights and pages; bf16 gains ~1 ms a
    # prefill step at most, not measurable in a 100 s run).
    rm -rf /tmp/jcc0
    on_gpu 0 startup.log 190 python3 benchmarks/engine_throughput.py --out "$R/startup" --workloads startup \
        --max-num-seqs 1024
    left=$(( END - SECONDS ))
    (( left > 150 )) && on_gpu 0 fp8.log "$left" python3 benchmarks/engine_throughput.py --out "$R/fp8" \
        --quantization fp8 --kv-cache-dtype fp8 --workloads throughput-1k ;;
s17c)
    # Segment slots capped by the step's rows (MAX_SEGMENT_ROWS = 65536, at 2ff5f8f; dropped after this
    # run: no faster at 16k/32k, fewer prompts served on the ragged batch and the mix): 16k and 32k
    # single prompts and the ragged batch against cuDNN alone, then the engine's TTFT at 4k and 32k
    # and the mix (s16d: 32k TTFT 1196.3 ms with 8 slots against the window path's 1187.0).
    on_gpu 0 prefill.log 130 python3 benchmarks/prefill_peers.py --out "$R/prefill_peers" \
        --shapes 16384,32768,ragged --impls cudnn,fresh_segments,fresh_segments_single --budget-s 110
    left=$(( END - SECONDS ))
    (( left > 120 )) && on_gpu 0 engine.log "$left" python3 benchmarks/prefill_engine.py --out "$R/prefill_engine" \
        --impls pallas_gpu_fresh_prefill_cudnn_segments --prompt-lens 4096,32768 --budget-s $(( left - 45 )) ;;
s17d)
    # A second sample of s16d's engine comparison, the segments path (now: prompts >= 1000 tokens) first.
    on_gpu 0 engine.log $(( END - 10 )) python3 benchmarks/prefill_engine.py --out "$R/prefill_engine" \
        --impls pallas_gpu_fresh_prefill_cudnn_segments,pallas_gpu_fresh_prefill --budget-s $(( END - 60 )) ;;
s18a)
    # Queued by session 17: the segments path's parts at 4k-32k. `ours_attend` (Triton alone, no K/V
    # scatter) beside `ours` prices the scatter; the default's 8 slots at 32k (not yet timed alone);
    # 1, 2 and 8 slots at every size, for the slot-count effect (16k: 4028 us with one, 4175 with 8).
    for slots in 8 2; do
        on_gpu 0 prefill_$slots.log 150 python3 benchmarks/prefill_peers.py --out "$R/prefill_peers_$slots" \
            --shapes 4096,8192,16384,32768 --impls cudnn,ours,ours_attend,fresh_segments,fresh_segments_single \
            --max-fresh-prompts $slots --budget-s 130
    done ;;
s18b)
    # s18a: the scatter costs ~5 us (ours vs ours_attend) and the slot count nothing, so the 90-150 us
    # between the segments path and cuDNN alone at 4k-8k is elsewhere: cuDNN's packed call alone
    # (segments_alone) against cuDNN's dense call, and every kernel of one full call (trace).
    on_gpu 0 prefill.log 200 python3 benchmarks/prefill_peers.py --out "$R/prefill_peers" \
        --shapes 4096,8192,16384,ragged --impls cudnn,segments_alone,fresh_segments,ours_attend \
        --trace-impls fresh_segments --budget-s 180 ;;
s18c)
    # A/B, interleaved: B = .baseline/ (the select join, zero fill, no early exit of empty tiles).
    for side in base new; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 prefill_$side.log 110 python3 $dir/benchmarks/prefill_peers.py --out "$R/prefill_peers_$side" \
            --shapes 4096,8192,16384,32768,ragged,8x1000 --impls cudnn,fresh_segments,segments_alone \
            --trace-impls fresh_segments,segments_alone,cudnn --budget-s 95
    done
    for side in base new; do  # the early exit of empty tiles must not cost decode anything
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 decode_$side.log 70 python3 $dir/benchmarks/kernel_attention.py --out "$R/decode_$side" \
            --stages ceilings,decode --impls ours --batches 1,32,128 --contexts 4096,32768
    done
    for side in new base; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 engine_$side.log 100 python3 $dir/benchmarks/prefill_engine.py --out "$R/prefill_engine_$side" \
            --impls pallas_gpu_fresh_prefill_cudnn_segments --budget-s 85
    done ;;
s18d)
    for side in base new; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 prefill_$side.log 110 python3 $dir/benchmarks/prefill_peers.py --out "$R/prefill_peers_$side" \
            --shapes 4096,8192,16384,32768,ragged,8x1000 --impls cudnn,fresh_segments,segments_alone \
            --trace-impls fresh_segments --budget-s 95
    done
    for side in base new; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 decode_$side.log 110 python3 $dir/benchmarks/kernel_attention.py --out "$R/decode_$side" \
            --stages ceilings,decode --impls ours --batches 1,32,128 --contexts 4096,32768
    done ;;
s18e)
    for side in new base; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 engine_$side.log 190 python3 $dir/benchmarks/prefill_engine.py --out "$R/prefill_engine_$side" \
            --impls pallas_gpu_fresh_prefill_cudnn_segments --budget-s 175
    done
    for side in new base; do  # s18d's one decode difference over 2% (B=128 ctx 4k, +2.5%), again
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 decode_$side.log 80 python3 $dir/benchmarks/kernel_attention.py --out "$R/decode_$side" \
            --stages decode --impls ours --batches 64,128 --contexts 4096
    done ;;
s18f)
    on_gpu 0 check.log 90 python3 benchmarks/kernel_attention.py --out "$R/check" --stages check
    on_gpu 0 throughput1k.log $(( END - SECONDS - 10 )) python3 benchmarks/engine_throughput.py --out "$R/engine1k" \
        --workloads throughput-1k ;;
s18g)
    on_gpu 0 kv_write.log $(( END - SECONDS - 5 )) python3 benchmarks/kv_write_gpu.py --out "$R/kv_write" ;;
s19a)
    on_gpu 0 decode_small.log 290 python3 benchmarks/decode_small_batch.py --out "$R/decode_small" --budget-s 230
    on_gpu 0 kv_write.log 90 python3 benchmarks/kv_write_gpu.py --out "$R/kv_write"
    on_gpu 0 lab.log $(( END - SECONDS - 5 )) python3 benchmarks/latency_lab.py --out "$R/lab" --weights bf16 \
        --steps 16 --repeats 5 \
        --xla-options xla_gpu_dot_merger_threshold_mb=1024 \
        --xla-options xla_gpu_unsupported_enable_triton_multi_output_fusion=true ;;
s19b)
    on_gpu 0 decode_small.log 260 python3 benchmarks/decode_small_batch.py --out "$R/decode_small" --budget-s 215 \
        --shapes 1x32768,8x16384,1x16384,16x4096,1x4096,fp8:1x32768,4x8192,1x1024,32x4096
    on_gpu 0 lab.log $(( END - SECONDS - 5 )) python3 benchmarks/latency_lab.py --out "$R/lab" --weights bf16 \
        --steps 16 --repeats 5 --batches 32,128 --batch-context 1536 --xla-options xla_gpu_dot_merger_threshold_mb=32 ;;
s19c)
    on_gpu 0 decode_small.log 180 python3 benchmarks/decode_small_batch.py --out "$R/decode_small" --budget-s 140 \
        --rounds 1 --shapes 1x32768,8x16384,1x16384,1x4096,16x4096,fp8:1x32768,4x8192,1x1024,2x16384
    for side in new base; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 latency_bf16_$side.log 140 python3 $dir/benchmarks/engine_throughput.py --out "$R/latency_bf16_$side" \
            --workloads latency
    done
    on_gpu 0 latency_fp8_new.log $(( END - SECONDS - 5 )) python3 benchmarks/engine_throughput.py \
        --out "$R/latency_fp8_new" --workloads latency --quantization fp8 --kv-cache-dtype fp8 ;;
s19d)
    on_gpu 0 latency_bf16.log 130 python3 benchmarks/engine_throughput.py --out "$R/latency_bf16" --workloads latency
    on_gpu 0 lab.log $(( END - SECONDS - 5 )) python3 benchmarks/latency_lab.py --out "$R/lab" --weights fp8 \
        --steps 16 --repeats 5 --xla-options xla_gpu_dot_merger_threshold_mb=1024 ;;
s19e)
    on_gpu 0 latency_fp8.log 190 python3 benchmarks/engine_throughput.py --out "$R/latency_fp8" --workloads latency \
        --quantization fp8 --kv-cache-dtype fp8
    XLA_FLAGS=--xla_gpu_dot_merger_threshold_mb=32 on_gpu 0 latency_fp8_unmerged.log 120 \
        python3 benchmarks/engine_throughput.py --out "$R/latency_fp8_unmerged" --workloads latency \
        --quantization fp8 --kv-cache-dtype fp8 ;;
s20a)
    on_gpu 0 residual_norm.log 90 python3 benchmarks/residual_norm_gpu.py --out "$R/residual_norm"
    for side in new base; do  # B = .baseline/ (XLA's add and norm kernels)
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 lab_$side.log 200 python3 $dir/benchmarks/latency_lab.py --out "$R/lab_$side" --weights bf16 \
            --steps 16 --repeats 5 --batches 32 --batch-context 1536
    done ;;
s20c)
    for side in new base; do  # s20a: XLA splits the o and down GEMVs over K and adds the residual in the split
        dir=.; [ $side = base ] && dir=.baseline  # reduction; without split-K the add + norm kernel could take it
        on_gpu 0 lab_$side.log 170 python3 $dir/benchmarks/latency_lab.py --out "$R/lab_$side" --weights bf16 \
            --steps 16 --repeats 5 --xla-options xla_gpu_enable_split_k_autotuning=false
    done ;;
s20g)
    on_gpu 0 small_bucket.log 110 python3 benchmarks/small_bucket_decode.py --out "$R/small_bucket" --contexts 384,32768
    for side in new base; do  # B = .baseline/: session 19's code (the default kernel and XLA's K/V scatters)
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 latency_bf16_$side.log $(( (END - SECONDS) / 2 )) python3 $dir/benchmarks/engine_throughput.py \
            --out "$R/latency_bf16_$side" --workloads latency
    done ;;
s21a)
    on_gpu 0 latency_bf16_new.log 140 python3 benchmarks/engine_throughput.py --out "$R/latency_bf16_new" \
        --workloads latency --profile-latency-steps 8
    on_gpu 0 latency_bf16_base.log 130 python3 .baseline/benchmarks/engine_throughput.py \
        --out "$R/latency_bf16_base" --workloads latency
    on_gpu 0 small_bucket.log 100 python3 benchmarks/small_bucket_decode.py --out "$R/small_bucket" \
        --contexts 384,4096,32768 --chained 16 --splits 4,32
    for side in new base; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 dsb_$side.log $(( (END - SECONDS) / 2 )) python3 $dir/benchmarks/decode_small_batch.py \
            --out "$R/dsb_$side" --rounds 1 --shapes 8x16384,4x8192,1x32768
    done ;;
s21b)
    # Its first call ran the kernel's first version (one launch a projection, float32 partials and an
    # XLA epilogue; benchmarks/results/session21_h200.md). This form, for the second version (one launch
    # a group, the epilogue in the kernel, and the weight-only "wgmma-f16"), has not run yet (session
    # 21's device time ran out). Engine runs take ~60 s each on a warm machine; the sweep gets the rest.
    for choice in wgmma wgmma-f16; do
        JAXINFER_DECODE_MATMUL=$choice on_gpu 0 latency_fp8_$choice.log 100 python3 benchmarks/engine_throughput.py \
            --out "$R/latency_fp8_$choice" --workloads latency --quantization fp8 --kv-cache-dtype fp8 \
            --profile-latency-steps 8
    done
    on_gpu 0 latency_fp8_base.log 80 python3 benchmarks/engine_throughput.py \
        --out "$R/latency_fp8_base" --workloads latency --quantization fp8 --kv-cache-dtype fp8
    JAXINFER_DECODE_MATMUL=wgmma on_gpu 0 latency_bf16_wgmma.log 100 python3 \
        benchmarks/engine_throughput.py --out "$R/latency_bf16_wgmma" --workloads latency --profile-latency-steps 8
    on_gpu 0 latency_bf16_base.log 80 python3 \
        benchmarks/engine_throughput.py --out "$R/latency_bf16_base" --workloads latency
    on_gpu 0 wgmma_gemv.log $(( END - SECONDS - 5 )) python3 benchmarks/wgmma_gemv.py --out "$R/wgmma_gemv" \
        --ms 8,16 --budget-s $(( END - SECONDS - 40 )) ;;
s22a)
    # Session 22: the decode matmul's fused W8A8 mode (x rounded to e4m3 inside the kernel, per
    # token and K step: no XLA op before it) in the engine's fp8 batch-1 latency, traced beside XLA's
    # W8A16 (the default), then the other two modes untraced (wgmma-f16 overflowed shared memory at
    # 64 tokens in s21b, fixed), then the projection sweep with the fused mode.
    on_gpu 0 latency_fp8_base.log 150 python3 benchmarks/engine_throughput.py --out "$R/latency_fp8_base" \
        --workloads latency --quantization fp8 --kv-cache-dtype fp8 --profile-latency-steps 8
    JAXINFER_DECODE_MATMUL=wgmma-fused on_gpu 0 latency_fp8_wgmma-fused.log 110 python3 \
        benchmarks/engine_throughput.py --out "$R/latency_fp8_wgmma-fused" --workloads latency --quantization fp8 \
        --kv-cache-dtype fp8 --profile-latency-steps 8
    for choice in wgmma wgmma-f16; do
        JAXINFER_DECODE_MATMUL=$choice on_gpu 0 latency_fp8_$choice.log 80 python3 benchmarks/engine_throughput.py \
            --out "$R/latency_fp8_$choice" --workloads latency --quantization fp8 --kv-cache-dtype fp8
    done
    on_gpu 0 wgmma_gemv.log $(( END - SECONDS - 5 )) python3 benchmarks/wgmma_gemv.py --out "$R/wgmma_gemv" \
        --ms 8,16 --formats fp8 --budget-s $(( END - SECONDS - 40 )) ;;
s22b)
    # Session 22: the K/V write as one Pallas launch (gpu_write_kv, now the GPU kernels' default)
    # against XLA's two scatters (.baseline = the commit before), bf16 batch-1 latency traced and
    # batch-256 decode; then the fused W8A8 mode at its new sizes (512-byte steps, K split to a
    # program an SM), traced, and fp8 without it.
    for side in new base; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 latency_bf16_$side.log 170 python3 $dir/benchmarks/engine_throughput.py --out "$R/latency_bf16_$side" \
            --workloads latency,decode256 --profile-latency-steps 8
    done
    JAXINFER_DECODE_MATMUL=wgmma-fused on_gpu 0 latency_fp8_wgmma-fused.log 110 python3 \
        benchmarks/engine_throughput.py --out "$R/latency_fp8_wgmma-fused" --workloads latency --quantization fp8 \
        --kv-cache-dtype fp8 --profile-latency-steps 8
    on_gpu 0 latency_fp8_new.log $(( END - SECONDS - 5 )) python3 benchmarks/engine_throughput.py \
        --out "$R/latency_fp8_new" --workloads latency --quantization fp8 --kv-cache-dtype fp8 ;;
s22c)
    # Session 22: s22b again with the slots found inside the write's launch (s22b's XLA fusion for
    # them cost what the one launch saved): bf16 latency traced and decode256, new against
    # .baseline (XLA's scatters); fp8 + fp8 KV latency, new against .baseline.
    for side in new base; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 latency_bf16_$side.log 120 python3 $dir/benchmarks/engine_throughput.py --out "$R/latency_bf16_$side" \
            --workloads latency,decode256 --profile-latency-steps 8
    done
    for side in new base; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 latency_fp8_$side.log $(( (END - SECONDS) / 2 )) python3 $dir/benchmarks/engine_throughput.py \
            --out "$R/latency_fp8_$side" --workloads latency --quantization fp8 --kv-cache-dtype fp8
    done ;;
s23a)
    # Queued by session 22: the projection sweep timed on the device (its kernels' busy time in a
    # trace; s21b/s22a's host-timed sweeps disagreed with the engine's traces), fp8 at 8 and 16
    # tokens (XLA W8A16/W8A8, ours W8A8 tile sweep, the fused mode at three sizes, weight-only).
    on_gpu 0 wgmma_gemv.log $(( END - SECONDS - 5 )) python3 benchmarks/wgmma_gemv.py --out "$R/wgmma_gemv" \
        --ms 8,16 --formats fp8 --budget-s $(( END - SECONDS - 60 )) ;;
s23b)
    on_gpu 0 tp1k_fp8.log 300 python3 benchmarks/engine_throughput.py --out "$R/tp1k_fp8" --quantization fp8 \
        --kv-cache-dtype fp8 --workloads throughput-1k --profile-steps 3 --profile-prefill-steps 2
    on_gpu 0 tp1k_bf16.log $(( END - SECONDS - 5 )) python3 benchmarks/engine_throughput.py --out "$R/tp1k_bf16" \
        --workloads throughput-1k --profile-steps 3 --profile-prefill-steps 2 ;;
s23c)
    for side in new base; do
        dir=.; [ $side = base ] && dir=.baseline
        on_gpu 0 tp1k_fp8_$side.log 200 python3 $dir/benchmarks/engine_throughput.py --out "$R/tp1k_fp8_$side" \
            --quantization fp8 --kv-cache-dtype fp8 --workloads throughput-1k --profile-steps 3 --profile-prefill-steps 2
    done
    on_gpu 0 lab_bf16_384.log 110 python3 benchmarks/latency_lab.py --out "$R/lab_bf16_384" --weights bf16 \
        --batches 384 --batch-context 1024 --steps 8 --repeats 3 --xla-options xla_gpu_dot_merger_threshold_mb=0
    on_gpu 0 fp8_hlo_check.log $(( END - SECONDS - 5 )) python3 benchmarks/fp8_hlo_check.py --out "$R/fp8_hlo_check" \
        --buckets 128,512,2048 --layers 4 ;;
s23d)
    for shape in "384 1024" "32 4096"; do
        set -- $shape
        for kv in fp8 bf16; do
            on_gpu 0 ncu_${kv}_b$1_c$2.log 120 ncu --clock-control none --kernel-name regex:ragged_paged_attention \
                --launch-skip 1 --launch-count 1 --set full python3 benchmarks/kernel_ncu.py --batch $1 \
                --context $2 --kv-dtype $kv
        done
    done ;;
s24a)
    ncu --version >"$R/ncu_version.txt" 2>&1
    for shape in "fp8 384 1024" "bf16 384 1024" "fp8 32 4096" "bf16 32 4096"; do
        set -- $shape
        kv=$1; shift
        name=${kv}_b$1_c$2
        [ $(( END - SECONDS )) -lt 80 ] && break
        on_gpu 0 ncu_$name.log 110 ncu --clock-control none --kernel-name regex:ragged_paged_attention \
            --launch-skip 1 --launch-count 1 --set full --import-source yes -o "$R/$name" \
            python3 benchmarks/kernel_ncu.py --batch $1 --context $2 --kv-dtype $kv
        ncu -i "$R/$name.ncu-rep" --page details >"$R/details_$name.txt" 2>&1
        ncu -i "$R/$name.ncu-rep" --page source --csv --print-source sass >"$R/sass_$name.csv" 2>&1
    done ;;
s25a)
    on_gpu 0 frontier_fp8.log 150 python3 benchmarks/kernel_frontier.py --out "$R/fp8k" --only ceilings,fp8 \
        --budget-s 90 --fp8-shapes 384x1024,32x4096,1x16384
    # "cand": this tree with fp8 V widened in registers by default (gpu_tile.FP8_V_WIDENING_DEFAULT).
    mkdir -p /tmp/cand && cp -r pallas_kernels jaxinfer sharding benchmarks tests /tmp/cand/
    sed -i 's/^FP8_V_WIDENING_DEFAULT = "operand"/FP8_V_WIDENING_DEFAULT = "registers"/' \
        /tmp/cand/pallas_kernels/paged_attention/gpu_tile.py
    for side in ${SIDES:-cand new}; do  # SIDES=cand: no time for the engine as committed
        dir=.; [ $side = cand ] && dir=/tmp/cand
        on_gpu 0 tp1k_fp8_$side.log 160 python3 $dir/benchmarks/engine_throughput.py --out "$R/tp1k_fp8_$side" \
            --quantization fp8 --kv-cache-dtype fp8 --workloads throughput-1k
    done
    name=fp8_b384_c1024
    [ $(( END - SECONDS )) -gt 60 ] || exit_plan=1  # no time left for the Nsight Compute report
    [ -z "${exit_plan:-}" ] && on_gpu 0 ncu_$name.log $(( END - SECONDS - 10 )) ncu --clock-control none \
        --kernel-name regex:ragged_paged_attention --launch-skip 1 --launch-count 1 --set full -o "$R/$name" \
        python3 /tmp/cand/benchmarks/kernel_ncu.py --batch 384 --context 1024 --kv-dtype fp8  # V in registers
    [ -f "$R/$name.ncu-rep" ] && ncu -i "$R/$name.ncu-rep" --page details >"$R/details_$name.txt" 2>&1
    [ -f "$R/$name.ncu-rep" ] && ncu -i "$R/$name.ncu-rep" --page source --csv --print-source sass \
        >"$R/sass_$name.csv" 2>&1 ;;
s26a|s26c)  # s26c: the shorter call that measured the V^T fix (five shapes by default, smaller margins)
    shapes=384x1024,256x1024,32x4096,64x4096,256x4096,1x16384,32x16384,128x16384 margin=110
    [ $PLAN = s26c ] && shapes=${SHAPES:-384x1024,32x4096,64x4096,256x4096,1x16384} margin=75
    on_gpu 0 frontier_fp8.log $(( END - SECONDS - margin )) python3 benchmarks/kernel_frontier.py --out "$R/fp8k" \
        --only ceilings,fp8 --budget-s $(( END - SECONDS - margin - 40 )) --fp8-shapes $shapes
    name=fp8_dim_major_b384_c1024
    on_gpu 0 ncu_$name.log $(( END - SECONDS - 5 )) ncu --clock-control none \
        --kernel-name regex:ragged_paged_attention --launch-skip 1 --launch-count 1 --set full -o "$R/$name" \
        python3 benchmarks/kernel_ncu.py --batch 384 --context 1024 --kv-dtype fp8 --v-layout dim_major
    if [ -f "$R/$name.ncu-rep" ]; then
        ncu -i "$R/$name.ncu-rep" --page details >"$R/details_$name.txt" 2>&1
        ncu -i "$R/$name.ncu-rep" --page source --csv --print-source sass >"$R/sass_$name.csv" 2>&1
        python3 benchmarks/kernel_ncu.py --sass "$R/sass_$name.csv" --json "$R/sass_$name.json" >"$R/sass_$name.txt" 2>&1
    fi ;;
s26b)
    for v_layout in dim_major token_major; do
        JAXINFER_V_LAYOUT=$v_layout on_gpu 0 tp1k_fp8_$v_layout.log 175 python3 benchmarks/engine_throughput.py \
            --out "$R/tp1k_fp8_$v_layout" --quantization fp8 --kv-cache-dtype fp8 --workloads throughput-1k \
            --profile-steps 3
    done ;;
s27a)
    on_gpu 0 frontier_fp8.log "${FRONTIER_S:-210}" python3 benchmarks/kernel_frontier.py --out "$R/fp8k" \
        --only ceilings,fp8 --budget-s 1 --fp8-shapes ${SHAPES:-384x1024,384x1000,32x4096,32x4000,256x4096,1x16384}
    if [ "${TP1K:-1}" != 0 ]; then  # TP1K=0: the kernels only, where the device time left can't hold both engine runs
        JAXINFER_V_LAYOUT=dim_major on_gpu 0 tp1k_fp8_dim_major.log $(( (END - SECONDS) / 2 )) \
            python3 benchmarks/engine_throughput.py --out "$R/tp1k_fp8_dim_major" --quantization fp8 \
            --kv-cache-dtype fp8 --workloads throughput-1k
        JAXINFER_V_LAYOUT=token_major on_gpu 0 tp1k_fp8_token_major.log $(( END - SECONDS - 5 )) \
            python3 benchmarks/engine_throughput.py --out "$R/tp1k_fp8_token_major" --quantization fp8 \
            --kv-cache-dtype fp8 --workloads throughput-1k
    fi ;;
s28a)
    for layout in token_major dim_major; do
        JAXINFER_V_LAYOUT=$layout on_gpu 0 tp1k_fp8_$layout.log 190 python3 benchmarks/engine_throughput.py \
            --out "$R/tp1k_fp8_$layout" --quantization fp8 --kv-cache-dtype fp8 --workloads throughput-1k
    done
    on_gpu 0 kv_write.log 100 python3 benchmarks/kv_write_gpu.py --out "$R/kv_write" --tokens 64,384,1024,8192
    for layout in token_major dim_major; do
        left=$(( (END - SECONDS) / 2 ))
        [ "$left" -gt 60 ] || break
        JAXINFER_V_LAYOUT=$layout on_gpu 0 latency_fp8_$layout.log $left python3 benchmarks/engine_throughput.py \
            --out "$R/latency_fp8_$layout" --quantization fp8 --kv-cache-dtype fp8 --workloads latency
    done ;;
s28b)
    on_gpu 0 kv_write.log 100 python3 benchmarks/kv_write_gpu.py --out "$R/kv_write" --tokens 384,1024,8192
    for layout in dim_major token_major; do
        JAXINFER_V_LAYOUT=$layout on_gpu 0 tp1k_fp8_$layout.log $(( END - SECONDS > 320 ? 190 : END - SECONDS - 5 )) \
            python3 benchmarks/engine_throughput.py --out "$R/tp1k_fp8_$layout" --quantization fp8 \
            --kv-cache-dtype fp8 --workloads throughput-1k
    done ;;
*)
    echo "unknown plan $PLAN" >&2; exit 2 ;;
esac
# Traces are large and many files: keep them in their own archive.
(cd "$OUT" && find "$PLAN" -type d -name 'profile_*' -prune -print0 | tar czf "$PLAN-traces.tgz" --null -T -)
find "$R" -type d -name 'profile_*' -prune -exec rm -rf {} +
tar czf "$OUT/$PLAN.tgz" -C "$OUT" "$PLAN" && rm -rf "${R:?}"
ls -la "$OUT"
