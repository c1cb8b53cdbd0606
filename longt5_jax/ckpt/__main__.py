"""`python -m longt5_jax.ckpt <command>`: inspect, check and convert checkpoints.

Every command takes `--json`; wherever a command takes CKPT, a MODEL_DIR means its latest
complete checkpoint. Exit status: 0 done, 1 `verify` found problems or `done` found steps to go,
2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from longt5_jax import cli
from longt5_jax.ckpt import commands, convert


def _parser() -> argparse.ArgumentParser:
    top = cli.ArgumentParser(prog="python -m longt5_jax.ckpt", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)
    helps = {
        "ls": "steps, sizes, times and state (complete, incomplete, unreadable) of checkpoints",
        "tree": "parameter paths, shapes, dtypes and saved sharding (metadata only)",
        "stats": "per-array norm, min, max and NaN/Inf counts",
        "diff": "per-array max absolute/relative difference; missing and extra paths",
        "config": "the saved gin config",
        "verify": "read every array: complete and finite",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("MODEL_DIR" if name == "ls" else "CKPT")
        if name == "diff":
            p.add_argument("CKPT_B")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    done = "whether a run saved its last step (exit 0) or has steps to go (exit 1)"
    sub.add_parser("done", help=done, description=done).add_argument("MODEL_DIR")
    conv = sub.add_parser("convert", help="hf-to-native, native-to-hf or t5x-to-native")
    conv.add_argument("direction", choices=("hf-to-native", "native-to-hf", "t5x-to-native"))
    conv.add_argument("SRC", help="transformers directory, CKPT or T5X checkpoint_N directory")
    conv.add_argument("OUT", help="a new path: nothing existing is overwritten")
    conv.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="t5x-to-native: LongT5Config fields T5X does not store (e.g. local_radius=127)",
    )
    conv.add_argument(
        "--tokenizer",
        default="",
        metavar="PATH",
        help="a SentencePiece model to write with OUT in place of SRC's own (which SRC may lack)",
    )
    conv.add_argument("--json", action="store_true")
    return top


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        field, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set {pair}: expected FIELD=VALUE")
        for cast in (int, float, str):
            try:
                out[field] = cast(value)
                break
            except ValueError:
                continue
    return out


def _run(args: argparse.Namespace):
    if args.command in ("ls", "done"):
        return getattr(commands, args.command)(args.MODEL_DIR)
    if args.command == "diff":
        return commands.diff(args.CKPT, args.CKPT_B)
    if args.command != "convert":
        return getattr(commands, args.command)(args.CKPT)
    if args.direction == "t5x-to-native":
        out, note = convert.t5x_to_native(
            args.SRC, args.OUT, args.tokenizer, **_overrides(args.set)
        )
    elif args.set:
        raise ValueError(f"--set applies to t5x-to-native, not {args.direction}")
    elif args.direction == "hf-to-native":
        out, note = convert.hf_to_native(args.SRC, args.OUT, args.tokenizer)
    else:
        out, note = convert.native_to_hf(args.SRC, args.OUT, args.tokenizer)
    return {"direction": args.direction, "source": args.SRC, "output": str(out), "note": note}


def _number(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_number(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [columns, *cells]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _text(command: str, result) -> str:
    if command == "ls":
        return _table(result, ["step", "state", "bytes", "time", "path"])
    if command == "tree":
        return _table(result, ["path", "shape", "dtype", "sharding"])
    if command == "stats":
        return _table(result, ["path", "shape", "norm", "min", "max", "nan", "inf"])
    if command == "config":
        return result.get("gin", "")
    if command == "done":
        return f"{result['path']}: saved step {result['saved']} of {result['steps']}"
    if command == "verify":
        head = f"{result['path']}: {result['arrays']} arrays, {result['bytes']:,} bytes"
        problems = "\n".join(f"  {p}" for p in result["problems"])
        return f"{head}: OK" if result["ok"] else f"{head}: PROBLEMS\n{problems}"
    if command == "diff":
        parts = [_table(result["tensors"], ["path", "max_abs", "max_rel"])]
        for key in ("only_in_a", "only_in_b"):
            parts += [f"{key}: {p}" for p in result[key]]
        parts += [
            f"shape differs: {d['path']} {d['a']} vs {d['b']}" for d in result["shapes_differ"]
        ]
        return "\n".join(parts + [f"identical: {result['identical']}"])
    return f"wrote {result['output']}" + (f"\n{result['note']}" if result["note"] else "")


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    result = _run(args)
    print(
        json.dumps(result, indent=1)
        if getattr(args, "json", False)
        else _text(args.command, result)
    )
    return 1 if args.command in ("verify", "done") and not result["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
