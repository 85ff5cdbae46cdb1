"""Tile geometry of the forward kernels: rows, keys and threads per block and shared memory of
the tensor-core kernel (mma.sync, or wgmma at the head dims of ``WG_HEAD_DIMS``) and of the
CUDA-core kernel. Which path a call takes on a device is the runtime's choice
(launch/attention.py).
"""
from __future__ import annotations

__all__ = ["MMA_BLOCK_M", "MMA_THREADS", "WG_THREADS", "WG_HEAD_DIMS", "wgmma_row_bytes",
           "wgmma_smem_bytes", "mma_block_n", "mma_m_tiles", "mma_threads",
           "mma_block_m", "mma_q_in_smem", "mma_swizzled", "fma_block_n", "fma_lanes_per_row",
           "fma_rows_per_lane", "fma_threads", "fma_block_m"]

MMA_BLOCK_M = 64
MMA_THREADS = 128
WG_THREADS = 256      # the wgmma path: two warpgroups
WG_HEAD_DIMS = (64, 96, 128, 256)


def wgmma_row_bytes(head_dim: int) -> int:
    """Bytes per row of a wgmma-path tile: head_dim 16-bit values in 64-column blocks of 128
    bytes (primitives/wgmma.py), the last block only partly used at head_dim 96."""
    return -(-head_dim // 64) * 128


def wgmma_smem_bytes(head_dim: int, block_n: int) -> int:
    """Dynamic shared memory of the wgmma path: Q (128 rows), K and V (block_n rows) tiles of
    ``wgmma_row_bytes(head_dim)`` per row, the key tile's 4 interval bounds (int32, used by
    interval masks), plus 1 KB to align the tiles to 1024 bytes."""
    return ((16 * (WG_THREADS // 32) + 2 * block_n) * wgmma_row_bytes(head_dim) + 16 * block_n
            + 1024)


def mma_block_n(head_dim: int, wgmma: bool = False) -> int:
    """Keys per K/V tile of the tensor-core kernel.

    K, V (and the Q tile for head_dim >= 128) must fit 48 KB of static shared memory: at
    head_dim 256 the 32 KB Q tile leaves room for 16-key K and V tiles only. The wgmma path
    (dynamic shared memory) takes 128-key tiles, 64 at head_dim 256: there the output
    accumulator alone holds 128 registers per thread, and the score and probability fragments of
    128 keys (96 more) would spill.
    """
    if wgmma:
        return 64 if head_dim > 128 else 128
    if head_dim > 128:
        return 16
    if mma_m_tiles(head_dim) > 1 and head_dim * mma_block_m(head_dim) * 2 > 16384:
        return 32          # a 32 KB Q tile leaves 16 KB for K and V
    return 64


def mma_m_tiles(head_dim: int, wgmma: bool = False) -> int:
    """16-row m-tiles per warp of the tensor-core kernel (block of 4 warps: 64 * m_tiles rows).

    Two m-tiles let every K/V fragment a warp loads from shared memory feed twice the HMMAs
    (shared-memory bandwidth per HMMA is what limits one m-tile; docs/perf-notes.md). Up to
    head_dim 128 two m-tiles are spill-free; at 256 the Q tile alone would take 64 KB.
    """
    if wgmma:
        return 1
    return 2 if head_dim <= 128 else 1

def mma_threads(wgmma: bool = False) -> int:
    """Threads per block of the tensor-core kernel: 4 warps, or two warpgroups with wgmma."""
    return WG_THREADS if wgmma else MMA_THREADS


def mma_block_m(head_dim: int, wgmma: bool = False) -> int:
    """Query rows per block of the tensor-core kernel (16 per warp and m-tile)."""
    return 16 * (mma_threads(wgmma) // 32) * mma_m_tiles(head_dim, wgmma)


def mma_q_in_smem(head_dim: int) -> bool:
    """Whether the tensor-core kernel keeps Q in shared memory (else in registers).

    Q fragments in registers cost head_dim / 4 registers per thread; from head_dim 128 on they
    push the kernel past the 255-register cap (spills), so Q stays in shared memory and its A
    fragments are re-read with ldmatrix at every k-step.
    """
    return head_dim >= 128


def mma_swizzled(head_dim: int) -> bool:
    """Whether shared-memory rows are XOR-swizzled (rows of a multiple of 8 16-byte chunks)
    instead of padded by 16 bytes; both keep the 8 row addresses of an ldmatrix on distinct
    banks, the swizzle without the padding's extra bytes."""
    return (head_dim // 8) % 8 == 0


def fma_block_n(head_dim: int, itemsize: int) -> int:
    """Keys per K/V tile of the FMA kernel: the largest power of two from 8 to 32 with the K
    and V tiles within 32 KB and, with the probability tile (block_m x (block_n + 16 bytes)),
    within 44 KB of static shared memory (so 8 for float64 at head_dim 256)."""
    bm = fma_block_m(head_dim, itemsize)
    n = 32
    while n > 8 and (2 * n * head_dim * itemsize > 32768
                     or (2 * n * head_dim + bm * (n + 16 // itemsize)) * itemsize > 45056):
        n //= 2
    return n


# (lanes per row, rows per lane) of the FMA kernel by (itemsize, head_dim): chosen offline from
# registers (no spills) and the FMA share of the hot loops (docs/perf-notes.md).
_FMA_LAYOUT = {
    4: {32: (2, 2), 64: (4, 2), 96: (4, 2), 128: (8, 2), 256: (8, 1)},
    8: {32: (4, 2), 64: (8, 2), 96: (8, 2), 128: (8, 2), 256: (8, 1)},
}


def _fma_layout(head_dim: int, itemsize: int):
    if itemsize not in _FMA_LAYOUT:
        raise ValueError(f"itemsize must be 4 (float32) or 8 (float64), got {itemsize}")
    if head_dim not in _FMA_LAYOUT[itemsize]:
        raise ValueError(f"head_dim must be one of {tuple(_FMA_LAYOUT[itemsize])}, got {head_dim}")
    return _FMA_LAYOUT[itemsize][head_dim]


def fma_lanes_per_row(head_dim: int, itemsize: int) -> int:
    """Lanes sharing one query row in the FMA kernel (2 to 8): each keeps head_dim / lanes
    elements of q and of the accumulator per row in registers."""
    return _fma_layout(head_dim, itemsize)[0]


def fma_rows_per_lane(head_dim: int, itemsize: int) -> int:
    """Query rows each lane of the FMA kernel works on (1 or 2): every K / V chunk it loads
    from shared memory feeds that many rows."""
    return _fma_layout(head_dim, itemsize)[1]


def fma_threads(head_dim: int, itemsize: int) -> int:
    """Threads per block of the FMA kernel: 128 with 1 or 2 lanes per row, else 256."""
    return 128 if fma_lanes_per_row(head_dim, itemsize) <= 2 else 256


def fma_block_m(head_dim: int, itemsize: int) -> int:
    """Query rows per block of the FMA kernel: threads / lanes per row * rows per lane."""
    return (fma_threads(head_dim, itemsize) // fma_lanes_per_row(head_dim, itemsize)
            * fma_rows_per_lane(head_dim, itemsize))

