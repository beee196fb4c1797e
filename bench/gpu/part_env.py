"""The device's two ceilings, measured: copy bandwidth (bytes read + written) and the bf16 matrix rate."""

from __future__ import annotations

import torch

from bench.gpu.common import Context, Part, median_ms, table


def run(ctx: Context) -> Part:
    dev = ctx.device
    data: dict[str, object] = {}
    rows = []
    if ctx.cuda:
        props = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        data.update(
            name=props.name,
            sms=props.multi_processor_count,
            memory_gib=total / 2**30,
            free_gib=free / 2**30,
            capability=f"{props.major}.{props.minor}",
        )
        rows.append(
            ["device", f"{props.name}, {props.multi_processor_count} SMs, sm_{props.major}{props.minor}"]
        )
        rows.append(["memory", f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} free)"])
    nbytes = (1 << 30) if ctx.cuda else (64 << 20)
    # several buffers, so repeated copies are not served from L2
    src = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev) for _ in range(2)]
    dst = torch.empty_like(src[0])
    turn = [0]

    def copy() -> None:
        turn[0] ^= 1
        dst.copy_(src[turn[0]])

    ms = median_ms(ctx, copy, warmup=3, iters=10)
    gbs = 2 * src[0].numel() / (ms * 1e-3) / 1e9
    ctx.bandwidth_gbs = gbs
    data["copy_gbs"] = gbs
    rows.append(
        ["device-to-device copy (read + write)", f"{gbs:,.0f} GB/s ({src[0].numel() >> 20} MiB, {ms:.3f} ms)"]
    )
    n = 8192 if ctx.cuda else 256
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    ms = median_ms(ctx, lambda: a @ b, warmup=3, iters=10)
    tflops = 2 * n**3 / (ms * 1e-3) / 1e12
    data["matmul_tflops"] = tflops
    rows.append(
        [f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')} matmul (random data)", f"{tflops:,.3g} TFLOP/s"]
    )
    return Part("env", True, table(["ceiling", "measured"], rows), data)
