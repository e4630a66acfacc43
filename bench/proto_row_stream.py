"""Prototype: can TMA-pipelined loads stream bf16 logits rows faster than register prefetch?

One warp per row computes the online max and sum of exp (the core of the row-statistics pass)
over 32 x 256 rows of V = 262144 bf16 logits, two ways:

* ``ptr``: pointer loads of 1024 entries per iteration with one iteration prefetched in
  registers (as ``kernels/row_stats.py`` does);
* ``tma``: a tensor descriptor over ``[rows, V / 256, 256]`` loading ``[1, 4, 256]`` boxes in a
  ``tl.range`` loop that Triton pipelines through shared memory (``num_stages`` deep);

and reports TB/s against a device copy. Bandwidth decides whether the row pass should move to
descriptor loads (issue #3: bf16 at 0.69x copy, latency-bound at 16 one-warp programs per SM).

``--split``: the ``tma`` stream over 1 and 4 requests (256 and 1024 rows) of fp32 and bf16
logits with each row's vocabulary split into ``SPLIT`` contiguous parts, one one-warp program
per part (partial results, no merge). It bounds what a split-vocabulary row pass could gain
where few rows leave the SMs idle (1 request: two one-warp programs per SM; the row-statistics
kernel takes 0.173 ms there for fp32, ``row_stats-h200-v25-few-rows.log``).

    python bench/proto_row_stream.py [--split]
"""

from __future__ import annotations

import sys

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
def _stat_split(desc, out_ptr, V: tl.constexpr, SPLIT: tl.constexpr, GROUPS: tl.constexpr,
                BOX: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The ``tma`` stream over part ``pid % SPLIT`` of row ``pid // SPLIT`` (SPLIT = 1: one
    program per row): ``[1, GROUPS, BOX]`` boxes of the ``[rows, V / BOX, BOX]`` descriptor in
    a loop Triton pipelines ``NUM_STAGES`` deep."""
    pid = tl.program_id(0)
    row = pid // SPLIT
    per_part: tl.constexpr = V // (GROUPS * BOX) // SPLIT
    first = (pid % SPLIT) * per_part
    m = tl.full([GROUPS * BOX], float("-inf"), tl.float32)
    s = tl.zeros([GROUPS * BOX], tl.float32)
    for g in tl.range(first, first + per_part, num_stages=NUM_STAGES):
        x = desc.load([row, g * GROUPS, 0]).reshape([GROUPS * BOX]).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp2(m - m_new) + tl.exp2(x - m_new)
        m = m_new
    tl.store(out_ptr + pid, tl.max(m, 0) + tl.sum(s, 0))


def split_sweep(vocab: int = VOCAB, widths=(256, 1024), splits=(1, 2, 4, 8, 16), groups: int = 4,
                stages: int = 3, device: str = "cuda") -> list[dict]:
    """Kernel time of ``_stat_split`` per (dtype, rows, SPLIT); on a CPU (interpreter) one call
    each, to check that it runs."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in widths:
            x = torch.randn(rows, vocab, device=device).to(dtype)
            view = x.view(rows, vocab // BOX, BOX)
            desc = TensorDescriptor.from_tensor(view, [1, groups, BOX])
            nbytes = x.numel() * x.element_size()
            for split in splits:
                out = torch.empty(rows * split, device=device)
                fn = lambda: _stat_split[(rows * split,)](desc, out, vocab, split, groups, BOX,  # noqa: E731
                                                          stages, num_warps=1)
                fn()
                ms = float("nan")
                if device == "cuda":
                    ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
                assert torch.isfinite(out).all()
                rec = dict(dtype=str(dtype).replace("torch.", ""), rows=rows, split=split, ms=ms,
                           tbps=nbytes / (ms * 1e-3) / 1e12)
                results.append(rec)
                print(f"{rec['dtype']:9s} rows {rows:5d} split {split:2d}: {ms:.4f} ms "
                      f"{rec['tbps']:.2f} TB/s", flush=True)
    return results


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if "--split" in sys.argv:
        split_sweep()
        return

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
            fn = lambda: _stat_split[(ROWS,)](desc, out, VOCAB, 1, groups, BOX, stages,
                                              num_warps=warps)
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
