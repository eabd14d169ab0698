"""Validate local dataset files (parquet or JSON lines) before a long job reads them.

A bad row fails here, in seconds, with the file, row index, column and fix named, instead of
deep inside a MaxText input pipeline on a billed TPU VM.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from mtpipe.errors import ConfigError

ROLES = ("system", "user", "assistant")
_GSM8K_ANSWER = re.compile(r"####\s*-?[\d,]*\.?\d+\s*$")
_BATCH_ROWS = 4096

# A row check returns None when the value is fine, else what is wrong with it.
RowCheck = Callable[[object], "str | None"]


def check_chat_rows(files: Iterable[Path | str], column: str = "messages") -> int:
    """Check that every row of ``column`` is a chat: [{role, content}, ...] with an assistant turn.

    Returns the number of rows checked.
    """
    fix = (
        f"make every {column!r} value a non-empty list of {{role: system|user|assistant, content: str}} "
        "with at least one assistant turn (the UltraChat schema), or drop the row"
    )
    return sum(_check_file(Path(f), {column: (_chat_problem, fix)}) for f in _require(files))


def check_gsm8k_rows(files: Iterable[Path | str]) -> int:
    """Check GSM8K rows: a ``question`` string and an ``answer`` string ending in ``#### <number>``.

    Returns the number of rows checked.
    """
    checks = {
        "question": (_text_problem, "give every row a non-empty question string"),
        "answer": (_answer_problem, "end every answer with '#### <number>', as openai/gsm8k does"),
    }
    return sum(_check_file(Path(f), checks) for f in _require(files))


def dataset_files(cfg: Any, dataset_dir: Path, key: str) -> list[Path]:
    """The downloaded files (under ``dataset_dir/files``) that the dataset's ``key`` glob matches
    (``train_files`` or ``eval_files``); none is a ConfigError naming the key and the fix."""
    pattern = getattr(cfg.dataset, key) or ""
    files = sorted((dataset_dir / "files").glob(pattern))
    if not files:
        raise ConfigError(f"dataset.{key}", f"no downloaded file matches {pattern!r}",
                          f"fix conf/dataset/{cfg.dataset.name}.yaml ({key} or allow_patterns)")
    return files


def split_overlap(train_files: Iterable[Path | str], eval_files: Iterable[Path | str], column: str) -> dict[str, int]:
    """How many held-out rows also occur in the training files, compared by ``column`` (a chat's
    whole conversation, a GSM8K question), exactly: {eval_rows, eval_rows_in_train}."""
    train = {_item_key(v) for f in _require(train_files) for b in _batches(Path(f), [column])
             for v in b.column(column).to_pylist()}
    held_out = [_item_key(v) for f in _require(eval_files) for b in _batches(Path(f), [column])
                for v in b.column(column).to_pylist()]
    return {"eval_rows": len(held_out), "eval_rows_in_train": sum(key in train for key in held_out)}


def _item_key(value: object) -> bytes:
    """A row's value as a digest that is equal exactly when the values are (a conversation's turns in
    order): 32 bytes a row, where UltraChat's 200k conversations as text would hold hundreds of MB."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).digest()


def _require(files: Iterable[Path | str]) -> list[Path | str]:
    files = list(files)
    if not files:
        raise ConfigError("files", "no dataset file given", "check the dataset's allow_patterns or splits")
    return files


def _check_file(path: Path, checks: dict[str, tuple[RowCheck, str]]) -> int:
    """Run each column's check over every row; raise a ConfigError at the first bad row."""
    rows = 0
    for batch in _batches(path, list(checks)):
        values = {name: batch.column(name).to_pylist() for name in checks}
        for offset in range(batch.num_rows):
            for name, (check, fix) in checks.items():
                if problem := check(values[name][offset]):
                    raise ConfigError(f"{path} row {rows + offset} column {name!r}", problem, fix)
        rows += batch.num_rows
    return rows


def _batches(path: Path, columns: list[str]) -> Iterator[pa.RecordBatch]:
    if not path.is_file():
        raise ConfigError(str(path), "dataset file does not exist", "rerun the hf_download stage")
    if path.suffix == ".parquet":
        parquet = pq.ParquetFile(path)
        _require_columns(path, columns, parquet.schema_arrow.names)
        yield from parquet.iter_batches(batch_size=_BATCH_ROWS, columns=columns)
    elif path.suffix in (".json", ".jsonl"):
        table = pajson.read_json(path)
        _require_columns(path, columns, table.column_names)
        yield from table.select(columns).to_batches(max_chunksize=_BATCH_ROWS)
    else:
        raise ConfigError(str(path), f"unsupported file type {path.suffix!r}", "use .parquet or .jsonl files")


def _require_columns(path: Path, wanted: list[str], present: list[str]) -> None:
    missing = [c for c in wanted if c not in present]
    if missing:
        raise ConfigError(
            f"{path} column {missing[0]!r}",
            f"the file has no such column (it has {present})",
            "point the column setting at one of those columns, or fetch the dataset whose schema matches",
        )


def _chat_problem(value: object) -> str | None:
    if not isinstance(value, list) or not value:
        return f"expected a non-empty list of turns, got {_short(value)}"
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            return f"turn {i} is {_short(turn)}, not a {{role, content}} mapping"
        if turn.get("role") not in ROLES:
            return f"turn {i} has role {_short(turn.get('role'))}, expected one of {list(ROLES)}"
        if not isinstance(turn.get("content"), str):
            return f"turn {i} has content {_short(turn.get('content'))}, expected a string"
    if not any(turn["role"] == "assistant" for turn in value):
        return "no assistant turn, so there is nothing to train on"
    return None


def _text_problem(value: object) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return f"expected a non-empty string, got {_short(value)}"
    return None


def _answer_problem(value: object) -> str | None:
    if problem := _text_problem(value):
        return problem
    if not _GSM8K_ANSWER.search(value):  # type: ignore[arg-type]
        return f"the answer does not end with '#### <number>': ...{value[-40:]!r}"  # type: ignore[index]
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
