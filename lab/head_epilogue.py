"""What the row statistics would cost in the head GEMM's epilogue (issue #37, item 7).

The shipped head GEMM (TMA, 128x256x64, persistent) against copies of it whose epilogue also
computes, per row and output tile of 256 columns, from the rounded bf16 logits with softcap 30:
the max, the sum of exp2((z - m) log2 e), sum u 2^u (entropy) and the arg-max, written as four
[M, V / 256] arrays (what a merge per row would read). Variants: the softcap's general formula
on every entry, or the polynomial where the tile's largest |x| allows; with and without
``warp_specialize`` on the tile loop. Timed against the statistics pass on the same logits
(parts of 32, the branch's kernels). Not the product: a measurement.

OUT=$OUT LIMIT=200 bash tools/on_device.sh head-epilogue python ../lab/head_epilogue.py
"""

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dgemma_sampler.kernels import head_gemm as hg
from dgemma_sampler.kernels import row_stats as rs
from dgemma_sampler.kernels.logit_row import LOG2E, exp2_ftz, softcapped

V, H, W = 262144, 2816, 256


@triton.jit
def _epilogue_stats(acc, row0, col0, n_tile, M, n_tiles_n, m_ptr, s_ptr, a_ptr, i_ptr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                    POLY: tl.constexpr):
    x = acc.to(tl.bfloat16).to(tl.float32)
    if POLY:
        top = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        if top < SOFTCAP:
            z = softcapped(x, SOFTCAP, BELOW=True)
        else:
            z = softcapped(x, SOFTCAP)
    else:
        z = softcapped(x, SOFTCAP)
    m = tl.max(z, axis=1)
    u = (z - m[:, None]) * LOG2E
    e = exp2_ftz(u, False)
    s = tl.sum(e, axis=1)
    a = tl.sum(u * e, axis=1)
    cols = col0 + tl.arange(0, BLOCK_N)
    idx = tl.min(tl.where(z == m[:, None], cols[None, :], 2**31 - 1), axis=1)
    rows = row0 + tl.arange(0, BLOCK_M)
    off = rows.to(tl.int64) * n_tiles_n + n_tile
    ok = rows < M
    tl.store(m_ptr + off, m, mask=ok)
    tl.store(s_ptr + off, s, mask=ok)
    tl.store(a_ptr + off, a, mask=ok)
    tl.store(i_ptr + off, idx, mask=ok)


@triton.jit
def head_stats_kernel(h_desc, w_desc, out_desc, m_ptr, s_ptr, a_ptr, i_ptr, M, V, H, NUM_PROGRAMS,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, STATS: tl.constexpr, POLY: tl.constexpr,
                      SOFTCAP: tl.constexpr, WS: tl.constexpr):
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_n = tl.cdiv(V, BLOCK_N)
    k_blocks = tl.cdiv(H, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_tiles_m * n_tiles_n, NUM_PROGRAMS, flatten=not WS,
                         warp_specialize=WS):
        m_tile, n_tile = hg._tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M)
        row0 = m_tile * BLOCK_M
        col0 = n_tile * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(k_blocks):
            k0 = kb * BLOCK_K
            a = h_desc.load([row0, k0])
            b = w_desc.load([col0, k0])
            acc = tl.dot(a, tl.trans(b), acc)
        out_desc.store([row0, col0], acc.to(out_desc.dtype))
        if STATS:
            _epilogue_stats(acc, row0, col0, n_tile, M, n_tiles_n, m_ptr, s_ptr, a_ptr, i_ptr,
                            BLOCK_M, BLOCK_N, SOFTCAP, POLY)


def launch(hidden, weight, out, stats, variant):
    stats_on, poly, ws = variant
    cfg = hg.CONFIG
    m = hidden.shape[0]
    descs = (TensorDescriptor(hidden, [m, H], [hidden.stride(0), 1], [cfg.block_m, cfg.block_k]),
             TensorDescriptor(weight, [V, H], [weight.stride(0), 1], [cfg.block_n, cfg.block_k]),
             TensorDescriptor(out, [m, V], [out.stride(0), 1], [cfg.block_m, cfg.block_n]))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(V, cfg.block_n)
    programs = min(n_tiles, sms)
    head_stats_kernel[(programs,)](*descs, *stats, m, V, H, programs,
                                   BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                   GROUP_M=cfg.group_m, STATS=stats_on, POLY=poly, SOFTCAP=30.0,
                                   WS=ws, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def main() -> None:
    torch.manual_seed(0)
    weight = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    variants = {"plain": (False, False, False), "stats": (True, False, False),
                "stats+poly": (True, True, False), "plain/ws": (False, False, True),
                "stats+poly/ws": (True, True, True)}
    for n in (1, 4, 16, 32):
        rows = n * W
        hidden = (torch.randn(rows, H, device="cuda") * 3).to(torch.bfloat16)
        out = hg.empty_logits(rows, V, torch.bfloat16, hidden.device)
        nt = V // 256
        stats = (torch.empty(rows, nt, device="cuda"), torch.empty(rows, nt, device="cuda"),
                 torch.empty(rows, nt, device="cuda"),
                 torch.empty(rows, nt, device="cuda", dtype=torch.int32))
        ref = hg.project(hidden, weight)
        line = [f"{n} req:"]
        fns = {"shipped": lambda h=hidden, o=out: hg.project(h, weight, o)}
        for name, var in variants.items():
            try:
                launch(hidden, weight, out, stats, var)
                torch.cuda.synchronize()
                same = torch.equal(out, ref)
                if var[0]:
                    z = 30.0 * torch.tanh(ref.float() / 30.0)
                    zt = z.view(rows, nt, 256)
                    mx = zt.amax(-1)
                    err = (stats[0] - mx).abs().max().item()
                    lse = (stats[0] + torch.log(stats[1])).logsumexp(-1)
                    lse_ref = torch.logsumexp(z, -1)
                    err = max(err, (lse - lse_ref).abs().max().item())
                    line.append(f"[{name}: bits {same}, err {err:.2g}]")
                else:
                    line.append(f"[{name}: bits {same}]")
                fns[name] = lambda h=hidden, o=out, st=stats, v=var: launch(h, weight, o, st, v)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a finding
                line.append(f"[{name}: failed {type(e).__name__}: {str(e)[:200]}]")
        rr = torch.arange(rows, device="cuda", dtype=torch.int32) // W
        rp = torch.arange(rows, device="cuda", dtype=torch.int32) % W
        temp = torch.ones(n, device="cuda")
        seeds = torch.arange(n, device="cuda", dtype=torch.int64) + 7
        draws = torch.zeros(n, device="cuda", dtype=torch.int64)
        args = (ref, rr, rp, temp, seeds, draws)
        fns["stats pass"] = lambda a=args: rs.row_stats_rows(*a, softcap=30.0)
        print(" ".join(line), flush=True)
        times = {k: [] for k in fns}
        for _ in range(2):
            for k, f in fns.items():
                times[k].append(triton.testing.do_bench(f, warmup=5, rep=30 if n < 16 else 100))
        print(f"{n} req, ms min/max: "
              + "  ".join(f"{k} {min(t):.3f}/{sorted(t)[1]:.3f}" for k, t in times.items()),
              flush=True)
        del out, stats, ref, hidden
    sys.exit(0)


if __name__ == "__main__":
    main()
