"""Analytic model FLOPs of LongT5: matmuls only, as the model's code computes them.

A multiply-add counts 2. Training is 3 x the forward pass (the backward computes a gradient for
each matmul input: two matmuls of the forward's size), remat not included: this is *model*
FLOPs, what MFU is measured against. Attention counts what the blocked implementation computes,
padding and masked entries included: a local query block of W = local_radius + 1 tokens scores
3W keys, the length padded up to whole blocks; TGlobal adds L // global_block_size side keys per
query and the side keys' and values' projections. Elementwise work (softmax, norms, GELU) and
the embedding lookup are not matmuls and are left out.
"""

from __future__ import annotations

import dataclasses

from longt5_jax.model.config import LongT5Config


@dataclasses.dataclass(frozen=True)
class Flops:
    """Forward FLOPs of one example, by part."""

    encoder: float
    decoder: float
    lm_head: float
    attention: float  # the score and value matmuls (within encoder and decoder)

    @property
    def forward(self) -> float:
        return self.encoder + self.decoder + self.lm_head

    @property
    def train(self) -> float:
        return 3 * self.forward


def _encoder_layer(c: LongT5Config, length: int) -> tuple[float, float]:
    """(all, attention) forward FLOPs of one encoder layer on one example."""
    hk, w = c.num_heads * c.d_kv, c.block_len
    padded = -(-length // w) * w
    projections = 4 * 2 * length * c.d_model * hk
    # Scores and the weighted sum of values: each padded query against 3W keys.
    attention = 2 * (2 * padded * 3 * w * hk)
    if c.attention == "transient-global":
        g = length // c.global_block_size
        projections += 2 * (2 * g * c.d_model * hk)  # side keys and values
        attention += 2 * (2 * padded * g * hk)
    mlp = 3 * 2 * length * c.d_model * c.d_ff  # gated GELU: wi_0, wi_1, wo
    return projections + attention + mlp, attention


def _decoder_layer(c: LongT5Config, length: int, target_length: int) -> tuple[float, float]:
    """(all, attention) forward FLOPs of one decoder layer on one example."""
    hk, t = c.num_heads * c.d_kv, target_length
    # Self-attention (all four projections) and cross-attention (queries and output from the
    # decoder, keys and values from the encoder's output).
    projections = 4 * 2 * t * c.d_model * hk + 2 * 2 * t * c.d_model * hk
    projections += 2 * 2 * length * c.d_model * hk
    attention = 2 * (2 * t * t * hk) + 2 * (2 * t * length * hk)
    mlp = 3 * 2 * t * c.d_model * c.d_ff
    return projections + attention + mlp, attention


def model_flops(c: LongT5Config, input_length: int, target_length: int) -> Flops:
    """Forward FLOPs of one example of `input_length` inputs and `target_length` targets."""
    enc, enc_attention = _encoder_layer(c, input_length)
    dec, dec_attention = _decoder_layer(c, input_length, target_length)
    return Flops(
        encoder=c.num_encoder_layers * enc,
        decoder=c.num_decoder_layers * dec,
        lm_head=2 * target_length * c.d_model * c.vocab_size,
        attention=c.num_encoder_layers * enc_attention + c.num_decoder_layers * dec_attention,
    )


def train_flops_per_step(
    c: LongT5Config, batch_size: int, input_length: int, target_length: int
) -> float:
    """Model FLOPs of one training step over the global batch."""
    return batch_size * model_flops(c, input_length, target_length).train


def executed_flops_per_step(
    c: LongT5Config, batch_size: int, input_length: int, target_length: int, remat: str
) -> float:
    """Model FLOPs plus what rematerialisation recomputes: 'full' reruns each layer's forward,
    'save_dots' keeps the projections' outputs (dots without batch dimensions) and reruns the
    attention matmuls; with the fused kernels ('pallas') 'save_attention' and 'save_dots' keep
    the attention's outputs too and rerun none of its matmuls; the LM head sits outside the
    remat'ed layers."""
    f = model_flops(c, input_length, target_length)
    fused = c.resolved(True).attention_kernel == "pallas"  # the roofline is a GPU's
    attention = 0.0 if fused else f.attention  # what is rerun of it
    layers = f.encoder + f.decoder
    again = {
        "none": 0.0,
        "full": layers,
        "save_attention": layers - f.attention + attention,
        "save_dots": attention,
    }[remat]
    return batch_size * (f.train + again)
