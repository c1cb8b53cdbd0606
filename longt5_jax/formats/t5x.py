"""Read and write LongT5 checkpoints in T5X's layout (as the released `.../longt5/*/checkpoint_N`).

A T5X checkpoint directory holds the msgpack file `checkpoint` (flax.serialization) containing
`{"version": 3, "optimizer": {"target": params, "state": optimizer state}}`. Each partitioned
array in it is replaced by the JSON of a tensorstore spec: a gzip zarr array in the directory
named by the array's flattened path (`target.encoder.layers_0.attention.query.kernel`), with
chunks of at most 64 MiB; unpartitioned values (`state/step`) are stored inline. This follows
`Checkpointer.save`, `_read_ts` and `load_t5x_checkpoint` in google-research/t5x
`t5x/checkpoints.py`. Kernels are 2-D there, heads flattened head-major (`h * d_kv + k`).

`load(path, **overrides) -> (LongT5Config, params)` converts only `target`; the optimizer state
under `state` (Adafactor's `v_row`/`v_col`/`v`, the step) is ignored. Shapes give the config;
what T5X does not store (local_radius, global_block_size, relpos max distance, ...) comes from
`overrides`, else LongT5Config's defaults, which are the released models'. `save` writes what
T5X's `InferenceState` holds: `target` and `state = {"step": step}`, no optimizer state.
"""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path
from typing import Any

import flax.serialization
import flax.traverse_util
import ml_dtypes
import numpy as np
import tensorstore as ts

from longt5_jax.formats.atomic import publishing
from longt5_jax.formats.hf import Params, param_shapes, plain
from longt5_jax.model.config import LongT5Config

# Version 3 (T5X since 2021-06): bfloat16 is stored natively, not bit-cast to uint16.
VERSION = 3
_CHUNK_BYTES = 64 * 1024 * 1024  # T5X's largest chunk
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
Row = tuple[str, str, str]
Shape = tuple[int, ...]
# Our tree's shapes come from tracing the model's init; the same config is asked for repeatedly.
_shapes = functools.lru_cache(maxsize=8)(param_shapes)


def _same(*paths: str) -> list[Row]:
    return [(p, p, "") for p in paths]


def _layers(stack: str, names: list[str], kind: str = "") -> list[Row]:
    # Ours stacks layers on a leading axis; T5X (scan_layers=False) has one subtree per layer.
    return [(f"{stack}/layers/{n}", f"{stack}/layers_{{i}}/{n}", kind) for n in names]


def _attention(stack: str, module: str) -> list[Row]:
    qkv = [f"{module}/{p}/kernel" for p in ("query", "key", "value")]
    return _layers(stack, qkv, "qkv") + _layers(stack, [f"{module}/out/kernel"], "out")


def name_table(config: LongT5Config) -> list[Row]:
    """(our path, T5X path, kernel kind); '{i}' in a T5X path is the stacked layer (§7.1)."""
    mlp = [f"mlp/{n}/kernel" for n in ("wi_0", "wi_1", "wo")] + ["pre_mlp_layer_norm/scale"]
    dec_norms = ["pre_self_attention_layer_norm/scale", "pre_cross_attention_layer_norm/scale"]
    table = [
        *_same("token_embedder/embedding", "encoder/relpos_bias/rel_embedding"),
        *_layers("encoder", ["pre_attention_layer_norm/scale", *mlp]),
        *_attention("encoder", "attention"),
        *_same("encoder/encoder_norm/scale", "decoder/relpos_bias/rel_embedding"),
        *_layers("decoder", [*dec_norms, *mlp]),
        *_attention("decoder", "self_attention"),
        *_attention("decoder", "encoder_decoder_attention"),
        *_same("decoder/decoder_norm/scale", "decoder/logits_dense/kernel"),
    ]
    if config.attention == "transient-global":
        # The relpos tables are shared by all layers (stack level); the global-input norm is
        # per layer, flaxformer's unnamed `T5LayerNorm_0` inside the attention module.
        table += _same("encoder/side_relpos_bias/rel_embedding")
        ours, theirs = "global_input_layer_norm", "T5LayerNorm_0"
        table += [
            (
                f"encoder/layers/attention/{ours}/scale",
                f"encoder/layers_{{i}}/attention/{theirs}/scale",
                "",
            )
        ]
    return table


def _t5x_shape(kind: str, shape: Shape) -> Shape:
    """qkv: ours [D, H, K] -> [D, H*K]; out: ours [H, K, D] -> [H*K, D]; row-major = head-major."""
    if kind == "qkv":
        return (shape[0], math.prod(shape[1:]))
    return (math.prod(shape[:-1]), shape[-1]) if kind == "out" else shape


def _expected(config: LongT5Config) -> dict[str, tuple[str, int | None, Shape]]:
    """T5X name -> (our path, layer index or None, T5X shape), layers in order."""
    shapes = _shapes(config)
    out: dict[str, tuple[str, int | None, Shape]] = {}
    for ours, theirs, kind in name_table(config):
        if "{i}" in theirs:
            for i in range(shapes[ours][0]):
                out[theirs.format(i=i)] = (ours, i, _t5x_shape(kind, shapes[ours][1:]))
        else:
            out[theirs] = (ours, None, _t5x_shape(kind, shapes[ours]))
    return out


def _check_tree(expected: dict[str, Shape], got: dict[str, Shape], source: str, what: str) -> None:
    def some(names: set[str]) -> str:
        return f"{sorted(names)[:4]}{' ...' if len(names) > 4 else ''}"

    if missing := expected.keys() - got.keys():
        raise ValueError(f"{source}: {what}: missing {some(missing)}")
    if extra := got.keys() - expected.keys():
        raise ValueError(f"{source}: {what}: unexpected {some(extra)}")
    for name, shape in expected.items():
        if tuple(got[name]) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(got[name])}, expected {shape}")


def to_t5x(config: LongT5Config, params: Params, source: str = "params") -> dict[str, np.ndarray]:
    """Our parameter tree -> T5X `target` arrays (float32), keyed by '/'-joined T5X paths."""
    flat = flax.traverse_util.flatten_dict(plain(params), sep="/")
    what = f"not a {config.attention} LongT5 tree of this config"
    _check_tree(_shapes(config), {p: np.shape(x) for p, x in flat.items()}, source, what)
    out = {}
    for name, (path, i, shape) in _expected(config).items():
        x = np.asarray(flat[path], np.float32)
        out[name] = (x if i is None else x[i]).reshape(shape)
    return out


def from_t5x(config: LongT5Config, arrays: dict[str, np.ndarray]) -> Params:
    """T5X `target` arrays of the right names and shapes -> our tree of float32 numpy arrays."""
    shapes = _shapes(config)
    flat: dict[str, np.ndarray | list[np.ndarray]] = {}  # a stack's layers, until stacked
    for name, (path, i, _) in _expected(config).items():
        x = np.asarray(arrays[name], np.float32)
        if i is None:
            flat[path] = x.reshape(shapes[path])
        else:  # `_expected` lists a stack's layers in order
            layers = flat.setdefault(path, [])
            assert isinstance(layers, list)  # a path is a stack's or not
            layers.append(x.reshape(shapes[path][1:]))
    flat = {p: np.stack(x) if isinstance(x, list) else x for p, x in flat.items()}
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def infer_config(shapes: dict[str, Shape], source: str, **overrides) -> LongT5Config:
    """The LongT5Config whose parameters have `shapes` (T5X names); `overrides` set the rest."""
    emb, rel = "token_embedder/embedding", "encoder/relpos_bias/rel_embedding"
    q, wi = "encoder/layers_0/attention/query/kernel", "encoder/layers_0/mlp/wi_0/kernel"
    if bad := [n for n in (emb, rel, q, wi) if len(shapes.get(n, ())) != 2]:
        raise ValueError(f"{source}: not a LongT5 T5X checkpoint: no 2-D target/{bad[0]}")
    (vocab, d_model), (heads, buckets) = shapes[emb], shapes[rel]
    num_layers = {"encoder": 1, "decoder": 1}  # a stack with none then reports layers_0 missing
    for name in shapes:
        if m := re.match(r"(encoder|decoder)/layers_(\d+)/", name):
            num_layers[m[1]] = max(num_layers[m[1]], int(m[2]) + 1)
    side = "encoder/side_relpos_bias/rel_embedding" in shapes
    inferred = dict(
        vocab_size=vocab,
        d_model=d_model,
        d_ff=shapes[wi][1],
        num_heads=heads,
        d_kv=max(1, shapes[q][1] // heads),  # if H does not divide it, the query shape is wrong
        num_encoder_layers=num_layers["encoder"],
        num_decoder_layers=num_layers["decoder"],
        relpos_buckets=buckets,
        attention="transient-global" if side else "local",
    )
    try:
        config = LongT5Config(**{**inferred, **overrides})
    except TypeError as e:
        raise ValueError(f"{source}: bad LongT5Config override ({e})") from None
    for k, v in inferred.items():
        if getattr(config, k) != v:
            raise ValueError(
                f"{source}: override {k}={overrides[k]!r}, but the checkpoint's is {v!r}"
            )
    return config


# --- files -------------------------------------------------------------------------------------


def _chunks(shape: Shape) -> list[int]:
    """T5X's chunk shape: shrink the longest side to its next divisor until <= 64 MiB.

    T5X counts bytes at the in-memory (float32) item size, also when it writes bfloat16.
    """
    chunk = list(shape)
    while math.prod(chunk) * 4 > _CHUNK_BYTES:
        i = int(np.argmax(chunk))
        chunk[i] = max(d for d in range(1, chunk[i]) if shape[i] % d == 0)
    return chunk


def _spec(name: str, shape: Shape, dtype: str) -> dict[str, Any]:
    """The tensorstore spec T5X puts in the msgpack; its path is relative to the checkpoint."""
    meta = {"compressor": {"id": "gzip"}, "shape": list(shape), "chunks": _chunks(shape)}
    kvstore = {"driver": "file", "path": "target." + name.replace("/", ".")}
    spec = {"driver": "zarr", "dtype": dtype, "kvstore": kvstore, "metadata": meta}
    return ts.Spec(spec).to_json()  # T5X stores the normalised JSON of a ts.Spec


def _local(spec: dict[str, Any], root: Path) -> dict[str, Any]:
    """`spec` opened under `root` on the local file driver, as T5X reads a checkpoint locally.

    A checkpoint written to GCS has a `gcs` kvstore; one from tensorstore < 0.1.14 keeps its
    path at the top level. Chunks and compressor are left to the array's own `.zarray`.
    """
    path = spec.get("kvstore", {}).get("path", spec.get("path"))
    if not isinstance(path, str):
        raise ValueError(f"{root}: not a T5X array spec: {spec}")
    kvstore = {"driver": "file", "path": os.path.join(root, path)}
    return {"driver": spec.get("driver", "zarr"), "kvstore": kvstore}


def _wait(future: Any, spec: dict[str, Any], root: Path) -> Any:
    try:
        return future.result()
    except ValueError as e:  # tensorstore's errors; its message ends with the whole spec
        where = _local(spec, root)["kvstore"]["path"].rstrip("/")
        reason = str(e).split(" [tensorstore_spec=")[0].splitlines()[0]
        raise ValueError(f"{where}: missing or unreadable array ({reason})") from None


def _read_target(root: Path, flat: dict[str, Any]) -> dict[str, np.ndarray]:
    """Arrays for T5X names: inline ones as they are, tensorstore ones read concurrently."""
    specs = {n: leaf for n, leaf in flat.items() if isinstance(leaf, dict)}
    opening = {n: ts.open(_local(s, root), open=True, read=True) for n, s in specs.items()}
    reading = {n: _wait(f, specs[n], root).read() for n, f in opening.items()}
    out = {n: np.asarray(leaf) for n, leaf in flat.items() if n not in specs}
    out |= {n: _wait(f, specs[n], root) for n, f in reading.items()}
    for name, x in out.items():
        # T5X's version-2 checkpoints bit-cast bfloat16 to uint16; T5X refuses those too.
        if x.dtype.name not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"{root}: target/{name} is {x.dtype.name}, expected floats")
    return out


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """'/'-joined paths to leaves; a tensorstore spec dict is a leaf, as in T5X."""
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and not {"driver", "kvstore"} & v.keys():
            flat |= _flatten(v, f"{prefix}{k}/")
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _read_msgpack(path: Path) -> dict[str, Any]:
    """The `target` tree in a checkpoint directory's msgpack file."""
    if not path.exists():
        raise ValueError(f"{path}: does not exist (expected a T5X checkpoint directory)")
    file = path if path.name == "checkpoint" and path.is_file() else path / "checkpoint"
    if not file.is_file():
        steps = sorted(p.name for p in path.glob("checkpoint_*") if p.is_dir())
        hint = f"; pass one of its step directories {steps[:3]}" if steps else ""
        raise ValueError(f"{path}: not a T5X checkpoint (no `checkpoint` msgpack file{hint})")
    try:
        contents = flax.serialization.msgpack_restore(file.read_bytes())
    except (ValueError, TypeError) as e:  # msgpack's own errors subclass ValueError
        raise ValueError(f"{file}: not a readable msgpack file ({e})") from None
    state = contents.get("optimizer") if isinstance(contents, dict) else None
    target = state.get("target") if isinstance(state, dict) else None
    if not isinstance(target, dict):
        raise ValueError(f"{file}: not a T5X checkpoint (no optimizer/target tree in it)")
    if contents.get("version", 0) < 2:  # as T5X: older layouts need its remapping
        raise ValueError(f"{file}: T5X checkpoint version {contents.get('version')}, expected 2+")
    return target


def load(path: str | os.PathLike, **overrides) -> tuple[LongT5Config, Params]:
    """A T5X checkpoint directory -> (config, float32 params); `overrides`: LongT5Config fields."""
    path = Path(path)
    flat = _flatten(_read_msgpack(path))
    path = path.parent if path.is_file() else path  # T5X also accepts the msgpack file itself
    # T5X, too, takes each array's shape from its spec before reading it.
    shapes = {
        n: tuple(
            leaf.get("metadata", {}).get("shape", ()) if isinstance(leaf, dict) else np.shape(leaf)
        )
        for n, leaf in flat.items()
    }
    config = infer_config(shapes, str(path), **overrides)
    expected = {name: shape for name, (_, _, shape) in _expected(config).items()}
    _check_tree(expected, shapes, str(path), f"not a {config.attention} LongT5 of these shapes")
    arrays = _read_target(path, flat)
    _check_tree(expected, {n: x.shape for n, x in arrays.items()}, str(path), "arrays on disk")
    return config, from_t5x(config, arrays)


def save(
    config: LongT5Config,
    params: Params,
    path: str | os.PathLike,
    step: int = 0,
    dtype: str = "float32",
) -> None:
    """Write a T5X checkpoint directory atomically; never over a non-empty path.

    `dtype` is the arrays' on-disk type, as T5X's SaveCheckpointConfig.dtype: "float32" (exact)
    or "bfloat16".
    """
    if dtype not in _DTYPES:
        raise ValueError(f"save dtype {dtype!r}: expected one of {list(_DTYPES)}")
    arrays = to_t5x(config, params)  # checks the tree before anything touches the disk
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{path}: already exists and is not empty; refusing to overwrite it")
    # A hidden sibling: the final rename stays on one file system, and T5X's glob skips it.
    with publishing(path, directory=True) as tmp:
        specs = {name: _spec(name, x.shape, dtype) for name, x in arrays.items()}
        opening = {
            n: ts.open({**_local(s, tmp), "dtype": dtype, "metadata": s["metadata"]}, create=True)
            for n, s in specs.items()
        }
        writing = [opening[n].result().write(x.astype(_DTYPES[dtype])) for n, x in arrays.items()]
        for w in writing:
            w.result()
        target = flax.traverse_util.unflatten_dict(specs, sep="/")
        state = {"step": np.asarray(step, np.int32)}  # inline, as T5X writes unpartitioned values
        contents = {"version": VERSION, "optimizer": {"target": target, "state": state}}
        (tmp / "checkpoint").write_bytes(flax.serialization.msgpack_serialize(contents))
