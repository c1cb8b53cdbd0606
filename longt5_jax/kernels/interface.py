"""What the model calls the fused attention through: the encoder's and the decoder's attention,
and the choice of an implementation per backend and device (the seam, `resolve`).

Today one implementation: Pallas' Triton backend (interpreted on a CPU). `attention_kernel=
"auto"` on a GPU that suits the kernels takes them where this jax has that backend and a kernel
lowers for a GPU; otherwise XLA's attention, with one warning line. Where a Mosaic GPU
implementation plugs in is said in the package map (`longt5_jax.kernels`)."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

from longt5_jax.errors import first_line
from longt5_jax.kernels import backend, placement
from longt5_jax.kernels.backend import runs_on, suits
from longt5_jax.kernels.call import SAVED
from longt5_jax.kernels.decoder import attention as decoder_attention
from longt5_jax.kernels.encoder import encoder_attention
from longt5_jax.kernels.encoder_geometry import Side
from longt5_jax.kernels.softmax import NEG

__all__ = [
    "NEG",
    "SAVED",
    "Side",
    "decoder_attention",
    "encoder_attention",
    "fused",
    "resolve",
    "runs_on",
    "suits",
    "unusable",
]


def resolve(config, compute_capability: str):
    """`config` with `attention_kernel="auto"` made concrete for a GPU of this compute
    capability ("" for none): the kernels where they `suits` its dtype and this jax can build
    them (`unusable`), else XLA's attention."""
    kernels = suits(compute_capability, config.dtype)
    if kernels and config.attention_kernel == "auto":
        kernels = not unusable()
    return config.resolved(kernels)


def fused(config) -> bool:
    """Whether attention runs the kernels: `attention_kernel="auto"` that nothing made concrete
    for the devices compiled for (the train step and the generator do, for their mesh) is
    made so for the default device."""
    found = str(getattr(jax.devices()[0], "compute_capability", ""))
    return resolve(config, found).attention_kernel == "pallas"


def probe(q):
    """A small kernel call, forward and backward, as the seam lowers it for a GPU: the
    decoder's attention of q over itself."""
    mask = jnp.ones((1, q.shape[1], q.shape[1]), bool)
    return jax.grad(lambda q: decoder_attention(q, q, q, mask).astype(jnp.float32).sum())(q)


@functools.cache
def unusable(check=probe) -> str:
    """Why this jax cannot build the kernels for a GPU ('' where it can): the Triton backend
    missing, or `check` failing to lower for CUDA. Said once, as one warning line on stderr."""
    why = ""
    if backend.plgpu is None:
        why = f"jax {jax.__version__} has no Pallas Triton backend"
    else:
        q = jax.ShapeDtypeStruct((1, 16, 1, 16), jnp.bfloat16)
        try:  # as one device's call, whatever placement the caller is tracing under
            with placement.placement(None):
                jax.jit(check).trace(q).lower(lowering_platforms=("cuda",))
        except Exception as e:  # any lowering error: the kernels cannot run on this jax
            first = first_line(e)
            why = f"a kernel does not lower for a GPU on jax {jax.__version__} ({first})"
    if why:
        print(f"warning: attention_kernel auto: {why}; XLA's attention instead",
              file=sys.stderr, flush=True)  # fmt: skip
    return why
