"""Side-by-side performance benchmark: prefill time, KV bytes, process memory and decoding speed per policy.

``caote bench`` (or ``python benchmarks/run.py``) measures, in one run and on one model:

1. **Prefill** at each context length (default 2k, 4k, 8k tokens of Paul Graham essays): wall time, KV-cache bytes
   at their peak and the process's peak resident memory, for

   * ``full-sdpa``   -- a plain `DynamicCache`, the whole prompt in one forward (the model's sdpa kernel);
   * ``full-blocks`` -- a plain `DynamicCache`, the prompt fed in blocks of ``block_size`` tokens;
   * every eviction policy (default: streamingllm, h2o / tova / snapkv and each ``+caote`` / ``+fastcaote``), an
     `EvictionCache` of ``budget`` tokens fed block-wise.

2. **Scoring overhead**: prefill time of each scored policy over streamingllm (which needs no attention rows) and
   of each ``+caote`` / ``+fastcaote`` over its base, as ratios of samples taken in the same round.

3. **Decoding**: tokens/s for ``new_tokens`` greedy tokens after the prompt, full cache versus a few budgeted
   policies, next to the speed-up a memory-traffic bound predicts (each decoded token reads every weight once and
   the whole KV cache once).

How the numbers are taken
-------------------------
* Configurations alternate: each repeat runs every configuration once (round-robin, in a rotated order), so slow
  drift of the machine (other processes, thermal state) hits all of them alike; ratios are taken per round, then
  the median over rounds is reported.
* Process memory: before each sample the high-water mark of resident memory is reset -- freed heap memory goes
  back to the kernel (``malloc_trim(0)``; torch's CPU allocator does not cache, it frees to malloc) and
  ``/proc/self/clear_refs`` gets ``5``, which sets ``VmHWM`` to the current ``VmRSS`` -- and ``VmHWM`` is read from
  ``/proc/self/status`` right after the prefill. The resident size after loading and a 16-token warm-up is the
  baseline, so ``peak - baseline`` is what the prefill itself added. (``tracemalloc`` does not see torch's
  allocations, and an un-reset high-water mark would carry the peaks of earlier samples.) ``isolate=True`` runs
  every sample in a fresh Python process instead (the most conservative reading, but each sample then pays the
  interpreter, torch and model start-up, minutes in all on a loaded 2-core machine).
* Wall times come from ``time.perf_counter`` around the prefill / decoding loop only (loading, tokenising and a
  small warm-up forward are outside). Every configuration asks the model for the logits of the last position only
  (``logits_to_keep=1``), as ``generate`` does.
* The machine's load average is recorded before every sample: the numbers are only as quiet as the machine.

Modules, bottom up: `config` (what to measure), `memory` (RSS, weight and KV bytes, load average), `inputs` (the
model and the prompt), `sample` (one measurement, in this process or a fresh one), `stats` (medians, paired ratios,
targets), `document` (results.md, results.png, growth.png), `schedule` (the round-robin run and results.json), `cli`
(``caote bench`` and ``benchmarks/run.py``).
"""
