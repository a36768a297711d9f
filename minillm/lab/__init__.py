"""The lab: measuring and teaching, kept apart from the engine's step path.

    bench          python -m minillm bench: engines side by side on one workload
    workload       seeded synthetic traffic (length mixes, arrivals)
    summary        TTFT / TPOT / ITL percentiles, slot utilization, KV waste, the tables
    cost_model     a fitted step-time model; the simulator (the engine on a virtual clock)
    viz            timelines, utilization, latency CDFs, block tables, the widget explorer
    hf_baselines   transformers' generate and continuous batching, measured the same way
    exactness      the exactness test of speculative sampling
    spec_measure   timing speculation: timed runs, the cost of a verification forward
    prompts        the grounded / open prompt sets of chapter 5
    notebook       helpers the chapters share
    jupyter        the command behind ``make lab``
"""
