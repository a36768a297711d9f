"""The CPU backend: C++ kernels built on first use, loaded with ctypes, called by the model.

    build.py           ``library()``: the sources compiled into one library (cached), loaded with ctypes
    attention.py       ``AttentionRows``: every query of a step as one row of the C++ attention
    layer_ops.py       the elementwise work between a layer's matmuls; ``ForwardOps`` binds one forward
    quant.py           ``int8_linear``, ``u8_linear``, ``q4_linear``: linear layers with int8 / 8-bit / 4-bit
                       weights (and their oracles)
    attention_rows.cpp / layer_ops.cpp / elements.h / quant_matmul.cpp   the C++ sources
"""
