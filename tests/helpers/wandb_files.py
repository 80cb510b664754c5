"""Read W&B's offline run files (`wandb/offline-run-*/run-<id>.wandb`) without a W&B server.

The format is LevelDB's log format behind a 7-byte header (":W&B", a magic number, a version):
32 KiB blocks of records, each with a 7-byte header (CRC32, length, type: full, first, middle,
last) and a protobuf `Record` from `wandb.proto.wandb_internal_pb2` as payload. wandb 0.31 ships
no Python reader for it, so the tests parse it here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK_SIZE = 32 * 1024
HEADER_SIZE = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pieces = HEADER_SIZE, []
    while position + HEADER_SIZE <= len(data):
        left = BLOCK_SIZE - position % BLOCK_SIZE
        if left < HEADER_SIZE:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER_SIZE])
        if kind == 0 and length == 0:
            position += left
            continue
        chunk = data[position + HEADER_SIZE : position + HEADER_SIZE + length]
        position += HEADER_SIZE + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pieces = [chunk]
        elif kind == MIDDLE:
            pieces.append(chunk)
        elif kind == LAST:
            yield b"".join([*pieces, chunk])


def wandb_history(directory: Path) -> tuple[list[str], dict[str, list[tuple[int, float]]]]:
    """(the run id in each offline run file that has one, oldest first; {metric: [(step, value)]} as
    `wandb sync` of all of them into one run shows it).

    Synced in order into one run, a history row whose step is at or below the run's last step is
    dropped (W&B: "Steps must be monotonically increasing"); the rows are read that way here.
    """
    from wandb.proto import wandb_internal_pb2

    run_ids: list[str] = []
    history: dict[str, list[tuple[int, float]]] = {}
    last_step = -1
    for path in sorted(directory.glob("offline-run-*/run-*.wandb")):
        for raw in records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_ids.append(record.run.run_id)
            elif kind == "history" and record.history.step.num > last_step:
                last_step = record.history.step.num
                for item in record.history.item:
                    name = item.key or "/".join(item.nested_key)
                    if not name.startswith("_"):
                        history.setdefault(name, []).append((last_step, json.loads(item.value_json)))
    return run_ids, history
