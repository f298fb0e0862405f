"""The rollout/serving engine: live conversations on a paged KV cache.

Its public interface, written down:

engine.engine.Engine(params, cfg, *, num_slots, max_len, mesh=None, stop_ids=(IM_END_ID,),
        decode_chunk=32, extend_widths=(32, 128, 512, 2048), min_batch_bucket=1,
        kv_cache_tokens=None, page_size=None, max_extend_tokens=8192, attention="auto",
        kernel_blocks=KernelBlocks(), batch_rows=None, extend_tile=None, deterministic=False,
        decode_tile=None, record_experts=False)
    num_slots: conversations open at once; max_len: tokens per conversation;
    kv_cache_tokens: the page pool in tokens (default max(num_slots, shards) * max_len);
    page_size: tokens per page (default 128 on the Pallas path, else 16);
    attention: "auto" (Pallas kernel on TPU, "paged" on GPU, else "reference"), "pallas",
    "paged" (pure JAX, pages read in place) or "reference" (pure JAX, the decode on a dense
    copy of a chunk's pages; extends read pages in place on every path);
    extends are packed: every waiting token in rows of extend_tile, up to max_extend_tokens
    per shard per call; deterministic: token tiles (muajax/models/token_tiles.py), so a
    conversation's numbers do not depend on which others share its calls and only the tiles
    that hold tokens run; decode rows in tiles of decode_tile (extend_tile and decode_tile
    None: by platform, batching.TILES: 16 and 2 on CPU, 128 and every slot elsewhere);
    batch_rows: the older way to the same end: every call has this many rows per shard,
    extends at extend_widths (None: packed).
    record_experts: a mixture of experts' chosen experts of every computed token, kept per
    conversation (experts.py; routing replay); the CPU decode then reads pages in place.
  open(tokens, *, seed=0) -> slot        release(slot)          append(slot, tokens)
  start(slot, SamplingParams)            step() -> [Generation]  generate(slots, sampling) -> {slot: Generation}
  flush(slots=None, *, keep_last=False)  length(slot)           is_generating(slot)    sampled(slot)
  register_prefix(tokens)                clear_prefixes()       cached_kv(slot) -> (k, v)
  experts(slot) -> uint8 [cached tokens, layers, experts per token] (record_experts)
  release_memory() (free the pool; allocated again on next use)   warmup(max_tokens=None) -> programs compiled
  free_slots, num_slots, max_len, params (assign new params after an update), stats, batch_buckets,
  extend_widths, page_size, attention
  stats: decode_steps, decode_tokens, decode_calls, extend_tokens, extend_calls, device_s,
         preemptions, prefix_hits, prefix_prefill_tokens, peak_pages, and the positions the
         layers computed, extend_positions and decode_positions (padding included)
engine.engine.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024)
engine.engine.Generation(slot, tokens, logprobs, finish_reason in {"stop", "length", "context"})
engine.sampling.sample_tokens(logits, keys, temperature, top_p, top_k) -> (tokens, logprobs)

For planners (compile for a topology without allocating anything):
engine.programs.abstract_programs(cfg, mesh, *, kv_cache_tokens, page_size=None, max_seqs,
        max_len, widths=(32, 128, 512, 2048), decode_chunk=16, max_extend_tokens=8192,
        attention="auto", blocks=KernelBlocks(), dense_tokens=None, params=None, extend_tile=16,
        deterministic=False, decode_tile=4) -> [ProgramCall]
    The Engine's own jitted programs (decode with every shard full, the packed extend at its
    most rows, or with extend_tile=None the fixed-row extend at each width) on
    ShapeDtypeStruct arguments carrying their shardings; `call.lower().compile()` gives
    `memory_analysis()` and `cost_analysis()`. Lowering enters the mesh's activation rules,
    so for a TPU topology's mesh the Pallas kernel sees TPU devices.
engine.programs.build_spec(cfg, mesh, *, num_slots, max_len, kv_cache_tokens=None, page_size=None,
        decode_chunk=32, attention="auto", blocks=KernelBlocks()) -> ProgramSpec
    The static layout (pool shape and sharding, page size, attention path) the Engine uses.

Modules: pages.py (host: page pool, page tables, refcounts, preemption, shared prefixes),
batching.py (host: rows per shard, buckets, packed and fixed-row extends), kv_cache.py
(device: the pool and shard-local page gathers/writes), paged_attention.py (the path choice,
the Pallas kernel hook), paged_reference.py (pure-JAX attention over pages in place),
layer_views.py (per-layer weight views for the dense CPU decode), programs.py (the jitted extend and decode programs), precompile.py (compiling them all
ahead), decode_loop.py (the decode programs' sample loop), experts.py (recorded experts), sampling.py,
generation.py (SamplingParams, Generation), prefixes.py (shared prefixes), engine.py.
"""
