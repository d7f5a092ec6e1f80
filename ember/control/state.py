"""The control plane's state in SQLite: planes, deployments, the desired placement, events.

Everything the control plane decides is written here before it acts on it, so a restarted
control plane reads back the same planes, the same placement (and so re-adopts the fleets
that run it), and the event history. One connection per State; sqlite3 from the stdlib.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict
from pathlib import Path

from ember.control.placement import Assignment, Deployment, Plane

SCHEMA = """
CREATE TABLE IF NOT EXISTS planes (
    name TEXT PRIMARY KEY, region TEXT NOT NULL, cores INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL, cost_per_hour REAL NOT NULL, spot INTEGER NOT NULL,
    up INTEGER NOT NULL, url TEXT NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS deployments (name TEXT PRIMARY KEY, spec TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS placement (
    deployment TEXT NOT NULL, plane TEXT NOT NULL, role TEXT NOT NULL,
    replicas INTEGER NOT NULL, PRIMARY KEY (deployment, plane, role));
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, kind TEXT NOT NULL,
    message TEXT NOT NULL);
"""


class State:
    def __init__(self, path: str | Path) -> None:
        self.db = sqlite3.connect(str(path), check_same_thread=False)
        # the control plane writes on its event loop: a write-ahead log with no fsync per
        # commit keeps a write well under a millisecond, and loses nothing when the process
        # dies (only an OS crash may lose the last commits, which the planes report again)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    def save_plane(self, plane: Plane, url: str, last_seen: float) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO planes VALUES (?,?,?,?,?,?,?,?,?)",
                            (plane.name, plane.region, plane.cores, plane.memory_mib,
                             plane.cost_per_hour, int(plane.spot), int(plane.up), url,
                             last_seen))

    def planes(self) -> dict[str, tuple[Plane, str, float]]:
        """name -> (plane, its agent's URL, when it was last heard from: time.time())."""
        rows = self.db.execute("SELECT * FROM planes ORDER BY name").fetchall()
        return {r[0]: (Plane(r[0], r[1], r[2], r[3], r[4], bool(r[5]), bool(r[6])), r[7], r[8])
                for r in rows}

    def save_deployments(self, deployments: tuple[Deployment, ...]) -> None:
        """The config's deployments replace the stored ones (the file is the source)."""
        with self.db:
            self.db.execute("DELETE FROM deployments")
            self.db.executemany("INSERT INTO deployments VALUES (?,?)",
                                [(d.name, json.dumps(asdict(d))) for d in deployments])

    def deployments(self) -> tuple[Deployment, ...]:
        rows = self.db.execute("SELECT spec FROM deployments ORDER BY name").fetchall()
        out = []
        for (spec,) in rows:
            fields = json.loads(spec)
            fields["regions"] = tuple(fields["regions"])
            out.append(Deployment(**fields))
        return tuple(out)

    def save_placement(self, assignments: dict[str, Assignment]) -> None:
        rows = [(d, p, "active", n) for d, a in assignments.items() for p, n in a.active.items()]
        rows += [(d, a.standby, "standby", 1) for d, a in assignments.items() if a.standby]
        with self.db:
            self.db.execute("DELETE FROM placement")
            self.db.executemany("INSERT INTO placement VALUES (?,?,?,?)", rows)

    def placement(self) -> dict[str, Assignment]:
        active: dict[str, dict[str, int]] = {}
        standby: dict[str, str] = {}
        for d, p, role, n in self.db.execute("SELECT * FROM placement ORDER BY deployment, "
                                             "plane"):
            if role == "active":
                active.setdefault(d, {})[p] = n
            else:
                standby[d] = p
        return {d: Assignment(active.get(d, {}), standby.get(d))
                for d in sorted(set(active) | set(standby))}

    def event(self, kind: str, message: str, at: float | None = None) -> None:
        with self.db:
            self.db.execute("INSERT INTO events (at, kind, message) VALUES (?,?,?)",
                            (time.time() if at is None else at, kind, message))

    def events(self, limit: int = 50) -> list[dict]:
        """The most recent `limit` events, oldest first."""
        rows = self.db.execute("SELECT at, kind, message FROM events ORDER BY id DESC LIMIT ?",
                               (limit,)).fetchall()
        return [{"at": at, "kind": kind, "message": message} for at, kind, message in
                reversed(rows)]
