"""The C++ CPU kernel library, by op family: build (compile, cache, load, the ISA variants and the paths a
build holds), attention, elementwise (norms, activations, rope + KV write), matmul (quantized and dense
products), bitmask (structured output) and chain (a whole step's decoder layers in one call). The C++ is
csrc/, compiled as one translation unit (csrc/unity.cpp).

    from specserve.kernels import cpu
    if cpu.build.load() is not None:
        y = cpu.matmul.int8_matmul(x, codes, scales)
"""

from specserve.kernels.cpu import attention, bitmask, build, chain, elementwise, matmul

__all__ = ["attention", "bitmask", "build", "chain", "elementwise", "matmul"]
