"""Row statistics alone, bf16 logits with softcap 30: part size x parts per program, by batch,
against the kernels of main (lab/old_kernels: parts of 32, softcap without the polynomial-only
groups). One GPU call: OUT=$OUT LIMIT=330 bash tools/on_device.sh sweep-parts python
../lab/sweep_parts.py"""

import os
import sys

import torch
import triton

from dgemma_sampler.kernels import row_stats as rs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.getcwd())  # bench/, where tools/on_device.sh runs commands
from bench_row_stats import make_logits  # noqa: E402
from old_kernels import row_stats as rs_old  # noqa: E402

W = 256
SIZES = (1, 4, 16, 32)
CANDIDATES = [(None, 1), (32, 1), (32, 2), (16, 1), (16, 2), (8, 1), (8, 4), (8, 8)]
STATS = ("argmax", "sample", "entropy", "lse", "has_nan")


def main() -> None:
    # "lm" rows: a bulk of sd 3, 32 plausible tokens raised by 5-15, a head by 10-20: some
    # groups of a row hold |x| >= 30 and take the softcap's general path
    big = make_logits(32, torch.bfloat16, "lm", 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in SIZES:
        rows = n * W
        x = big[:rows]
        rr = torch.arange(rows, device="cuda", dtype=torch.int32) // W
        rp = torch.arange(rows, device="cuda", dtype=torch.int32) % W
        temp = torch.ones(n, device="cuda")
        greedy = torch.zeros(n, device="cuda")
        seeds = torch.arange(n, device="cuda", dtype=torch.int64) + 7
        draws = torch.zeros(n, device="cuda", dtype=torch.int64)

        def call(cfg, t=temp, module=rs, x=x, rr=rr, rp=rp, seeds=seeds, draws=draws):
            return module.row_stats_rows(x, rr, rp, t, seeds, draws, softcap=30.0, config=cfg)

        fns, base = {}, {}
        for blocks, each in CANDIDATES:
            cfg = dict(part_blocks=blocks, part_group=each)
            out = call(cfg)
            torch.cuda.synchronize()
            if each == 1:
                base[blocks] = out
            else:
                for name in STATS:
                    assert torch.equal(getattr(out, name), getattr(base[blocks], name)), \
                        (n, blocks, each, name)
            fns[(blocks, each)] = lambda cfg=cfg: call(cfg)
            if (blocks, each) == (32, 1):
                fns[(blocks, f"{each}g")] = lambda cfg=cfg, g=greedy: call(cfg, t=g)
        old = call(None, module=rs_old)
        new = base[32]
        for name in ("argmax", "sample"):
            same = (getattr(old, name) == getattr(new, name)).float().mean().item()
            print(f"  old vs new parts of 32: {name} same in {same:.4f} of rows", flush=True)
        print(f"  lse max abs diff old/new {(old.lse - new.lse).abs().max().item():.3g}",
              flush=True)
        fns[("old", 32)] = lambda: call(None, module=rs_old)
        times = {k: [] for k in fns}
        for _ in range(2):
            for k, f in fns.items():
                times[k].append(triton.testing.do_bench(f, warmup=10, rep=40) * 1e3)
        auto = rs.part_group({}, rows, 8, sms)
        print(f"{n} req ({rows} rows; auto group for parts of 8: {auto}), us min/max: "
              + "  ".join(f"{b}x{e}: {min(t):.0f}/{sorted(t)[1]:.0f}" for (b, e), t in times.items()),
              flush=True)
    print("bits equal across part groups: ok")


if __name__ == "__main__":
    main()
