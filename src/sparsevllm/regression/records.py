"""Append-only JSONL stores that make a long run resumable: the regression harness's samples and the
report's speed cells. A run killed mid-write leaves its last line cut short; reading skips such a
line and appending first ends it, so no later record is glued onto it and lost too."""
import json
import os


def read_records(path: str, key: str) -> dict[str, dict]:
    """Every whole record of the file by its `key` field, the last one of a key winning."""
    records = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:   # a line cut short by an interruption
                    continue
                records[r[key]] = r
    return records


def append_records(path: str, records: list[dict]) -> None:
    broken_tail = False
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            broken_tail = f.read(1) != b"\n"
    with open(path, "a", encoding="utf-8") as f:
        if broken_tail:
            f.write("\n")
        for r in records:
            f.write(json.dumps(r) + "\n")
