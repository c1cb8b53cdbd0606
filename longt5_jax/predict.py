"""`python -m longt5_jax.predict --checkpoint=CKPT --input=DOCS --output=OUT.jsonl [options]`

Summaries of your documents from a checkpoint (a step directory or a MODEL_DIR). DOCS is a
.jsonl file (one document per line, its text under --input_field, an optional "id") or a .txt
file (the whole file is one document). Documents are decoded --batch_size at a time, grouped by
length (each batch padded only as far as its longest needs). OUT gets {"id", "prediction"} per
document, in input order, written when all are done (a failed run leaves an existing OUT as it was).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from longt5_jax import cli
from longt5_jax.data.batching import trim_with_eos
from longt5_jax.data.sources import DataError
from longt5_jax.data.tokenizer import Tokenizer
from longt5_jax.formats.atomic import write_atomic
from longt5_jax.formats.native import resolve, saved_config
from longt5_jax.infer import batches
from longt5_jax.infer.decode import DecodeConfig
from longt5_jax.infer.generator import from_checkpoint, load_tokenizer_for
from longt5_jax.parallel.devices import cpu_devices
from longt5_jax.parallel.mesh import ParallelConfig


def _parse(argv: list[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="python -m longt5_jax.predict", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="a step directory or a MODEL_DIR")
    p.add_argument("--input", required=True, help="FILE.jsonl or FILE.txt")
    p.add_argument("--output", required=True, type=cli.new_file, help="predictions JSONL")
    p.add_argument("--input_field", default="article", help="the text field of .jsonl records")
    p.add_argument("--input_length", type=int, default=0, help="0: as the checkpoint trained")
    p.add_argument("--max_length", type=cli.positive, default=256, help="summary tokens at most")
    p.add_argument("--batch_size", type=cli.positive, default=8)
    p.add_argument("--num_beams", type=cli.positive, default=1)
    p.add_argument("--length_penalty", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0 samples")
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tensor", type=cli.positive, default=1, help="tensor-parallel ranks; the rest: data"
    )
    p.add_argument("--cpu_devices", type=int, default=0, help="fake CPU devices (no accelerator)")
    p.add_argument("--tokenizer", default="", help="for a checkpoint saved without one")
    args = p.parse_args(argv)
    for name in ("input_length", "cpu_devices", "top_k"):
        if getattr(args, name) < 0:
            p.error(f"--{name}={getattr(args, name)}: expected >= 0")
    return args


def read_documents(path: Path, field: str) -> list[tuple[str, str]]:
    """(id, text) of each document; one-line errors for what cannot be used."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        return _documents(path, field)
    except UnicodeDecodeError as e:  # a binary file, or text in another encoding
        byte = e.object[e.start]
        raise DataError(f"{path}: not UTF-8 text (byte 0x{byte:02x} is not UTF-8)") from None


def _documents(path: Path, field: str) -> list[tuple[str, str]]:
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="strict")
        if not text.strip():
            raise DataError(f"{path}: empty document")
        return [(path.stem, text)]
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: expected a .jsonl or .txt file")
    docs, empty = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[field]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(
                    f"{path}:{number}: expected a JSON object with a text field {field!r} "
                    f"(--input_field) ({type(e).__name__}: {e})"
                ) from None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: field {field!r} is not a string")
            if not text.strip():
                empty.append(number)
            docs.append((str(record.get("id", number)), text))
    if empty:
        lines = ", ".join(map(str, empty[:10])) + (" ..." if len(empty) > 10 else "")
        raise DataError(f"{path}: empty documents on line(s) {lines}: remove them or add text")
    if not docs:
        raise DataError(f"{path}: no documents")
    return docs


def trained_input_length(gin_text: str) -> int | None:
    found = re.findall(r"^DataConfig\.input_length\s*=\s*(\d+)", gin_text, re.MULTILINE)
    return int(found[-1]) if found else None


def _encode(
    docs: list[tuple[str, str]], tokenizer: Tokenizer, length: int, source: str
) -> list[npt.NDArray[Any]]:
    """Each document's ids, EOS-terminated, truncated (with a warning) to `length`."""
    ids = []
    for number, (doc_id, text) in enumerate(docs):
        tokens = tokenizer.encode(text)
        if len(tokens) > length - 1:
            where = f"{source}:{number + 1}" if len(docs) > 1 else source
            print(
                f"warning: {where} (id {doc_id}): {len(tokens):,} tokens, truncated to the first "
                f"{length - 1:,} and EOS (input length {length:,})",
                file=sys.stderr,
            )
        ids.append(trim_with_eos(tokens, length))
    return ids


def predict(args: argparse.Namespace) -> int:
    cpu_devices(args.cpu_devices)
    step_dir = resolve(args.checkpoint)
    cli.check_outputs(
        [("--output", args.output)],
        [("--input", args.input), ("--tokenizer", args.tokenizer or None)],
        [("--checkpoint", step_dir)],
    )
    docs = read_documents(Path(args.input), args.input_field)
    tokenizer = load_tokenizer_for(step_dir, args.tokenizer)
    length = args.input_length or trained_input_length(saved_config(step_dir).get("gin", ""))
    if not length:
        raise ValueError(f"{step_dir}: its config names no input length: pass --input_length")
    fields = ("max_length", "num_beams", "length_penalty", "temperature", "top_k", "top_p", "seed")
    decode = DecodeConfig(**{f: getattr(args, f) for f in fields})
    parallel = ParallelConfig(data=-1, tensor=args.tensor, zero_stage=0)
    generator, config = from_checkpoint(step_dir, parallel, decode, args.max_length)
    data = generator.mesh.shape["data"]
    rows = -(-args.batch_size // data) * data  # whole rows for every data rank

    ids = _encode(docs, tokenizer, length, args.input)
    plan = batches.for_model([len(x) for x in ids], rows, length, config)
    print(plan.summary())

    def generate(batch: npt.NDArray[Any], mask: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return np.asarray(jax.device_get(generator.tokens(batch, mask)))

    with tqdm(total=len(docs), desc="summarising", unit="doc", disable=None) as bar:
        tokens = batches.decode(generate, ids, plan, bar.update)
    out = [tokenizer.decode(t) for t in tokens]
    write_atomic(
        Path(args.output),
        "".join(
            json.dumps({"id": d[0], "prediction": p}) + "\n" for d, p in zip(docs, out, strict=True)
        ),
    )
    print(f"{len(out)} summaries -> {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(lambda argv: predict(_parse(argv)), argv)


if __name__ == "__main__":
    sys.exit(main())
