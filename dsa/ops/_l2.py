"""L2 cache hints for Triton kernels on NVIDIA GPUs (inline PTX; the interpreter and other
GPUs have none, so callers gate them with ``on_nvidia_gpu``)."""

import triton
import triton.language as tl


@triton.jit
def prefetch_lines(ptrs):
    """L2 prefetch of the lines holding ``ptrs`` (nothing waits on it)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def discard_lines(start, end, LINES: tl.constexpr):
    """Drops from L2, unwritten, the 128-byte lines lying wholly in bytes ``[start, end)``
    (int64 addresses), ``LINES`` (>= 1) a step: their contents become undefined, and dead
    data costs no write-back."""
    tl.static_assert(LINES > 0, "discard_lines: LINES must be positive")
    last = end // 128
    for first in range((start + 127) // 128, last, LINES):
        line = first + tl.arange(0, LINES)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p discard.global.L2 [$1], 128; "
            "mov.u32 $0, 0; }", "=r,l,r", [line * 128, (line < last).to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
