"""The telemetry records (schema ``mpiscale.telemetry/1``): what each topic carries, and a check of it.

Every record is a JSON object with ``schema``, ``job``, ``kind`` and
``time`` (Unix seconds). By kind (the topic is ``mpiscale/<job>/<kind>``):

- ``status`` (retained): ``state`` (``running``, ``finished``, ``stopped``
  (on request, its state saved to go on), ``failed``, or
  ``lost``: the broker's last will for a job whose connection dropped),
  ``command``, ``ranks``, ``host``.
- ``progress``: ``step``, ``total``, ``steps_per_s``, ``eta_s`` (null until
  known), ``items_per_s``.
- ``metrics``: ``ranks_reporting``, ``slowest_rank`` (the rank furthest behind),
  and ``values``: per metric, ``min``, ``mean``, ``max`` over the ranks and the
  rank with the lowest value (``min_rank``); optionally ``nodes``: per host
  (the stalest 64 at most), its ``host``, ``ranks``, ``step`` (its rank furthest
  behind) and ``report_time`` (its stalest rank's last report, Unix seconds).
- ``event``: ``event`` (``started``, ``device`` (where a torch job runs: ``cpu``,
  ``cuda:K``, or each rank's as JSON), ``checkpoint``, ``resumed``,
  ``restarted``, ``failure``, ``finished``, ``hang``, ``straggler``, and the
  answers to control commands: ``acknowledged``, ``rejected``, ``completed``),
  ``rank`` (the rank it is about), ``detail``; answers also carry ``id``, the
  command's (null for a message too malformed to have one).
- ``heartbeat``: ``ranks_reporting``, ``oldest_report_s`` (the age of the
  stalest rank's last report), ``dropped`` (records the publisher had to drop),
  and ``interval_s``, the job's report interval (absent from files of earlier
  versions).
"""

from __future__ import annotations

import time

SCHEMA = "mpiscale.telemetry/1"
KINDS = ("status", "progress", "metrics", "event", "heartbeat")
STATES = ("running", "finished", "stopped", "failed", "lost")
EVENTS = ("started", "device", "checkpoint", "resumed", "restarted", "failure", "finished", "hang", "straggler")
ANSWERS = ("acknowledged", "rejected", "completed")  # to control commands

_NUMBER = (int, float)
_FIELDS: dict[str, dict[str, tuple]] = {
    "status": {"state": (str,), "command": (str,), "ranks": (int,), "host": (str,)},
    "progress": {
        "step": (int,),
        "total": (int,),
        "steps_per_s": _NUMBER,
        "eta_s": (*_NUMBER, type(None)),
        "items_per_s": _NUMBER,
    },  # fmt: skip
    "metrics": {"ranks_reporting": (int,), "slowest_rank": (int,), "values": (dict,)},
    "event": {"event": (str,), "rank": (int,), "detail": (str,)},
    "heartbeat": {"ranks_reporting": (int,), "oldest_report_s": _NUMBER, "dropped": (int,)},
}


def record(kind: str, job: str, **fields: object) -> dict:
    """A record of ``kind`` for ``job``, stamped now."""
    return {"schema": SCHEMA, "job": job, "kind": kind, "time": time.time(), **fields}


def problems(payload: object) -> list[str]:
    """What is wrong with a record (an empty list when it follows the schema)."""
    if not isinstance(payload, dict):
        return [f"a record is a JSON object, got {type(payload).__name__}"]
    found = []
    if payload.get("schema") != SCHEMA:
        found.append(f"schema is {payload.get('schema')!r}, not {SCHEMA!r}")
    kind = payload.get("kind")
    if kind not in _FIELDS:
        return found + [f"kind {kind!r} is none of {', '.join(KINDS)}"]
    for name, types in {"job": (str,), "time": _NUMBER, **_FIELDS[kind]}.items():
        if name not in payload:
            found.append(f"{kind}: {name} is missing")
        elif not isinstance(payload[name], types) or isinstance(payload[name], bool):
            found.append(f"{kind}: {name} is {payload[name]!r}")
    if kind == "status" and payload.get("state") not in STATES:
        found.append(f"status: state {payload.get('state')!r} is none of {', '.join(STATES)}")
    if kind == "event" and payload.get("event") not in EVENTS + ANSWERS:
        found.append(f"event: {payload.get('event')!r} is none of {', '.join(EVENTS + ANSWERS)}")
    if kind == "event" and payload.get("event") in ANSWERS and not isinstance(payload.get("id", 0), (str, type(None))):
        found.append(f"event: an answer's id is {payload.get('id')!r}: a string, or null")
    if kind == "heartbeat" and "interval_s" in payload:
        declared = payload["interval_s"]
        if not isinstance(declared, _NUMBER) or isinstance(declared, bool) or not declared > 0:
            found.append(f"heartbeat: interval_s is {declared!r}")
    if kind == "metrics":
        for name, summary in payload.get("values", {}).items():
            if not isinstance(summary, dict) or set(summary) != {"min", "mean", "max", "min_rank"}:
                found.append(f"metrics: {name} needs min, mean, max and min_rank, got {summary!r}")
        for node in payload.get("nodes", []):
            if not isinstance(node, dict) or set(node) != {"host", "ranks", "step", "report_time"}:
                found.append(f"metrics: a node needs host, ranks, step and report_time, got {node!r}")
    return found
