"""decode-appliance: the engine and its command line.

Module map (wings by concern; the arrows are the only imports allowed, held by tests/test_layering.py):

    front     api.py      Request and events: the Engine API's plain objects (no torch)
              errors.py   exceptions with code, field and value
              options.py  RunOptions: how a model runs, built once (no torch)
              loader.py   a model directory -> LoadedModel (config, weights, drafter, shards, capture blockers)
              engine.py   Engine: one engine thread, requests in, events out
    chat/     DeepSeek V4 / V4.1 chat encoding (messages -> prompt text) and output parsing (pure Python)
    model/    what a checkpoint computes, in plain torch over the op registry (kernels/): config, weights,
              tokenizer, runtime, state, step, blocks, rope, compressor, engram, one file per family
              (deepseek_v4.py, deepseek_v41.py) and per drafter (dspark.py, mtp.py), families.py
    decode/   the request loop (loop.py; chat.py: a chat request's prompt ids and output parser; text.py: the
              output's ids as text, stop strings held back), the job every rank runs and rank 0's decisions
              in it (plan.py), the decode session that owns state, speculator and graphs (session.py), the
              cycle steps (cycle.py), the speculator (speculator.py); prefix reuse: the timeline of the live
              state (timeline.py), ring checkpoints (checkpoint.py), the prefix cache (prefix_cache.py: a
              radix trie in host memory) and its disk tier (prefix_disk.py)
    parallel/ several devices: process group and collectives (world.py), sharding, placement
    measure/  sizes from a config (sizes.py), memory plans (memory.py), the benchmark library (bench.py), the
              cycle recorder (recorder.py, count.py), meta builds (shapes.py), the cost model (costmodel.py), an
              agent's conversation replayed (agent.py), the costs of prefix reuse (prefix.py) and the model's
              choices recorded from outside (selections.py: kept rows, Engram ids, routed experts)
    cli/      one module per command family; the only place that imports server/; tiny_checkpoint.py writes
              tiny random checkpoints (`appliance tiny`, the tests' fixtures)

    chat     -> errors
    model    -> kernels, errors
    parallel -> model
    decode   -> model, chat, graphs, kernels, api, options
    measure  -> model, parallel, kernels, api, chat (an agent's conversation for `bench agent`)
    loader   -> model, parallel, options
    engine   -> decode, measure, parallel, loader
    cli      -> everything, and server (the one upward arrow)
    server   -> api, errors, chat (never torch); kernels and graphs import nothing of ours
"""

__version__ = "0.1.0"
