"""Finding a job's processes from outside: the launcher's descendants, named by role.

Children are named ``worker 3``, ``server 0`` ... (``/proc/PID/comm``, set by
``cluster.child.prepare_child``); forked children cannot be found by their environment,
which /proc shows as the launcher's."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["descendants", "role_processes", "alive"]


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def descendants(root: int) -> list[int]:
    """Live descendants of ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def role_processes(root: int) -> dict[str, int]:
    """{"worker 0": pid, ...}: the role processes among ``root``'s descendants."""
    out = {}
    for pid in descendants(root):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        role = name.split(" ")[0]
        if role in ("worker", "server", "aggregator", "coordinator") and name.split(" ")[-1].isdigit():
            out[name] = pid
    return out
