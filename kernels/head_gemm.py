"""LM-head projection: ``logits = hidden @ W^T`` in the model dtype, a row's bits independent of its batch.

Math
----
For hidden states ``h`` ``[M, H]`` and the head ``W`` ``[V, H]`` (DiffusionGemma ties it to the
token embedding; under tensor parallelism a rank's vocabulary slice of it), both bf16 or fp16::

    logits[m, v] = round(sum_k h[m, k] * W[v, k])

with an fp32 sum over ``k`` in blocks of ``BLOCK_K``, in increasing order, rounded once to the model
dtype (nearest even): the tensor vLLM's ``lm_head`` produces before ``compute_logits`` upcasts it,
up to the order of the fp32 sum. Softcap, temperature and masks are not applied here: the kernels
that read these logits apply them in registers (``logit_row.softcapped``).

Batch invariance
----------------
A request's logits must not depend on the batch it came in (the dispatcher tiles requests by a
memory budget, and the keyed noise makes every other part of a step batch-independent). A library
GEMM picks its kernel, tile and split of K by the problem size, so the same row can round
differently in another batch. Here the tile and the K step are fixed (128 x 256 x 64 at every M),
every output tile is computed by one program over the whole K range in the same order, and there
is no split-K: an element's value is a function of its row of ``h`` and its row of ``W`` alone.
What ``config_for`` does choose by M (with TMA) changes no bits: the pipeline depth and whether the
output tile leaves in one store or two (``FEW_ROWS_CONFIG``: 4 stages, the store in two slices,
ahead at one request where loading ``W`` sets the pace). ``tools/head_configs.py`` compares any two
configurations' bits, and a GPU test compares a request alone and in a batch.

Cost model (H100, M = 256 x requests, V = 2^18, H = 2816)
--------------------------------------------------------
* FLOPs ``2 M V H``: 12.1 TFLOP at 32 requests, ~16.7 ms at cuBLAS's rate: bound by the tensor
  cores from a few requests up. At one request (0.38 TFLOP) reading ``W`` (1.48 GB, 0.44 ms)
  costs about as much as the MMAs (~0.5 ms).
* Bytes: ``W`` once per group of ``GROUP_M`` M-tiles (tiles are walked in groups of ``GROUP_M``
  M-tiles x every N-tile, M fastest, so the programs sharing a ``W`` tile run together and the
  group's rows of ``h`` stay in L2); the output once, ``M V`` x 2 bytes (4.3 GB at 32 requests,
  ~1.3 ms of HBM time under ~16 ms of MMA).
* Persistent programs, one per SM, walk the tiles; on Hopper both operands come by TMA
  (``USE_TMA``), the output leaves by TMA, and the loop over tiles is flattened into the K loop so
  that the next tile's loads overlap this tile's epilogue.

Shapes TMA cannot address (a row stride that is not a multiple of 16 bytes, the interpreter with
pointers on purpose, GPUs before Hopper) take pointer loads with masks: the same tiles, the same
order, the same bits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import contract
from .logit_row import interpreting


@dataclass(frozen=True)
class HeadConfig:
    """Output tile ``block_m x block_n``, K step ``block_k``, tiles per group along M, launch shape,
    and ``epilogue_split``: the output tile stored in that many column slices (two: half the shared
    memory of the store, room for another stage).

    The tile and the K step are part of what a request's logits are (they fix the order of the
    fp32 sums): one constant, never chosen by the batch. The epilogue's split changes no bits."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    epilogue_split: int = 1

    @property
    def spec(self) -> str:
        """``"BMxBNxBK/gGROUP_M/wWARPS/sSTAGES[/eSPLIT]"``, the form ``parse`` reads (the tools'
        names)."""
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/g{self.group_m}/w{self.num_warps}"
                f"/s{self.num_stages}" + (f"/e{self.epilogue_split}" if self.epilogue_split > 1 else ""))

    @classmethod
    def parse(cls, spec: str) -> HeadConfig:
        """``"128x256x64/g8/w8/s3"`` -> ``HeadConfig(128, 256, 64, 8, 8, 3)``, ``".../s4/e2"`` with
        the epilogue in two slices; ValueError otherwise."""
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+)/g(\d+)/w(\d+)/s(\d+)(?:/e(\d+))?", spec.strip())
        if m is None:
            raise ValueError(f"a tile is BMxBNxBK/gGROUP_M/wWARPS/sSTAGES[/eSPLIT], e.g. "
                             f"128x256x64/g8/w8/s3; got {spec!r}")
        bm, bn, bk, g, w, s = (int(x) for x in m.groups()[:6])
        split = int(m.group(7) or 1)
        for name, value in (("BM", bm), ("BN", bn), ("BK", bk)):
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value} in {spec!r}")
        if g < 1 or w not in (1, 2, 4, 8, 16) or s < 1:
            raise ValueError(f"GROUP_M >= 1, WARPS in 1..16 (a power of two), STAGES >= 1: {spec!r}")
        if split not in (1, 2) or bn // split < 16:
            raise ValueError(f"the epilogue stores BN in 1 or 2 slices of >= 16 columns: {spec!r}")
        return cls(bm, bn, bk, g, w, s, split)


CONFIG = HeadConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
# Up to FEW_ROWS rows (4 requests): the same tile with a deeper pipeline, whose store in two slices
# leaves the shared memory for it. Few rows wait on loading W, where a fourth stage helps; many rows
# are bound by the MMAs, where it costs (figures: docs/performance-history.md).
FEW_ROWS_CONFIG = replace(CONFIG, num_stages=4, epilogue_split=2)
FEW_ROWS = 1024
# The interpreter runs the same code on small tiles (a CPU multiplies every tile in Python).
INTERPRETER_CONFIG = HeadConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4,
                                num_stages=1)
HEAD_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """Tile index -> (M-tile, N-tile): groups of ``GROUP_M`` M-tiles x every N-tile, M fastest
    (the last group holds what is left of the M-tiles)."""
    group_tiles = GROUP_M * n_tiles_n
    first_m = (tile // group_tiles) * GROUP_M
    group_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
    within = tile % group_tiles
    return first_m + within % group_m, within // group_m


@triton.jit
def _rounded(acc, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc`` rounded to ``dtype`` to nearest even. The interpreter's own cast truncates: there the
    rounding is done on the fp32 bits first (then the cast is exact)."""
    if INTERPRET:
        bits = acc.to(tl.uint32, bitcast=True)
        if dtype == tl.bfloat16:
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            acc = bits.to(tl.float32, bitcast=True)
    return acc.to(dtype)


@triton.jit
def _store_tile(out_desc, acc, row0, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """The rounded tile by TMA, whole or in two slices of columns (one store buffer of a slice)."""
    if SPLIT == 1:
        out_desc.store([row0, col0], _rounded(acc, out_desc.dtype, INTERPRET))
    else:
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        out_desc.store([row0, col0], _rounded(left, out_desc.dtype, INTERPRET))
        out_desc.store([row0, col0 + BLOCK_N // 2], _rounded(right, out_desc.dtype, INTERPRET))


@triton.jit
def head_gemm_kernel(
    h_desc, w_desc, out_desc,                 # TMA descriptors (USE_TMA), else placeholders
    h_ptr, w_ptr, out_ptr,                    # the same tensors by pointer (not USE_TMA)
    M, V, H,
    stride_h, stride_w, stride_out,           # row strides in elements (rows are contiguous)
    NUM_PROGRAMS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    USE_TMA: tl.constexpr, FLATTEN: tl.constexpr, INTERPRET: tl.constexpr,
):
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_n = tl.cdiv(V, BLOCK_N)
    k_blocks = tl.cdiv(H, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_tiles_m * n_tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        m_tile, n_tile = _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M)
        row0 = m_tile * BLOCK_M
        col0 = n_tile * BLOCK_N
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # the whole K range, in order, in this program: the bits of an element depend on its
        # row of h and its row of W only
        for kb in range(k_blocks):
            k0 = kb * BLOCK_K
            if USE_TMA:
                a = h_desc.load([row0, k0])
                b = w_desc.load([col0, k0])
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_h + ks[None, :],
                            mask=(rows < M)[:, None] & (ks < H)[None, :], other=0.0)
                b = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :],
                            mask=(cols < V)[:, None] & (ks < H)[None, :], other=0.0)
            if INTERPRET:
                # The interpreter's 16-bit tl.dot is wrong, and its fp32 one is the host BLAS,
                # whose sums can round differently by a row's place in the tile (OpenBLAS's
                # edge kernels): a product summed per entry, in the same order for every row.
                # 16-bit values and their products are exact in fp32.
                prod = a.to(tl.float32)[:, :, None] * tl.trans(b.to(tl.float32))[None, :, :]
                acc += tl.sum(prod, axis=1)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        if USE_TMA:
            _store_tile(out_desc, acc, row0, col0, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, INTERPRET)
        else:
            out = _rounded(acc, out_ptr.dtype.element_ty, INTERPRET)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], out,
                     mask=(rows < M)[:, None] & (cols < V)[None, :])


def config_for(rows: int, tma: bool) -> HeadConfig:
    """The configuration of a projection of ``rows`` rows on a GPU: one tile and K step at every
    size (the bits), a deeper pipeline for few rows where the output leaves by TMA (its split
    store is what frees the shared memory; pointer loads and stores keep ``CONFIG``, which fits
    GPUs before Hopper)."""
    return FEW_ROWS_CONFIG if tma and rows <= FEW_ROWS else CONFIG


def padded_columns(vocab: int, itemsize: int) -> int:
    """Row length of an output buffer of ``vocab`` logits: a multiple of 16 elements (at least
    16 bytes), so that its rows stay TMA-addressable here and in the kernels that read them, and
    the row stride is one Triton specializes as divisible by 16 (the Hopper GEMM's ``cp.async``
    row gather needs that proof to copy 16-byte vectors)."""
    return -(-vocab // 16) * 16


def empty_logits(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised ``[rows, vocab]`` logits buffer whose rows start on 16-byte boundaries (a
    view of a ``[rows, padded_columns]`` allocation; separate so that tests can poison it)."""
    cols = padded_columns(vocab, torch.empty((), dtype=dtype).element_size())
    return torch.empty(rows, cols, dtype=dtype, device=device)[:, :vocab]


def _tma_ok(*tensors: torch.Tensor) -> bool:
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in tensors)


def uses_tma(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether a launch loads and stores by TMA: on Hopper or later (and in the interpreter, which
    emulates it) when every row is 16-byte aligned."""
    if hidden.device.type == "cuda" and contract.cuda_capability(hidden.device)[0] < 9:
        return False
    return _tma_ok(hidden, weight, out)


def project(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
            config: HeadConfig | None = None, tma: bool | None = None) -> torch.Tensor:
    """``hidden [M, H] @ weight[V, H]^T`` as ``[M, V]`` in their dtype (bf16 or fp16), batch-invariant.

    ``out``: a ``[M, V]`` buffer of that dtype with contiguous rows (default: ``empty_logits``,
    rows padded to 16 bytes). ``config`` overrides ``config_for`` (tests; any config is
    batch-invariant, but two tiles or K steps round differently). ``tma`` False forces pointer
    loads (tests); None: TMA where ``uses_tma``. Inputs are validated by the caller and only asserted here.
    """
    assert hidden.dim() == 2 and weight.dim() == 2, (hidden.shape, weight.shape)
    assert hidden.dtype == weight.dtype and hidden.dtype in HEAD_DTYPES, (hidden.dtype, weight.dtype)
    assert hidden.shape[1] == weight.shape[1], (hidden.shape, weight.shape)
    assert hidden.device == weight.device, (hidden.device, weight.device)
    assert hidden.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous"
    m, h = hidden.shape
    v = weight.shape[0]
    if out is None:
        out = empty_logits(m, v, hidden.dtype, hidden.device)
    assert out.shape == (m, v) and out.dtype == hidden.dtype and out.device == hidden.device, \
        (out.shape, out.dtype, out.device)
    assert out.stride(1) == 1, "out rows must be contiguous"
    if m == 0 or v == 0:
        return out
    interpret = interpreting()
    use_tma = uses_tma(hidden, weight, out) if tma is None else tma
    assert not use_tma or _tma_ok(hidden, weight, out), "TMA needs 16-byte aligned rows"
    cfg = config or (INTERPRETER_CONFIG if interpret else config_for(m, use_tma))
    n_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(v, cfg.block_n)
    programs = min(n_tiles, contract.sm_count(hidden.device))  # the interpreter's CPU tensors: 4
    descs = (None, None, None)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = (TensorDescriptor(hidden, [m, h], [hidden.stride(0), 1], [cfg.block_m, cfg.block_k]),
                 TensorDescriptor(weight, [v, h], [weight.stride(0), 1], [cfg.block_n, cfg.block_k]),
                 TensorDescriptor(out, [m, v], [out.stride(0), 1],
                                  [cfg.block_m, cfg.block_n // cfg.epilogue_split]))
    head_gemm_kernel[(programs,)](
        *descs, hidden, weight, out, m, v, h,
        hidden.stride(0), weight.stride(0), out.stride(0), programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EPILOGUE_SPLIT=cfg.epilogue_split,
        USE_TMA=use_tma, FLATTEN=use_tma and not interpret, INTERPRET=interpret,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
