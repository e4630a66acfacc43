"""Program -> output tile of the soft-embedding GEMMs (``soft_embedding.py`` and its Hopper twin
``soft_embedding_wgmma.py``), the device side of ``soft_embedding.plan_split``'s schedule.

With ``T`` output tiles, ``dp_head`` of them (whole waves) run one program each; the next
``tail_tiles`` are cut along the vocabulary into ``split`` pieces, one program each, so that the
last wave is full; the tiles of rows past the planned ones (only zeros to store) come last.
A launch sized for every kept count (``soft_embedding.plans_by_count``) has programs past its
count's plan: they map to tiles past the last row and do nothing.
Both kernels map their program id through ``tile_of_program``; the Gluon kernel then reorders
its whole tiles with ``grouped_tile``.
"""

import triton
import triton.language as tl


@triton.jit
def tile_of_program(pid, n_tiles_n, dp_head, tail_tiles, split):
    """Program id -> (M-tile, N-tile, index among the tail tiles, split piece, pieces of the tile).

    Programs [0, dp_head) take tiles [0, dp_head) whole; the next tail_tiles * split programs are
    the pieces of tiles [dp_head, dp_head + tail_tiles), piece-major so that the programs running
    together share a vocabulary range; the rest take the remaining tiles whole.
    """
    tail_pieces = tail_tiles * split
    q = pid - dp_head
    in_tail = (q >= 0) & (q < tail_pieces)
    safe_tail = tl.maximum(tail_tiles, 1)
    tile = tl.where(in_tail, dp_head + q % safe_tail, tl.where(q < 0, pid, pid - tail_pieces + tail_tiles))
    piece = tl.where(in_tail, q // safe_tail, 0)
    pieces = tl.where(in_tail, split, 1)
    return tile // n_tiles_n, tile % n_tiles_n, tile - dp_head, piece, pieces


@triton.jit
def grouped_tile(m_tile, n_tile, dp_head, n_tiles_n, GROUP: tl.constexpr):
    """A whole tile of ``tile_of_program`` -> the tile its program takes instead: in each group
    of ``GROUP`` M-tiles x all N-tiles (tiles below ``dp_head`` only), the M-tile fastest, so
    that the ``GROUP`` programs sharing an E tile are consecutive. A group that does not fit
    whole below ``dp_head``, and the tail, keep their tiles. (The Gluon kernel's order: which
    programs run side by side changes what the L2 serves them; see ``soft_embedding_wgmma``.)"""
    tile = m_tile * n_tiles_n + n_tile  # the program id for a whole tile; >= dp_head in the tail
    group_tiles = GROUP * n_tiles_n
    group = tile // group_tiles
    within = tile % group_tiles
    regroup = (tile < dp_head) & ((group + 1) * group_tiles <= dp_head)
    return (tl.where(regroup, group * GROUP + within % GROUP, m_tile),
            tl.where(regroup, within // GROUP, n_tile))
