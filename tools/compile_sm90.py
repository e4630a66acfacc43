"""Compile the Gluon soft-embedding GEMM (or the row-statistics kernel) for sm_90 without a GPU.

Triton compiles for a target it is told, and ptxas ships in the wheel: with the driver
replaced by a stand-in that names an H100/H200 (sm_90) and launches turned into warm-ups,
``soft_embedding_wgmma.launch`` compiles exactly what it would run, and ptxas reports the
registers, spills and shared memory of each specialization (fp32 / bf16 / fp16 logits, with
and without a top-k/top-p threshold, rows in order or by a row order planned on the device
or on the host, and for logits in E's dtype the given operand of ``soft_embedding_operand``). Use it to
check a kernel change before spending device time; speed still needs the GPU.

The device runs Triton 3.6; to compile with that version here, put its wheel in a virtualenv
of its own and borrow torch and this package from the project's ``.venv``:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install --no-deps triton==3.6.0
    /tmp/t36/bin/python tools/compile_sm90.py --site .venv/lib/python3.11/site-packages \\
        [--sass /tmp/sass] [--loops]

``--sass DIR`` writes each specialization's PTX and SASS (compare two trees' SASS to show that
a change compiles to the same code); ``--loops`` prints the SASS instruction count of each
consumer warpgroup's K loop. With the project's own interpreter it compiles with the Triton
installed there (``tests/`` runs it that way).

``--head`` compiles the LM-head projection (``head_gemm.py``, bf16, TMA and pointer loads) and
the pass that writes the soft-embedding operand over its logits (``soft_embedding_operand.py``),
and reports their registers, spills and shared memory; with ``--head-configs TILES`` it compiles
those head tiles instead and says which would launch (``tools/head_configs.py`` times them).

``--row-stats`` compiles the row-statistics kernel instead (fp32 / bf16 logits, the descriptor
walk, unsplit and split into parts) and checks, in the split kernel's PTX, what its merge
relies on: one atomic per program, the count of its arrival, issued by its thread 0 with
acq_rel semantics.
``--canvas-update`` compiles the step's canvas update (``canvas_update.py``) and its
per-request prologue (``request_prologue.py``).
"""

from __future__ import annotations

import argparse
import os
import site
import subprocess
import sys
import tempfile


def mma_loop_lengths(sass: str) -> list[int]:
    """Instruction counts of the innermost loops (a backward branch and its target) that hold
    an HGMMA, in address order: the consumer warpgroups' K loops (one per warpgroup and loop)."""
    import re

    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,6})\*/\s+([^;]*);", sass)]
    mma = [a for a, text in ins if "HGMMA" in text]
    loops = set()
    for a, text in ins:
        m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and any(int(m.group(1), 16) <= h <= a for h in mma):
            loops.add((int(m.group(1), 16), a))
    # a range that contains or overlaps a shorter one is not an innermost loop
    inner = sorted(l for l in loops if not any(
        o != l and o[1] - o[0] < l[1] - l[0] and o[0] <= l[1] and l[0] <= o[1] for o in loops))
    return [sum(1 for a, _ in ins if lo <= a <= hi) for lo, hi in inner]


def assemble(ptxas: str, ptx: str, cubin: str):
    """ptxas -v of one kernel's PTX: (the completed process, its resource and error lines)."""
    path = cubin[:-len(".cubin")] + ".ptx"
    with open(path, "w") as f:
        f.write(ptx)
    report = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", cubin],
                            capture_output=True, text=True)
    lines = [line.split(":", 1)[-1].strip() for line in (report.stdout + report.stderr).splitlines()
             if any(k in line for k in ("Used", "spill", "arning", "rror", "fatal"))]
    return report, lines


def atomic_predicates(ptx: str) -> tuple[int, set[str], int]:
    """(number of global atomics, the predicates they are issued under, how many of them are
    acq_rel adds) in a kernel's PTX."""
    import re

    found = re.findall(r"^\s*(@%p\d+)?\s*atom\.global((?:\.\w+)*)", ptx, flags=re.M)
    acq_rel_adds = sum(".acq_rel." in qualifiers and ".add." in qualifiers
                       for _, qualifiers in found)
    return len(found), {predicate for predicate, _ in found}, acq_rel_adds


def recording_compiles() -> list:
    """From now on every JIT launch (a warm-up under the stand-in driver) appends its compiled
    kernel to the returned list."""
    from triton.runtime.jit import JITFunction

    compiled: list = []
    warm = JITFunction.run

    def keep(self, *a, **kw):
        compiled.append(warm(self, *a, **kw))
        return compiled[-1]

    JITFunction.run = keep
    return compiled


def compile_row_stats(args, ptxas: str) -> bool:
    """Compile ``row_stats_rows``'s kernel as an H200 would run it (the descriptor walk forced
    on: its test needs a CUDA tensor) for each dtype, unsplit and split (one and four parts per
    program; with a softcap, the hidden-state path, one and two); report registers and
    spills, and check the split kernel's atomic. Returns whether all is well."""
    import torch

    from dgemma_sampler.kernels import row_stats as rs

    compiled = recording_compiles()
    rs._tma_walk = lambda logits, cfg, block, aligned: bool(cfg.get("tma")) and aligned
    rs.interpreting = lambda: False
    ok = True
    n, v = 256, 262144
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for blocks, each, softcap in ((None, None, None), (4, 1, None), (4, 4, None),
                                      (8, 1, 30.0), (8, 2, 30.0)):
            rows = torch.zeros(n, dtype=torch.int32)
            ones, zeros = torch.ones(1), torch.zeros(1, dtype=torch.int64)
            rs.row_stats_rows(torch.empty(n, v, dtype=dtype), rows, rows, ones, zeros, zeros,
                              softcap=softcap, config=dict(part_blocks=blocks, part_group=each))
            kernel = compiled[-1]
            name = (f"{str(dtype).replace('torch.', '')}_"
                    + (f"split_{each}_per_program" if blocks else "whole")
                    + ("_softcap" if softcap else ""))
            with tempfile.TemporaryDirectory() as tmp:
                report, lines = assemble(ptxas, kernel.asm["ptx"], os.path.join(tmp, "k.cubin"))
            n_atomics, predicates, acq_rel = atomic_predicates(kernel.asm["ptx"])
            atomics_ok = (n_atomics == acq_rel == 1 and "" not in predicates
                          if blocks else n_atomics == 0)
            print(f"{name:20s} shared {kernel.metadata.shared} B | " + " | ".join(lines)
                  + f" | atomics {n_atomics} under {len(predicates)} predicate(s)"
                  + ("" if atomics_ok else " UNEXPECTED"))
            ok &= report.returncode == 0 and atomics_ok
    return ok


# Shared memory one block may use on sm_90 (H100 and H200: 227 KiB): a kernel that asks for
# more compiles but does not launch.
SM90_MAX_SHARED = 232448


def compile_head(ptxas: str, configs: str | None = None) -> bool:
    """Compile ``head_gemm.project`` at DiffusionGemma's shape (bf16, TMA and pointer loads) as
    an H100/H200 would run it; report registers, spills and shared memory. ``configs``:
    comma-separated tiles (``HeadConfig.parse``) compiled with TMA instead, each marked by whether
    it would launch (shared memory). Returns whether all compiled (and fit)."""
    import torch

    from dgemma_sampler.kernels import contract
    from dgemma_sampler.kernels import head_gemm as hg

    compiled = recording_compiles()
    contract.sm_count = lambda device: 132
    ok = True
    m, v, h = 8192, 262144, 2816
    hidden, weight = torch.empty(m, h, dtype=torch.bfloat16), torch.empty(v, h, dtype=torch.bfloat16)
    if configs:
        for spec in configs.split(","):
            cfg = hg.HeadConfig.parse(spec)
            hg.project(hidden, weight, hg.empty_logits(m, v, torch.bfloat16, hidden.device),
                       config=cfg, tma=True)
            kernel = compiled[-1]
            with tempfile.TemporaryDirectory() as tmp:
                report, lines = assemble(ptxas, kernel.asm["ptx"], os.path.join(tmp, "k.cubin"))
            fits = kernel.metadata.shared <= SM90_MAX_SHARED
            print(f"{cfg.spec:22s} shared {kernel.metadata.shared} B "
                  f"({'launches' if fits else 'TOO MUCH: does not launch'}) | " + " | ".join(lines))
            ok &= fits and report.returncode == 0
        return ok
    for tma in (True, False):
        hg.project(hidden, weight, hg.empty_logits(m, v, torch.bfloat16, hidden.device), tma=tma)
        kernel = compiled[-1]
        with tempfile.TemporaryDirectory() as tmp:
            report, lines = assemble(ptxas, kernel.asm["ptx"], os.path.join(tmp, "k.cubin"))
        print(f"{'head_tma' if tma else 'head_pointers':20s} shared {kernel.metadata.shared} B | "
              + " | ".join(lines))
        ok &= report.returncode == 0
    # the pass that writes the soft-embedding operand over those logits (softcap, a row order)
    from dgemma_sampler.kernels.soft_embedding_operand import operand_in_place

    logits = torch.empty(m, 4096, dtype=torch.bfloat16)
    rows = torch.zeros(m, dtype=torch.int32)
    operand_in_place(logits, rows, torch.ones(1), torch.zeros(m), row_order=torch.arange(m),
                     kept_count=torch.full((1,), m, dtype=torch.int32), threshold=None,
                     allowed=None, vocab_start=0, v_local=4096, softcap=30.0)
    kernel = compiled[-1]
    with tempfile.TemporaryDirectory() as tmp:
        report, lines = assemble(ptxas, kernel.asm["ptx"], os.path.join(tmp, "k.cubin"))
    print(f"{'operand_in_place':20s} shared {kernel.metadata.shared} B | " + " | ".join(lines))
    return ok and report.returncode == 0


def compile_canvas_update(ptxas: str) -> bool:
    """Compile the canvas-update kernel (``canvas_update.py``) for 32 requests of a 256-wide
    canvas, with and without pins, and the request prologue (``request_prologue.py``); report
    registers, spills and shared memory."""
    import torch

    import dgemma_sampler as ds
    from dgemma_sampler.kernels.canvas_update import canvas_update
    from dgemma_sampler.step import NOISE_STREAMS

    compiled = recording_compiles()
    n, W, vocab = 32, 256, 262144
    state = ds.DiffusionState(n, ds.SamplerConfig(), vocab, 64, "cpu")
    slots = torch.arange(n)
    ok = True
    for pins in (True, False):
        stat = torch.zeros(n, W, dtype=torch.int64)
        canvas_update(state, slots, torch.zeros(n, W), stat, stat, slots, slots,
                      confidence_threshold=0.005, entropy_bound=0.1, vocab_size=vocab,
                      streams=NOISE_STREAMS, pins=pins)
        kernel = compiled[-1]
        with tempfile.TemporaryDirectory() as tmp:
            report, lines = assemble(ptxas, kernel.asm["ptx"], os.path.join(tmp, "k.cubin"))
        print(f"{'canvas_update' + ('_pins' if pins else ''):20s} shared {kernel.metadata.shared} B"
              " | " + " | ".join(lines))
        ok &= report.returncode == 0
    # The step's other small kernel: the per-request prologue before the statistics.
    from dgemma_sampler.kernels.request_prologue import request_prologue

    request_prologue(slots, state.step, state.seeds, state.draws, torch.ones(9))
    kernel = compiled[-1]
    with tempfile.TemporaryDirectory() as tmp:
        report, lines = assemble(ptxas, kernel.asm["ptx"], os.path.join(tmp, "k.cubin"))
    print(f"{'request_prologue':20s} shared {kernel.metadata.shared} B | " + " | ".join(lines))
    return ok and report.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site", help="a site-packages that provides torch and dgemma_sampler, "
                    "appended to the path (this interpreter's own packages, triton first, stay ahead)")
    ap.add_argument("--sass", metavar="DIR", help="also write each specialization's PTX and SASS here")
    ap.add_argument("--loops", action="store_true", help="also print the SASS instruction count "
                    "of each innermost loop that issues a wgmma (the consumer warpgroups' K loops: "
                    "instructions per warp and K step)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16", help="logits dtypes to compile")
    ap.add_argument("--head", action="store_true", help="compile the LM-head projection instead")
    ap.add_argument("--head-configs", metavar="TILES", help="with --head: compile these head tiles "
                    "(BMxBNxBK/gGROUP_M/wWARPS/sSTAGES, comma-separated; tools/head_configs.py "
                    "times them) and say which would launch")
    ap.add_argument("--row-stats", action="store_true", help="compile the row-statistics kernel "
                    "(unsplit and split walk) instead of the GEMM")
    ap.add_argument("--canvas-update", action="store_true",
                    help="compile the canvas-update kernel instead of the GEMM")
    args = ap.parse_args()
    if args.site:
        site.addsitedir(args.site)

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Sm90Driver:
        """Just enough of a driver for the JIT to pick sm_90 and compile."""

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(Sm90Driver())
    run = JITFunction.run
    JITFunction.run = lambda self, *a, grid, warmup, **kw: run(self, *a, grid=grid, warmup=True, **kw)

    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path  # the ptxas this Triton compiles sm_90 with
    print(f"triton {triton.__version__}, {ptxas}")
    if args.row_stats:
        sys.exit(0 if compile_row_stats(args, ptxas) else 1)
    if args.head:
        sys.exit(0 if compile_head(ptxas, args.head_configs) else 1)
    if args.canvas_update:
        sys.exit(0 if compile_canvas_update(ptxas) else 1)

    from dgemma_sampler.kernels import soft_embedding_dispatch as se
    from dgemma_sampler.kernels import soft_embedding_wgmma as wg
    n, v, h = 8192, 4096, 2816  # the real row count and hidden size; any vocabulary compiles alike
    failed = False
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        logits = torch.empty(n, v, dtype=dtype)
        embed = torch.empty(v, h, dtype=torch.bfloat16)
        row_request = torch.zeros(n, dtype=torch.int32)
        inv_t, lse, out = torch.ones(1), torch.zeros(n), torch.empty(n, h)
        # rows by a row order, scheduled by the kept count on the device (as with ``keep``)
        order, count = torch.arange(n), torch.full((1,), n, dtype=torch.int32)
        # (and once planned on the host, as with ``num_kept``)
        variants = [(None, False, False, False, wg.WIDE), (lse, False, False, False, wg.WIDE),
                    (None, True, True, False, wg.WIDE), (None, True, False, False, wg.WIDE)]
        if dtype == embed.dtype:  # the operand written over the logits (soft_embedding_operand)
            variants.append((None, True, True, True, wg.WIDE))
            # and on the tall tile of a call of one canvas, rows by a row order or in order
            variants += [(None, True, True, True, wg.TALL), (None, False, False, True, wg.TALL)]
        for threshold, gather, on_device, given, tile in variants:
            cfg = se.wgmma_config(wg, tile, dtype, embed.dtype)
            plan = (se.plans_by_count(n, h, v, cfg, 132, torch.device("cpu")) if on_device
                    else se.plan_split(n, n, h, v, cfg, 132))
            kernel = wg.launch(logits, row_request, inv_t, lse, embed, None, 1.0, out,
                               row_order=order if gather else None,
                               kept_count=count if gather else None, threshold=threshold,
                               out_index=None, vocab_start=0, plan=plan, scratch=inv_t,
                               placeholder=inv_t, tile=tile, p_given=given)
            name = (str(dtype).replace('torch.', '') + ("_tall" if tile == wg.TALL else "")
                    + ("_threshold" if threshold is not None else "")
                    + ("_row_order" if gather else "") + ("_host_plan" if gather and not on_device
                                                          else "") + ("_p_given" if given else ""))
            with tempfile.TemporaryDirectory() as tmp:
                cubin = os.path.join(tmp, "k.cubin")
                report, lines = assemble(ptxas, kernel.asm["ptx"], cubin)
                print(f"{name:20s} shared {kernel.metadata.shared} B | " + " | ".join(lines))
                failed |= report.returncode != 0
                cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
                if (args.sass or args.loops) and report.returncode == 0 and os.path.exists(cuobjdump):
                    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True,
                                          text=True).stdout
                if args.loops and report.returncode == 0 and os.path.exists(cuobjdump):
                    print(f"{'':20s} wgmma loops: instructions {mma_loop_lengths(sass)}")
                if args.sass and report.returncode == 0 and os.path.exists(cuobjdump):
                    os.makedirs(args.sass, exist_ok=True)
                    for ext, text in (("ptx", kernel.asm["ptx"]), ("sass", sass)):
                        with open(os.path.join(args.sass, f"{name}.{ext}"), "w") as f:
                            f.write(text)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
