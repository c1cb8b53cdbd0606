"""A doctor's rows: one check each, ok / warn / fail, a fail with its one-line fix."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

Status = Literal["ok", "warn", "fail"]


@dataclasses.dataclass(frozen=True)
class Row:
    group: str  # software, devices, config, kernels, storage, environment, processes
    check: str
    status: Status
    detail: str
    fix: str = ""  # what to do, for a warn or a fail

    def __post_init__(self):
        if self.status == "fail" and not self.fix:
            raise ValueError(f"doctor row {self.check!r}: a fail needs its fix")


def ok(group: str, check: str, detail: str) -> Row:
    return Row(group, check, "ok", detail)


def warn(group: str, check: str, detail: str, fix: str = "") -> Row:
    return Row(group, check, "warn", detail, fix)


def fail(group: str, check: str, detail: str, fix: str) -> Row:
    return Row(group, check, "fail", detail, fix)


def failed(rows: list[Row]) -> bool:
    return any(r.status == "fail" for r in rows)


def table(rows: list[Row]) -> str:
    """The rows as a table, a fix under its row."""
    width = max([len(f"{r.group}/{r.check}") for r in rows] + [5])
    lines = [f"{'check':<{width}}  status  detail"]
    for r in rows:
        lines.append(f"{f'{r.group}/{r.check}':<{width}}  {r.status:<6}  {r.detail}")
        if r.fix:
            lines.append(f"{'':<{width}}          fix: {r.fix}")
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "warn", "fail")}
    verdict = "this run will not work here" if counts["fail"] else "nothing stops this run here"
    lines.append(f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail: {verdict}")
    return "\n".join(lines)


def to_json(rows: list[Row]) -> str:
    return json.dumps(
        {"ok": not failed(rows), "rows": [dataclasses.asdict(r) for r in rows]}, indent=1
    )


def from_dicts(found: list[dict]) -> list[Row]:
    return [Row(**r) for r in found]
