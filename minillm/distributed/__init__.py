"""Tensor parallelism on torch.distributed (chapter 10): one model over N processes.

* ``sharding``: which rank holds which slice of each layer; the all-reduce formula;
* ``group``: the ranks' process group (gloo on the CPU, NCCL on CUDA), its traffic counted;
* ``parallel_model``: one rank's model, with two all-reduces a layer;
* ``worker``: ranks 1..N-1, each in its own process;
* ``runner``: rank 0, the engine's model runner for ``LLM(tensor_parallel_size=N)``.
"""
