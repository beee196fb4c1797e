"""The Triton kernels compile to CUDA binaries (sm_80, sm_90) with no GPU present.

The interpreter runs kernels as Python, so it misses what only the compiler checks (loop-carried types,
constexpr specialisation, layouts, shared-memory budgets). Triton ships ptxas, so the full pipeline down to a
cubin runs on CPU.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_PTR_TYPES = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    from specserve.kernels import triton_attention

    if triton_attention.interpreted():
        pytest.skip("this pytest process runs Triton in its interpreter (TRITON_INTERPRET=1 was set)")
    return triton_attention


def _compile(fn, values: dict[str, object], arch: int):
    """values: every kernel argument; tensors stand for pointers of their dtype, scalars for i32/fp32.

    Integer arguments equal to 1 become constants, as Triton's launcher specialises them (unit strides,
    a single sequence), so those variants of the code are compiled too.
    """
    signature, constexprs = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr or (type(value) is int and value == 1):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _PTR_TYPES[value.dtype]
        else:
            signature[param.name] = "fp32" if isinstance(value, float) else "i32"
    source = ASTSource(fn, signature, constexprs)
    return triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "enable_fp_fusion": True}
    )


def _runtime_ints(fn) -> dict[str, object]:
    """7 for every argument (any runtime value), but 1 for the innermost strides as in every real launch."""
    return {name: 1 if name.startswith("stride_") and name.endswith("d") else 7 for name in fn.arg_names}


def _ptr(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device="meta")


ATTENTION_CONFIGS = {
    # name: (dtype, head_dim, block_size, group, block_m, num_splits, num_seqs, arch, switches on): the
    # switches are the kernel's compile-time options (sliding window, soft-capping, tree verification)
    "decode-f16-d128-b16-gqa4-sm80": (torch.float16, 128, 16, 4, 16, 1, 64, 80, False),
    "splitk-bf16-d64-b32-gqa8-sm90": (torch.bfloat16, 64, 32, 8, 64, 4, 1, 90, False),
    "prefill-f32-d128-b16-gqa3-sm80": (torch.float32, 128, 16, 3, 64, 1, 3, 80, False),
    "tree-window-softcap-bf16-d64-b16-gqa3-sm90": (torch.bfloat16, 64, 16, 3, 16, 1, 4, 90, True),
}


@pytest.mark.parametrize("config", list(ATTENTION_CONFIGS.values()), ids=list(ATTENTION_CONFIGS))
def test_attention_kernel_compiles(kernels: ModuleType, config) -> None:
    dtype, head_dim, block_size, group, block_m, num_splits, num_seqs, arch, switches = config
    values = _runtime_ints(kernels._paged_attention_kernel)
    values |= {
        "out_ptr": _ptr(dtype),
        "part_acc_ptr": _ptr(torch.float32),
        "part_max_ptr": _ptr(torch.float32),
        "part_sum_ptr": _ptr(torch.float32),
        "q_ptr": _ptr(dtype),
        "k_cache_ptr": _ptr(dtype),
        "v_cache_ptr": _ptr(dtype),
        "block_tables_ptr": _ptr(torch.int32),
        "seq_lens_ptr": _ptr(torch.int32),
        "query_start_loc_ptr": _ptr(torch.int32),
        "scale_log2": 0.18,
        "num_seqs": num_seqs,
        "NUM_Q_HEADS": 8 * group,
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_PAD": head_dim,
        "BLOCK_SIZE": block_size,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "TILE_N": max(32, block_size),
        "NUM_SPLITS": num_splits,
        "DOT_DTYPE": {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[
            dtype
        ],
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "tree_mask_ptr": _ptr(torch.int64),
        "tree_depth_ptr": _ptr(torch.int32),
        "window": 7,
        "softcap": 30.0,
        "HAS_WINDOW": switches,
        "HAS_SOFTCAP": switches,
        "HAS_TREE": switches,
    }
    compiled = _compile(kernels._paged_attention_kernel, values, arch)
    assert compiled.asm["cubin"]


def test_merge_and_write_kv_kernels_compile(kernels: ModuleType) -> None:
    merge = _runtime_ints(kernels._merge_splits_kernel)
    merge |= {
        "out_ptr": _ptr(torch.bfloat16),
        "part_acc_ptr": _ptr(torch.float32),
        "part_max_ptr": _ptr(torch.float32),
        "part_sum_ptr": _ptr(torch.float32),
        "query_start_loc_ptr": _ptr(torch.int32),
        "NUM_Q_HEADS": 32,
        "HEAD_DIM": 128,
        "HEAD_PAD": 128,
        "NUM_SPLITS": 5,
        "SPLITS_PAD": 8,
    }
    assert _compile(kernels._merge_splits_kernel, merge, 80).asm["cubin"]

    write = _runtime_ints(kernels._write_kv_kernel)
    write |= {
        "key_ptr": _ptr(torch.float32),
        "value_ptr": _ptr(torch.float32),
        "k_cache_ptr": _ptr(torch.float16),
        "v_cache_ptr": _ptr(torch.float16),
        "slot_mapping_ptr": _ptr(torch.int32),
        "NUM_KV_HEADS": 8,
        "HEAD_DIM": 128,
        "HEADS_PAD": 8,
        "HEAD_PAD": 128,
        "BLOCK_SIZE": 16,
    }
    assert _compile(kernels._write_kv_kernel, write, 80).asm["cubin"]
