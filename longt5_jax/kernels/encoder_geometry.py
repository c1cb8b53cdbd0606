"""The static geometry of one call of the fused encoder attention (`encoder`): block and tile
sizes, how a launch splits a program's work, the FLOPs each kernel declares; and TGlobal's side
keys as the kernels take them. Letter key as `model.long_attention`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from longt5_jax.kernels import call, launch


class Side(NamedTuple):
    """TGlobal's side keys and what masks and biases them."""

    k_BGHK: jax.Array
    v_BGHK: jax.Array
    bias_HD: jax.Array  # [H, 2G] float32 side bias by distance g - block_id + G - 1
    # [B, L] int32, the global block of each token (-1: none); None once the call has padded
    # it apart (`encoder.Extras.gq`) and in the gradient
    block_ids: jax.Array | None
    global_segment_ids: jax.Array | None  # [B, G] int32; None in the gradient


class Inputs(NamedTuple):
    """The attention's own inputs, padded to whole blocks: q, k, v [B, L, H, K], the segment ids
    [B, L] and the local bias [H, W, 3W]."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    seg: jax.Array | None  # None in the gradient: segment ids have none
    bias: jax.Array


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shapes of one call."""

    batch: int
    heads: int
    head_dim: int
    w: int  # block length W
    n: int  # blocks N
    g: int  # side keys G (0: Local, or inputs shorter than a global block)
    side_chunk: int  # side keys a tile, C
    u: int  # one-hot rows for the side bias gradient
    key_chunk: int  # keys a tile of a local key block (W / key_chunk tiles a block)
    side_padded: int  # side keys padded to whole chunks of the call's widest C (0: none)
    rate: float = 0.0  # attention dropout (0: none; else the kernels take `Drop`'s arrays)
    split: int = 1  # programs a query block of the forward and dq (`splits`), query_rows each
    looped: bool = False  # the forward's and dq's local keys in a loop (`local_keys`)

    @property
    def parts(self) -> int:
        """Parts of key_chunk keys a local key block is taken in."""
        return self.w // self.key_chunk

    @property
    def query_rows(self) -> int:
        """Query rows a program of the forward and dq holds."""
        return self.w // self.split

    @property
    def local_chunks(self) -> list[tuple[int, int]]:
        """(key block c of 0-2, part of it) of a query block's local keys, kb at a time."""
        return [(c, part) for c in range(3) for part in range(self.parts)]

    def beyond(self, c: int, part: int) -> tuple[int, ...]:
        """The parts of a query block (of `split`) whose every query is beyond the radius (W - 1)
        of every key of part `part` of key block n - 1 + c: their scores are all NEG, so they
        skip that chunk (at W = 128 and split 2, one chunk in six)."""
        keys = (
            part * self.key_chunk,
            (part + 1) * self.key_chunk - 1,
        )  # first and last, within the block

        def nearest(s):  # the least |query - key| over part s of the queries and those keys
            rows = (s * self.query_rows, (s + 1) * self.query_rows - 1)
            if c == 0:
                return self.w + rows[0] - keys[1]
            return self.w + keys[0] - rows[1] if c == 2 else 0

        return tuple(s for s in range(self.split) if nearest(s) > self.w - 1)

    @property
    def bias_blocks(self) -> int:
        """Query blocks R whose local bias gradient one program sums: the largest of 8, 4, 2
        dividing N that leaves DBIAS_PROGRAMS programs (H N / R) to fill the GPU, so the
        [H, N / R, W, 3W] float32 partial sums XLA then adds up are R times smaller (at base
        16k, 302 MB a layer written and read back with R = 1)."""
        n, h = self.n, self.heads
        return next((r for r in (8, 4, 2) if n % r == 0 and h * n // r >= DBIAS_PROGRAMS), 1)

    def flops(self, local_matmuls: int, side_matmuls: int) -> int:
        """Tensor-core FLOPs of a kernel doing these [qw, K] x [K, keys] matmuls per part of a
        query block (the local keys it does not skip, `beyond`)."""
        local = sum(self.split - len(self.beyond(*chunk)) for chunk in self.local_chunks)
        per_block = (
            2 * self.query_rows * self.head_dim * self.key_chunk * local * local_matmuls
            + 2 * self.w * self.head_dim * self.side_padded * side_matmuls
        )
        return self.batch * self.heads * self.n * per_block

    def kernel(self, part: str) -> str:
        """The name of this geometry's kernel `part` (fwd, dq, dkv, dbias, dside): Local's
        (no side keys) apart from TGlobal's, as their launch settings differ (`launch.LAUNCH`)
        and a profile tells them apart."""
        return f"encoder_{'' if self.g else 'local_'}attention_{part}"

    def splits(self, name: str) -> Geometry:
        """This geometry for kernel `name`, its query blocks split as its launch settings say
        (`launch.split_of`) where a part is a whole tile: the local key parts' size, at
        least 16 rows. Why: a program of W = 128 rows and 8 warps holds an H100's registers
        alone; two of 64 rows and 4 warps fit one SM together and wait on nothing of each
        other's, and each skips the local keys beyond all its queries (`beyond`). Measured on
        an H100 (`launch.LAUNCH`): Local's gain (three an SM), TGlobal's did not (two an
        SM, taking 64 side keys at a time). A split program takes side keys 32 at a time:
        TGlobal's dq then fits three an SM (158 registers, against 174 with 64; its forward
        178, two an SM; ptxas, sm_90a, base 16k). Not yet timed. Where the launch gives the keys
        a tile (`launch.keys_of`), they are capped so (tiles of 16 keys or more: fewer
        registers a thread, more programs an SM, more instructions a key) and the local keys
        are taken in a loop (`local_keys`)."""
        split = launch.split_of(name)
        if split == 1 or self.w % split or self.w // split != self.key_chunk or self.key_chunk < 16:
            geo = dataclasses.replace(self, split=1)
        else:
            geo = dataclasses.replace(self, split=split, side_chunk=min(self.side_chunk, 32))
        keys = launch.keys_of(name)
        kb = keys if 16 <= keys < geo.key_chunk and self.w % keys == 0 else geo.key_chunk
        # Any power of two below C divides the padded side keys (whole chunks of C).
        c = keys if 16 <= keys < geo.side_chunk and keys & (keys - 1) == 0 else geo.side_chunk
        return dataclasses.replace(geo, key_chunk=kb, side_chunk=c, looped=bool(keys))


def geometry(q_BLHK: jax.Array, w: int, g: int, global_block: int, rate: float = 0.0) -> Geometry:
    b, length, h, k = q_BLHK.shape
    c = min(64, max(16, call.pow2(g))) if g else 16
    # The global blocks a window of W tokens meets: each has >= global_block tokens, so at most
    # ceil((W - 1) / global_block) + 1 of them, plus row 0 for tokens in none.
    u = max(16, call.pow2(2 + -(-(w - 1) // global_block)))
    # A local key block is taken half at a time where a half is a whole tile (16 keys or more):
    # the score tiles are [W, W / 2] as the side keys' are [W, C], which halves what each thread
    # holds (at W = 128 with [W, W] tiles every kernel used all 255 registers and spilled;
    # ptxas, sm_90a).
    kb = w // 2 if w % 2 == 0 and w >= 32 else w
    return Geometry(
        batch=b, heads=h, head_dim=k, w=w, n=-(-length // w), g=g, side_chunk=c, u=u,
        key_chunk=kb, side_padded=-(-g // c) * c, rate=rate,
    )  # fmt: skip


DBIAS_PROGRAMS = 256
