"""The CPU backend: C++ kernels built on first use, loaded with ctypes, called by the model.

    build.py           ``library()``: both sources compiled into one library (cached), loaded with ctypes
    attention.py       ``AttentionRows``: every query of a step as one row of the C++ attention
    layer_ops.py       the elementwise work between a layer's matmuls; ``ForwardOps`` binds one forward
    attention_rows.cpp / layer_ops.cpp / elements.h   the C++ sources
"""
