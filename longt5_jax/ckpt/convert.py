"""Conversions between our checkpoints, transformers' and T5X's.

A native checkpoint written here is a MODEL_DIR holding one parameters-only step (`state` with
`params` and `step`, and the `config` item), so every tool reads it and a run starts from it
with `CheckpointConfig.init_from`. Outputs are built beside their final path and renamed into
place at the end: a failing conversion leaves nothing, and an existing path is never replaced.
The tokenizer travels too: a native checkpoint's SentencePiece model becomes a transformers
directory's spiece.model and back, or `--tokenizer PATH` gives one to a source without it.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from longt5_jax import cli
from longt5_jax.ckpt.commands import Arrays
from longt5_jax.data.tokenizer import EXTRA_IDS, Tokenizer
from longt5_jax.formats import hf, hf_text, t5x
from longt5_jax.formats.atomic import publishing
from longt5_jax.formats.native import (
    CheckpointError,
    model_config,
    resolve,
    saved_config,
    saved_tokenizer,
)
from longt5_jax.infer.decode import DecodeConfig
from longt5_jax.model.config import LongT5Config


def _fresh(out: str | Path, source: str | Path | None = None, checkpoint: bool = False) -> Path:
    """OUT, absolute, checked to be new and none of what the conversion reads (`source`, a
    native checkpoint where `checkpoint`)."""
    read = [("SRC", source)]
    cli.check_outputs([("OUT", out)], [] if checkpoint else read, read if checkpoint else [])
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: already exists; choose a new output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _into_place(out: Path, write) -> Path:
    """Run `write(tmp_dir)` and rename the result to `out` (absent or empty, checked by _fresh);
    on failure remove it."""
    with publishing(out, directory=True) as tmp:
        write(tmp)
    return out


def gin_lines(config: LongT5Config) -> str:
    return "".join(f"LongT5Config.{k} = {v!r}\n" for k, v in dataclasses.asdict(config).items())


def write_native(
    out: str | Path,
    config: LongT5Config,
    params: Any,
    source: str,
    tokenizer: bytes | None = None,
) -> Path:
    """A parameters-only native checkpoint of `params` at step 0 in the new MODEL_DIR `out`,
    with the SentencePiece model `tokenizer` if given."""
    out = _fresh(out)

    def write(tmp: Path) -> None:
        names = ("state", "config", "tokenizer")
        manager = ocp.CheckpointManager(tmp / "checkpoints", item_names=names)
        state = {"params": params, "step": np.int32(0)}
        item = {"gin": gin_lines(config), "model": dataclasses.asdict(config), "source": source}
        items = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(item)}
        if tokenizer is not None:  # the item a training run saves, for predict to find
            saved = {"sentencepiece_model": base64.b64encode(tokenizer).decode("ascii")}
            items["tokenizer"] = ocp.args.JsonSave(saved)
        manager.save(0, args=ocp.args.Composite(**items))
        manager.wait_until_finished()
        manager.close()

    return _into_place(out, write)


def native_params(step_dir: Path) -> dict:
    """The parameters of a native checkpoint as nested dicts of host float32 arrays."""
    arrays = Arrays(step_dir)
    params: dict = {}
    for name, x in arrays.items([name for name in arrays.names if name.startswith("params/")]):
        *parents, leaf = name.split("/")[1:]
        node = params
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = x.astype(np.float32)
    if not params:
        raise CheckpointError(f"{step_dir}: no parameters in this checkpoint")
    return params


def _read_tokenizer(option: str, saved: bytes | None, where: Path) -> Tokenizer | None:
    """--tokenizer PATH if given, else the source's own SentencePiece model (`saved`, found at
    `where`); None when there is neither."""
    if option:
        return Tokenizer(option)
    return None if saved is None else Tokenizer(where, saved)


def _fits(tokenizer: Tokenizer | None, config: LongT5Config) -> Tokenizer | None:
    """`tokenizer`, refused when its ids (pieces, then sentinels) run past the embedding."""
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{tokenizer.path}: {tokenizer.piece_count} pieces and {EXTRA_IDS} sentinels are "
            f"more ids than the model's vocab_size {config.vocab_size}: not its tokenizer"
        )
    return tokenizer


def _note(tokenizer: Tokenizer | None, source: str | Path) -> str:
    """One line for an output written without a tokenizer, saying how to add one."""
    if tokenizer is not None:
        return ""
    return (
        f"no tokenizer written: {source} holds none; to add one, convert again with "
        "--tokenizer PATH (its SentencePiece model)"
    )


def _bindings(gin_text: str, name: str) -> dict[str, Any]:
    """The values bound to `name`'s fields in a saved gin config, the last binding of each
    ({'input_length': 4096, ...}); a value that is not a plain literal is left out."""
    found = {}
    for field, value in re.findall(rf"^{name}\.(\w+)\s*=\s*(.+?)\s*$", gin_text, re.MULTILINE):
        with contextlib.suppress(ValueError, SyntaxError):
            found[field] = ast.literal_eval(value)
    return found


# DecodeConfig.early_stopping in transformers' terms.
_EARLY_STOPPING = {"heuristic": False, "finished": True, "never": "never"}


def generation_settings(gin_text: str) -> tuple[dict[str, Any], str]:
    """The run's decode settings (DecodeConfig as training bound it; its defaults where a saved
    config has none) in transformers' generation_config names, and a note on what transformers
    cannot express ('' when nothing)."""
    bound = _bindings(gin_text, "DecodeConfig")
    known = {f.name for f in dataclasses.fields(DecodeConfig)}
    decode = DecodeConfig(**{k: v for k, v in bound.items() if k in known})
    length = decode.max_length or _bindings(gin_text, "DataConfig").get("target_length", 0)
    settings: dict[str, Any] = {"num_beams": decode.num_beams, "do_sample": decode.temperature > 0}
    if length:
        settings["max_length"] = length + 1  # transformers counts the decoder start token
    if decode.num_beams > 1:
        settings["length_penalty"] = decode.length_penalty
        settings["early_stopping"] = _EARLY_STOPPING[decode.early_stopping]
    if decode.temperature > 0:
        settings |= {"temperature": decode.temperature, "top_k": decode.top_k}
        settings["top_p"] = decode.top_p
    note = ""
    if decode.num_beams > 1 and decode.length_penalty_style != "transformers":
        note = (
            f"generation_config.json: transformers divides beam scores by len**"
            f"{decode.length_penalty:g}, not by the run's {decode.length_penalty_style} penalty"
        )
    return settings, note


def hf_to_native(src: str | Path, out: str | Path, tokenizer: str = "") -> tuple[Path, str]:
    """(the MODEL_DIR written, a note when it holds no tokenizer)."""
    _fresh(out, src)  # before the work of reading the source
    tok = _read_tokenizer(tokenizer, hf_text.read_spiece(src), Path(src) / hf_text.SPIECE)
    config, params = hf.load(src)
    fitted = _fits(tok, config)
    proto = None if fitted is None else fitted.proto
    out = write_native(out, config, params, f"transformers {Path(src).absolute()}", proto)
    return out, _note(tok, src)


def t5x_to_native(
    src: str | Path, out: str | Path, tokenizer: str = "", **overrides: Any
) -> tuple[Path, str]:
    """(the MODEL_DIR written, a note when it holds no tokenizer: T5X keeps it apart)."""
    _fresh(out, src)
    tok = _read_tokenizer(tokenizer, None, Path(src))
    config, params = t5x.load(src, **overrides)
    fitted = _fits(tok, config)
    proto = None if fitted is None else fitted.proto
    out = write_native(out, config, params, f"t5x {Path(src).absolute()}", proto)
    return out, _note(tok, src)


def native_to_hf(ckpt: str | Path, out: str | Path, tokenizer: str = "") -> tuple[Path, str]:
    """(the transformers directory written, a note when it holds no tokenizer)."""
    step_dir = resolve(ckpt)
    _fresh(out, step_dir, checkpoint=True)
    config = model_config(step_dir)
    hf.name_table(config)  # fails early, before writing, for a tree transformers cannot hold
    saved = saved_tokenizer(step_dir)
    tok = _fits(_read_tokenizer(tokenizer, saved, step_dir / "tokenizer"), config)
    gin = saved_config(step_dir).get("gin", "")
    decoding, decode_note = generation_settings(gin)
    params = native_params(step_dir)

    def write(tmp: Path) -> None:
        hf.save(config, params, tmp)
        hf_text.save_generation_config(config, tmp, decoding)
        if tok is not None:
            max_input = _bindings(gin, "DataConfig").get("input_length", 0)
            hf_text.save_tokenizer(tmp, tok.proto, tok.special_pieces, max_input)

    out = _into_place(_fresh(out), write)
    return out, "\n".join(n for n in (_note(tok, step_dir), decode_note) if n)
