"""The LongT5 architecture as one frozen dataclass, with the published sizes as presets."""

from __future__ import annotations

import dataclasses
from typing import Literal, cast

import jax.numpy as jnp

Attention = Literal["local", "transient-global"]

# (d_model, d_ff, num_heads, d_kv, encoder layers, decoder layers), from the LongT5 gin files.
_SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "small": (512, 1024, 6, 64, 8, 8),
    "base": (768, 2048, 12, 64, 12, 12),
    "large": (1024, 2816, 16, 64, 24, 24),
    "xl": (2048, 5120, 32, 64, 24, 24),
    "xxl": (4096, 10240, 64, 64, 24, 24),
}

REMAT_POLICIES = ("none", "full", "save_dots", "save_attention")
ATTENTION_KERNELS = ("xla", "pallas", "auto")
CAST_PARAMS = ("once", "at_use")
_ATTENTION_ALIASES = {
    "local": "local",
    "transient-global": "transient-global",
    "tglobal": "transient-global",
}


@dataclasses.dataclass(frozen=True)
class LongT5Config:
    """LongT5: T5.1.1 with local or transient-global encoder attention; defaults: base TGlobal."""

    vocab_size: int = 32128
    d_model: int = 768
    d_ff: int = 2048
    num_heads: int = 12
    d_kv: int = 64
    num_encoder_layers: int = 12
    num_decoder_layers: int = 12
    attention: Attention = "transient-global"
    local_radius: int = 127
    global_block_size: int = 16
    relpos_buckets: int = 32
    relpos_max_distance: int = 128
    dropout_rate: float = 0.0
    layer_norm_eps: float = 1e-6
    # Parameters are always float32; this is the dtype of activations and matmul inputs.
    dtype: str = "float32"
    # Rematerialisation of each layer in the backward pass: "none"; "full" (only the layer's
    # input kept); "save_attention" (full, but the fused attention kernels' outputs and
    # log-sum-exps kept, so no kernel's forward runs twice: the same as full on the XLA path);
    # "save_dots" (the matmuls' outputs kept, the kernels' too).
    remat: str = "none"
    # The layer stacks as one scan each (a short compile), or unrolled: no scan buffers for a GPU
    # step to zero-fill and copy saved activations, each layer's parameters and their gradients
    # through; parameters keep their [layers, ...] layout either way.
    scan_layers: bool = True
    # Where a layer stack's float32 parameters become `dtype`: "once" a step, before its layers
    # (the forward, the recomputation and the backward read one cast copy, and the backward
    # stacks the layers' gradients in `dtype`; the copy lives from the forward to the backward),
    # or "at_use", in each layer as it reads them (no copy held). Which needs less memory is the
    # layout's: "at_use" where whole parameters sit beside sharded gradients (data parallelism
    # with ZeRO-2, `configs/parallel/dp32_zero2.gin`), "once" elsewhere. Equal to float rounding.
    cast_params: str = "once"
    # Attention: "xla" (the reference, score tensors in memory), "pallas" (fused kernels for
    # the encoder's and the decoder's attention, `longt5_jax.kernels`:
    # Triton on a GPU, interpreted on a CPU; attention dropout inside them) or "auto" (the
    # kernels on a GPU that runs them, XLA's attention elsewhere: `resolved`). Cached decoding
    # (one query a step) runs the XLA path.
    attention_kernel: str = "xla"
    pad_id: int = 0
    eos_id: int = 1
    decoder_start_id: int = 0

    def __post_init__(self):
        attention = _ATTENTION_ALIASES.get(self.attention)
        if attention is None:
            raise ValueError(
                f"LongT5Config.attention={self.attention!r}: expected 'local' or 'transient-global'"
            )
        object.__setattr__(self, "attention", attention)
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"LongT5Config.remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"LongT5Config.attention_kernel={self.attention_kernel!r}: expected one of "
                f"{ATTENTION_KERNELS}"
            )
        if self.cast_params not in CAST_PARAMS:
            raise ValueError(
                f"LongT5Config.cast_params={self.cast_params!r}: expected one of {CAST_PARAMS}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"LongT5Config.dtype={self.dtype!r}: expected 'float32', 'bfloat16' or 'float16'"
            )
        for name in (
            "vocab_size",
            "d_model",
            "d_ff",
            "num_heads",
            "d_kv",
            "num_encoder_layers",
            "num_decoder_layers",
            "local_radius",
            "global_block_size",
            "relpos_buckets",
            "relpos_max_distance",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"LongT5Config.{name}={getattr(self, name)}: expected >= 1")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"LongT5Config.dropout_rate={self.dropout_rate}: expected in [0, 1)")

    @property
    def block_len(self) -> int:
        """Local attention block: a query attends up to local_radius tokens on each side."""
        return self.local_radius + 1

    def resolved(self, kernels_suit: bool) -> LongT5Config:
        """This config with `attention_kernel="auto"` made concrete: the fused kernels where they
        suit (`kernels_suit`: a CUDA GPU from Ampere on, float32 from Hopper on,
        `kernels.backend.suits`), faster there in every case measured; XLA's attention elsewhere."""
        if self.attention_kernel != "auto":
            return self
        return dataclasses.replace(self, attention_kernel="pallas" if kernels_suit else "xla")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def name(self) -> str:
        """'base-tglobal' where the sizes are a preset's (as configs/models/ names them), else
        the sizes, e.g. 'd64-2+2layers-tglobal'."""
        kind = "tglobal" if self.attention == "transient-global" else "local"
        sizes = ("d_model", "d_ff", "num_heads", "d_kv", "num_encoder_layers", "num_decoder_layers")
        for preset in ("tiny", *_SIZES):
            if all(getattr(self.preset(preset), f) == getattr(self, f) for f in sizes):
                return f"{preset}-{kind}"
        return f"d{self.d_model}-{self.num_encoder_layers}+{self.num_decoder_layers}layers-{kind}"

    @classmethod
    def preset(cls, name: str, attention: str = "transient-global", **overrides) -> LongT5Config:
        """A published size ('small' .. 'xxl') or 'tiny' (a few thousand parameters, for tests)."""
        if name == "tiny":
            fields = dict(
                vocab_size=256,
                d_model=32,
                d_ff=64,
                num_heads=4,
                d_kv=8,
                num_encoder_layers=2,
                num_decoder_layers=2,
                local_radius=3,
                global_block_size=4,
                relpos_buckets=8,
                relpos_max_distance=16,
            )
        elif name in _SIZES:
            d, f, h, k, le, ld = _SIZES[name]
            fields = dict(
                d_model=d, d_ff=f, num_heads=h, d_kv=k, num_encoder_layers=le, num_decoder_layers=ld
            )
        else:
            raise ValueError(
                f"unknown LongT5 preset {name!r}: expected 'tiny' or one of {list(_SIZES)}"
            )
        # `attention` may be an alias ("tglobal"): __post_init__ names it or refuses it.
        return cls(attention=cast(Attention, attention), **{**fields, **overrides})
