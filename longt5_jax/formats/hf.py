"""Read and write transformers' LongT5 checkpoints (`config.json` + safetensors or PyTorch bins).

`load(path) -> (LongT5Config, params)` and `save(config, params, path)`. One name table maps our
parameter tree (layers stacked on a leading axis, attention kernels [embed, heads, kv]) to the
`LongT5ForConditionalGeneration` state dict; `to_hf` and `from_hf` are its two directions and
serve weights and gradients alike. transformers 4.x reads what `save` writes; 5.x ties the
LM head to the embedding whatever the config says, which is not LongT5 (see docs/architecture.md).
The tokenizer and generation defaults written beside these files are `hf_text`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import flax.traverse_util
import numpy as np

from longt5_jax.formats.atomic import publishing, write_atomic
from longt5_jax.model.config import LongT5Config
from longt5_jax.model.transformer import LongT5, abstract_params

Params = dict[str, Any]

_ENC_ATTN = {"local": "LocalSelfAttention", "transient-global": "TransientGlobalSelfAttention"}
# Aliases of shared.weight (older exports and other tools write them), and a legacy T5 key
# transformers itself ignores.
_IGNORED = {
    "encoder.embed_tokens.weight",
    "decoder.embed_tokens.weight",
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
}

# How a tensor changes between our layout and PyTorch's nn.Linear [out, in] layout.
# qkv: ours [D, H, K] <-> [H*K, D]; out: ours [H, K, D] <-> [D, H*K]; T: a 2-D transpose.
_TO_HF = {
    "copy": lambda x: x,
    "T": lambda x: x.T,
    "qkv": lambda x: x.reshape(x.shape[0], -1).T,
    "out": lambda x: x.reshape(-1, x.shape[-1]).T,
}


def _from_hf(kind: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return w if kind == "copy" else w.T.reshape(shape)


def _attention(ours: str, hf: str) -> list[tuple[str, str, str]]:
    names = (("query", "q", "qkv"), ("key", "k", "qkv"), ("value", "v", "qkv"), ("out", "o", "out"))
    return [(f"{ours}/{a}/kernel", f"{hf}.{b}.weight", kind) for a, b, kind in names]


def _mlp(ours: str, hf: str) -> list[tuple[str, str, str]]:
    return [
        (f"{ours}/mlp/{n}/kernel", f"{hf}.DenseReluDense.{n}.weight", "T")
        for n in ("wi_0", "wi_1", "wo")
    ] + [(f"{ours}/pre_mlp_layer_norm/scale", f"{hf}.layer_norm.weight", "copy")]


def name_table(config: LongT5Config) -> list[tuple[str, str, str]]:
    """(our path, HF state-dict name, layout change); '{i}' in a name is the stacked layer."""
    enc, dec = "encoder.block.{i}.layer", "decoder.block.{i}.layer"
    enc_attn = f"{enc}.0.{_ENC_ATTN[config.attention]}"
    table = [
        ("token_embedder/embedding", "shared.weight", "copy"),
        (
            "encoder/relpos_bias/rel_embedding",
            enc_attn.format(i=0) + ".relative_attention_bias.weight",
            "T",
        ),
        ("encoder/layers/pre_attention_layer_norm/scale", f"{enc}.0.layer_norm.weight", "copy"),
        *_attention("encoder/layers/attention", enc_attn),
        *_mlp("encoder/layers", f"{enc}.1"),
        ("encoder/encoder_norm/scale", "encoder.final_layer_norm.weight", "copy"),
        (
            "decoder/relpos_bias/rel_embedding",
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            "T",
        ),
        (
            "decoder/layers/pre_self_attention_layer_norm/scale",
            f"{dec}.0.layer_norm.weight",
            "copy",
        ),
        *_attention("decoder/layers/self_attention", f"{dec}.0.SelfAttention"),
        (
            "decoder/layers/pre_cross_attention_layer_norm/scale",
            f"{dec}.1.layer_norm.weight",
            "copy",
        ),
        *_attention("decoder/layers/encoder_decoder_attention", f"{dec}.1.EncDecAttention"),
        *_mlp("decoder/layers", f"{dec}.2"),
        ("decoder/decoder_norm/scale", "decoder.final_layer_norm.weight", "copy"),
        ("decoder/logits_dense/kernel", "lm_head.weight", "T"),
    ]
    if config.attention == "transient-global":
        table += [
            (
                "encoder/side_relpos_bias/rel_embedding",
                enc_attn.format(i=0) + ".global_relative_attention_bias.weight",
                "T",
            ),
            (
                "encoder/layers/attention/global_input_layer_norm/scale",
                f"{enc_attn}.global_input_layer_norm.weight",
                "copy",
            ),
        ]
    return table


def _num_layers(config: LongT5Config, path: str) -> int:
    return config.num_encoder_layers if path.startswith("encoder") else config.num_decoder_layers


def to_hf(config: LongT5Config, params: Params) -> dict[str, np.ndarray]:
    """Our parameter (or gradient) tree -> a transformers LongT5 state dict of numpy arrays."""
    flat = flax.traverse_util.flatten_dict(plain(params), sep="/")
    table = name_table(config)
    missing = [path for path, _, _ in table if path not in flat]
    if missing:
        raise ValueError(f"params are not a {config.attention} LongT5 tree: missing {missing[:3]}")
    out = {}
    for path, name, kind in table:
        x = np.asarray(flat[path])
        if "{i}" in name:
            for i in range(_num_layers(config, path)):
                out[name.format(i=i)] = np.ascontiguousarray(_TO_HF[kind](x[i]))
        else:
            out[name] = np.ascontiguousarray(_TO_HF[kind](x))
    return out


def from_hf(
    config: LongT5Config,
    state: dict[str, np.ndarray],
    source: str = "state dict",
    tied: bool = False,
) -> Params:
    """A transformers LongT5 state dict -> our parameter tree (float32 numpy arrays).

    With `tied` (tie_word_embeddings=true), the LM head is the embedding scaled by d_model**-0.5,
    which is how transformers computes tied logits.
    """
    shapes = param_shapes(config)
    state = dict(state)
    if tied and "lm_head.weight" not in state and "shared.weight" in state:
        state["lm_head.weight"] = np.asarray(state["shared.weight"]) * config.d_model**-0.5
    table = name_table(config)
    expected = {
        n.format(i=i)
        for p, n, _ in table
        for i in range(_num_layers(config, p) if "{i}" in n else 1)
    }
    missing = sorted(expected - state.keys())
    if missing:
        raise ValueError(
            f"{source}: not a {config.attention} LongT5 checkpoint of this shape: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    unexpected = sorted(state.keys() - expected - _IGNORED)
    if unexpected:
        raise ValueError(
            f"{source}: unexpected tensors {unexpected[:5]} for a {config.attention} "
            f"LongT5 with {config.num_encoder_layers}+{config.num_decoder_layers} layers"
        )
    flat = {}
    for path, name, kind in table:
        shape = shapes[path]
        if "{i}" in name:
            layers = [
                _from_hf(kind, _f32(state[name.format(i=i)]), shape[1:]) for i in range(shape[0])
            ]
            flat[path] = np.stack(layers)
        else:
            flat[path] = _from_hf(kind, _f32(state[name]), shape)
        if flat[path].shape != shape:
            raise ValueError(
                f"{source}: {name} has shape {state[name.replace('{i}', '0')].shape}, "
                f"which does not fit {path} {shape}"
            )
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def _f32(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def plain(params: Params) -> Params:
    """The bare parameter tree: unboxed, without a {"params": ...} wrapper."""
    params = nn.unbox(params)
    return params["params"] if set(params) == {"params"} else params


def param_shapes(config: LongT5Config) -> dict[str, tuple[int, ...]]:
    """Our parameter paths ('/'-joined) and shapes for `config`, traced without arrays."""
    flat = flax.traverse_util.flatten_dict(plain(abstract_params(LongT5(config))), sep="/")
    return {k: tuple(v.shape) for k, v in flat.items()}


# --- files -------------------------------------------------------------------------------------


def config_to_hf(config: LongT5Config) -> dict[str, Any]:
    return {
        "architectures": ["LongT5ForConditionalGeneration"],
        "model_type": "longt5",
        "vocab_size": config.vocab_size,
        "d_model": config.d_model,
        "d_kv": config.d_kv,
        "d_ff": config.d_ff,
        "num_layers": config.num_encoder_layers,
        "num_decoder_layers": config.num_decoder_layers,
        "num_heads": config.num_heads,
        "encoder_attention_type": config.attention,
        "local_radius": config.local_radius,
        "global_block_size": config.global_block_size,
        "relative_attention_num_buckets": config.relpos_buckets,
        "relative_attention_max_distance": config.relpos_max_distance,
        "dropout_rate": config.dropout_rate,
        "layer_norm_epsilon": config.layer_norm_eps,
        "feed_forward_proj": "gated-gelu",
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "use_cache": True,
        "tie_word_embeddings": False,
        "pad_token_id": config.pad_id,
        "eos_token_id": config.eos_id,
        "decoder_start_token_id": config.decoder_start_id,
    }


def config_from_hf(hf: dict[str, Any], source: str) -> LongT5Config:
    if hf.get("model_type") != "longt5":
        raise ValueError(f"{source}: model_type is {hf.get('model_type')!r}, expected 'longt5'")
    act = hf.get("feed_forward_proj", "relu")
    if act != "gated-gelu":
        raise ValueError(
            f"{source}: feed_forward_proj is {act!r}; only LongT5.1.1's 'gated-gelu' is supported"
        )
    try:
        return LongT5Config(
            vocab_size=hf["vocab_size"],
            d_model=hf["d_model"],
            d_kv=hf["d_kv"],
            d_ff=hf["d_ff"],
            num_heads=hf["num_heads"],
            num_encoder_layers=hf["num_layers"],
            num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
            attention=hf.get("encoder_attention_type", "local"),
            local_radius=hf.get("local_radius", 127),
            global_block_size=hf.get("global_block_size", 16),
            relpos_buckets=hf.get("relative_attention_num_buckets", 32),
            relpos_max_distance=hf.get("relative_attention_max_distance", 128),
            dropout_rate=hf.get("dropout_rate", 0.1),
            layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6),
            pad_id=hf.get("pad_token_id", 0),
            eos_id=hf.get("eos_token_id", 1),
            decoder_start_id=hf.get("decoder_start_token_id", 0),
        )
    except KeyError as e:
        raise ValueError(f"{source}: missing field {e.args[0]!r}") from None


def _read_state(path: Path) -> dict[str, np.ndarray]:
    """Tensors from model.safetensors, pytorch_model.bin, or their sharded `.index.json` forms."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        index = path / f"{name}.index.json"
        files = (
            [path / name]
            if (path / name).exists()
            else sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
            if index.exists()
            else []
        )
        if files:
            state = {}
            for f in files:
                state.update(_read_file(f))
            return state
    raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin (or .index.json)")


def _read_file(f: Path) -> dict[str, np.ndarray]:
    if not f.exists():
        raise FileNotFoundError(f"{f}: listed in the index but missing")
    if f.suffix == ".safetensors":
        # Only Hugging Face conversion reads safetensors: every other command starts without it.
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(f), framework="numpy") as st:
                return {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
        except SafetensorError as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    try:  # torch (the test extra) only for the older pytorch_model.bin files
        import torch
    except ImportError:
        raise ImportError(
            f"{f}: reading PyTorch .bin files needs torch; convert to safetensors or install torch"
        ) from None
    # weights_only: tensors and plain containers only, never arbitrary pickled objects.
    sd = torch.load(f, map_location="cpu", weights_only=True)
    return {k: v.float().numpy() for k, v in sd.items()}


def load(path: str | os.PathLike) -> tuple[LongT5Config, Params]:
    """A transformers LongT5 directory -> (config, float32 params)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(
            f"{config_file}: missing (expected a transformers LongT5 directory)"
        )
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    config = config_from_hf(hf, str(config_file))
    params = from_hf(
        config, _read_state(path), source=str(path), tied=hf.get("tie_word_embeddings", True)
    )
    return config, params


def save(config: LongT5Config, params: Params, path: str | os.PathLike) -> None:
    """Write config.json and model.safetensors (each atomically) for transformers to load."""
    from safetensors.numpy import save_file  # only conversion writes safetensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # Each tensor once, as transformers' own save_pretrained writes this model: the stacks'
    # embed_tokens are shared.weight. Copies of it would load as three separate tensors (the
    # model twice its size in memory and on disk). transformers 4.x, reading its own save of an
    # untied LongT5 as ours, warns that they are missing, then ties them to shared.weight.
    state = to_hf(config, params)
    with publishing(path / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    write_atomic(path / "config.json", json.dumps(config_to_hf(config), indent=2) + "\n")
