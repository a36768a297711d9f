"""Measuring: engines side by side, workloads, summaries, load against a server.

    compare        python -m minillm bench: engines side by side on one workload
    workload       seeded synthetic traffic (length mixes, arrivals)
    prompts        the prompt sets: chat prompts, chapter 5's grounded / open sets
    summary        TTFT / TPOT / ITL percentiles, slot utilization, KV waste, the tables
    cost_model     a fitted step-time model; the simulator (the engine on a virtual clock)
    hf_baselines   transformers' generate and continuous batching, measured the same way
    vllm_peer      vLLM's CPU build in its own virtualenv, run as a subprocess
    profile_step   where one engine step's time goes (torch profiler)
    exactness      the exactness test of speculative sampling
    spec_measure   timing speculation: timed runs, the cost of a verification forward
    many_users     many users on one engine: throughput and latency by concurrency
    dtype_agreement  greedy tokens of two dtypes side by side
    loadgen        python -m minillm load: an open-loop load generator that speaks only HTTP
    sweep          latency against load: a sweep of arrival rates
    overhead       what the server adds on top of the engine at low load
    gpu_check      make gpu-check: the GPU tests and benchmarks in one run

Nothing here is on the engine's step path; the engine never imports this package.
"""
