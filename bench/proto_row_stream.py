"""Prototype: can TMA-pipelined loads stream bf16 logits rows faster than register prefetch?

One warp per row computes the online max and sum of exp (the core of the row-statistics pass)
over 32 x 256 rows of V = 262144 bf16 logits, two ways:

* ``ptr``: pointer loads of 1024 entries per iteration with one iteration prefetched in
  registers (as ``kernels/row_stats.py`` does);
* ``tma``: a tensor descriptor over ``[rows, V / 256, 256]`` loading ``[1, 4, 256]`` boxes in a
  ``tl.range`` loop that Triton pipelines through shared memory (``num_stages`` deep);

and reports TB/s against a device copy. Bandwidth decides whether the row pass should move to
descriptor loads (issue #3: bf16 at 0.69x copy, latency-bound at 16 one-warp programs per SM).

    python bench/proto_row_stream.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

ROWS, VOCAB, BOX = 8192, 262144, 256


@triton.jit
def _stat_ptr(x_ptr, out_ptr, V: tl.constexpr, SPAN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * V
    offs = tl.arange(0, SPAN)
    m = tl.full([SPAN], float("-inf"), tl.float32)
    s = tl.zeros([SPAN], tl.float32)
    nxt = tl.load(base + offs)
    for start in range(SPAN, V + SPAN, SPAN):
        x = nxt.to(tl.float32)
        if start < V:
            nxt = tl.load(base + start + offs)
        m_new = tl.maximum(m, x)
        s = s * tl.exp2(m - m_new) + tl.exp2(x - m_new)
        m = m_new
    tl.store(out_ptr + row, tl.max(m, 0) + tl.sum(s, 0))


@triton.jit
def _stat_tma(desc, out_ptr, V: tl.constexpr, GROUPS: tl.constexpr, BOX: tl.constexpr,
              NUM_STAGES: tl.constexpr):
    row = tl.program_id(0)
    m = tl.full([GROUPS * BOX], float("-inf"), tl.float32)
    s = tl.zeros([GROUPS * BOX], tl.float32)
    for g in tl.range(0, V // (GROUPS * BOX), num_stages=NUM_STAGES):
        x = desc.load([row, g * GROUPS, 0]).reshape([GROUPS * BOX]).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp2(m - m_new) + tl.exp2(x - m_new)
        m = m_new
    tl.store(out_ptr + row, tl.max(m, 0) + tl.sum(s, 0))


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.randn(ROWS, VOCAB, device="cuda").to(torch.bfloat16)
    out = torch.empty(ROWS, device="cuda")
    nbytes = x.numel() * x.element_size()
    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=100)
    print(f"copy {2 * nbytes / copy_ms / 1e9:.2f} TB/s (read + write)")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    for span in (1024, 2048):
        fn = lambda: _stat_ptr[(ROWS,)](x, out, VOCAB, span, num_warps=1)
        fn()
        ms = bench(fn)
        k = _stat_ptr.warmup(x, out, VOCAB, span, num_warps=1, grid=(ROWS,))
        print(f"ptr span {span}: {ms:.3f} ms {nbytes / ms / 1e9:.2f} TB/s regs {getattr(k, 'n_regs', '?')}",
              flush=True)
    view = x.view(ROWS, VOCAB // BOX, BOX)
    for groups, warps in ((4, 1), (8, 1), (8, 2)):
        desc = TensorDescriptor.from_tensor(view, [1, groups, BOX])
        for stages in (3, 4, 6):
            fn = lambda: _stat_tma[(ROWS,)](desc, out, VOCAB, groups, BOX, stages, num_warps=warps)
            try:
                fn()
                torch.cuda.synchronize()
                ms = bench(fn)
            except Exception as exc:
                print(f"tma groups {groups} warps {warps} stages {stages}: failed {str(exc)[:200]}")
                continue
            print(f"tma groups {groups} warps {warps} stages {stages}: {ms:.3f} ms "
                  f"{nbytes / ms / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
