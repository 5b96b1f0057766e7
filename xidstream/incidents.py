"""`xidstream incidents` and `xidstream incident ID`: the operator's view, read from the contract
topics as any consumer would (gpu.alerts, gpu.remediation, gpu.remediation.results).

    xidstream incidents                           # open incidents, held commands, the breaker
    xidstream incidents --verdict GPU_WEDGED --node gpu-node-7 --since 2d --json
    xidstream incidents --watch                   # refreshed in place every 5 s
    xidstream incident 3f9c0b...                  # one incident's whole timeline
    xidstream replay --json scenarios/motivating-incident.yaml | xidstream incidents --stdin

How it answers in seconds on a large fleet: a bounded read. Each topic is read from the first
offset stamped at or after `--since` (Kafka's time index: `offsets_for_times`) up to the end offsets
it had when the read began, and stops there; no consumer group, nothing committed. An incident with
no alert, command or result within `--since` is not shown (the default, 7 days, is longer than any
incident the policy keeps open without a new alert: a held or failing step raises one). Records are
read as plain JSON (the fields shown), not validated into models: this is a viewer; the processor
and the exporters validate. `bench/incidents_bench.py` measures it on a month of a 10,000-GPU fleet.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import IO, Any

import orjson

from xidstream.schemas.base import format_ts, plain_text
from xidstream.schemas.errors import ConfigError
from xidstream.streams.repair import REPAIR_ACTIONS, answer_milestones, durations, reached
from xidstream.cliargs import add_kafka_args
from xidstream.settings import Settings

__all__ = ["IncidentBook", "parse_since", "register"]

_KIND = {"xidstream.alert": "alert", "xidstream.remediation_command": "command",
         "xidstream.remediation_result": "result"}
TOPICS = ("gpu.alerts", "gpu.remediation", "gpu.remediation.results")
NODE_ACTIONS = {"CORDON_NODE", "DRAIN_NODE", "REBOOT_NODE", "REPLACE_NODE"}


def parse_since(text: str) -> float:
    """'90m', '24h', '7d', '30s' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text or "")
    if not m:
        raise ConfigError(f"--since {text!r}: expected a duration such as 30m, 24h or 7d")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


_MAX_TS = 253402300799.0  # 9999-12-31T23:59:59Z: what a datetime can show


def _ts(value: Any) -> float:
    """Seconds since the epoch of a record's time; 0 for anything that is not one (a record is
    read as published: a node can write any value)."""
    if isinstance(value, bool):
        return 0.0
    if isinstance(value, (int, float)):
        t = float(value)
    else:
        try:
            t = datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError):
            return 0.0
    return t if math.isfinite(t) and 0 <= t <= _MAX_TS else 0.0


def _iso(t: float | None) -> str:
    if not t:
        return "-"
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _iso_exact(t: float) -> str:
    """A step's time as the records write theirs (schemas.base.format_ts): a reset's steps are
    seconds apart, and the timeline sorts with the other records' times."""
    return format_ts(datetime.fromtimestamp(t, timezone.utc))


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


@dataclass
class Incident:
    id: str
    alerts: list[dict] = field(default_factory=list)
    commands: list[dict] = field(default_factory=list)

    @property
    def last(self) -> dict:
        return self.alerts[-1]

    @property
    def opened(self) -> float:
        return min(_ts(a.get("ts")) for a in self.alerts) if self.alerts else 0.0

    @property
    def is_open(self) -> bool:
        # Once resolved, an incident stays resolved (a new fault opens a new incident): an alert
        # about a closing step that failed afterwards is news about it, not a reopening.
        return bool(self.alerts) and not any(a.get("state") == "resolved" for a in self.alerts)

    @property
    def gpu_index(self) -> Any:
        for a in reversed(self.alerts):
            ev = a.get("evidence")
            idx = ev.get("gpu_index") if isinstance(ev, dict) else None
            if idx is not None:
                return idx
        return next((c.get("gpu_index") for c in self.commands if c.get("gpu_index") is not None), None)


_ALERT_FIELDS = ("ts", "node", "incident_id", "gpu_uuid", "classification", "severity", "state", "summary", "rule")
_COMMAND_FIELDS = ("ts", "node", "incident_id", "command_id", "gpu_index", "action", "step", "requires_approval",
                   "expires_at", "preconditions")


class IncidentBook:
    """Alerts, commands and results folded by incident; results matched to their command.

    `detail=False` (the fleet summary) keeps only the fields it shows of each record: a month of
    a 10,000-GPU fleet is 60,000 alerts with their evidence (bench/incidents_bench.py)."""

    def __init__(self, detail: bool = True) -> None:
        self.detail = detail
        self.incidents: dict[str, Incident] = {}
        self.samples: dict[str, list[dict]] = {}  # gpu_uuid -> gpu.samples records (--stdin with telemetry)
        self.results: dict[str, list[dict]] = {}  # command_id -> its results, as read
        self.counts = {"alert": 0, "command": 0, "result": 0, "other": 0}
        self.newest = 0.0

    def add(self, value: dict) -> None:
        schema = str(value.get("schema") or "").split("/", 1)[0]
        if schema == "xidstream.gpu_sample" and self.detail and value.get("gpu_uuid"):
            # `replay --json --telemetry`: the samples an incident's report charts
            self.samples.setdefault(str(value["gpu_uuid"]), []).append(value)
            return
        kind = _KIND.get(schema)
        if kind is None or not value.get("incident_id"):
            self.counts["other"] += 1
            return
        self.counts[kind] += 1
        self.newest = max(self.newest, _ts(value.get("ts")))
        if kind == "result":
            cid = str(value.get("command_id"))
            if not self.detail:
                value = {k: value.get(k) for k in ("outcome", "node", "action", "ts")}
            self.results.setdefault(cid, []).append(value)
            return
        if not self.detail:
            if kind == "alert":
                ev = value.get("evidence")
                gpu_index = ev.get("gpu_index") if isinstance(ev, dict) else None
                value = {k: value.get(k) for k in _ALERT_FIELDS}
                value["evidence"] = {"gpu_index": gpu_index}
            else:
                value = {k: value.get(k) for k in _COMMAND_FIELDS}
        inc = self.incidents.setdefault(str(value["incident_id"]), Incident(str(value["incident_id"])))
        (inc.alerts if kind == "alert" else inc.commands).append(value)

    def add_raw(self, raw: bytes | None, *, unwrap: bool = False) -> None:
        """One record's JSON; `unwrap`: a `xidstream replay --json` line ({"topic", "key",
        "value"}) is taken for its value, a bare record as it is."""
        try:
            value = orjson.loads(raw or b"")
        except orjson.JSONDecodeError:
            value = None
        if unwrap and isinstance(value, dict) and "value" in value:
            value = value["value"]
        if isinstance(value, dict):
            self.add(value)
        else:
            self.counts["other"] += 1

    # -- views --------------------------------------------------------------------------------
    def open_incidents(self, *, node: str | None = None, verdict: str | None = None) -> list[Incident]:
        out = [i for i in self.incidents.values() if i.is_open and i.last.get("classification") != "FLEET_STORM"
               and (node is None or i.last.get("node") == node)
               and (verdict is None or i.last.get("classification") == verdict)]
        return sorted(out, key=lambda i: (i.opened, i.id))

    def last_command(self, inc: Incident) -> tuple[dict | None, str]:
        """(the newest command, its outcome or 'held'/'pending')"""
        if not inc.commands:
            return None, ""
        cmd = max(inc.commands, key=lambda c: (_ts(c.get("ts")), c.get("step") or 0))
        return cmd, self.outcome(cmd)

    def result_for(self, cmd: dict) -> dict | None:
        """The newest result that answers `cmd`: same node and action. Records are read as
        published, so a result naming another node or action than its command's is not its answer
        (the processor, with per-node identity on, also checks who sent it; this viewer does not)."""
        answers = [r for r in self.results.get(str(cmd.get("command_id")), [])
                   if r.get("node") == cmd.get("node") and r.get("action") == cmd.get("action")]
        return max(answers, key=lambda r: _ts(r.get("ts"))) if answers else None

    def outcome(self, cmd: dict) -> str:
        r = self.result_for(cmd)
        if r is not None:
            return str(r.get("outcome"))
        return "held for approval" if cmd.get("requires_approval") else "no result yet"

    def held(self, now: float, *, node: str | None = None) -> list[dict]:
        """Commands held for an approval, unanswered and not expired at `now`."""
        out = [c for i in self.incidents.values() for c in i.commands
               if c.get("requires_approval") and self.result_for(c) is None
               and _ts(c.get("expires_at")) > now and (node is None or c.get("node") == node)]
        return sorted(out, key=lambda c: _ts(c.get("ts")))

    def breaker(self) -> dict:
        storms = [i for i in self.incidents.values() if i.alerts and i.last.get("classification") == "FLEET_STORM"]
        if not storms:
            return {"state": "closed", "since": None, "summary": "no FLEET_STORM alert read"}
        newest = max(storms, key=lambda i: _ts(i.last.get("ts")))
        tripped = newest.is_open
        return {"state": "tripped" if tripped else "closed", "since": _iso(_ts(newest.last.get("ts"))),
                "summary": newest.last.get("summary", ""), "incident_id": newest.id}

    def find(self, prefix: str) -> Incident:
        if prefix in self.incidents:
            return self.incidents[prefix]
        found = [i for k, i in self.incidents.items() if k.startswith(prefix)]
        if len(found) == 1:
            return found[0]
        if not found:
            raise ConfigError(f"no incident {prefix!r} in what was read (alerts {self.counts['alert']:,}, "
                              f"commands {self.counts['command']:,}); a longer --since may reach it")
        raise ConfigError(f"{prefix!r} names {len(found)} incidents: {', '.join(sorted(i.id for i in found)[:5])}")

    # -- output -------------------------------------------------------------------------------
    def summary_json(self, now: float, *, node: str | None = None, verdict: str | None = None) -> dict:
        rows = []
        for inc in self.open_incidents(node=node, verdict=verdict):
            cmd, outcome = self.last_command(inc)
            rows.append({"incident_id": inc.id, "node": inc.last.get("node"), "gpu_index": inc.gpu_index,
                         "gpu_uuid": inc.last.get("gpu_uuid"), "classification": inc.last.get("classification"),
                         "severity": inc.last.get("severity"), "rule": (rule_of(inc.last) or {}).get("id"),
                         "opened": _iso(inc.opened),
                         "age_s": round(now - inc.opened, 1), "summary": inc.last.get("summary"),
                         "last_command": None if cmd is None else {"action": cmd.get("action"),
                                                                   "command_id": cmd.get("command_id"),
                                                                   "outcome": outcome}})
        held = [{"command_id": c.get("command_id"), "incident_id": c.get("incident_id"), "node": c.get("node"),
                 "action": c.get("action"), "since": c.get("ts"), "expires_at": c.get("expires_at"),
                 "approve": approve_line(c)} for c in self.held(now, node=node)]
        return {"as_of": _iso(now), "open": rows, "held": held, "breaker": self.breaker(), "read": dict(self.counts)}

    def render_summary(self, now: float, *, node: str | None = None, verdict: str | None = None,
                       since: str = "") -> str:
        data = self.summary_json(now, node=node, verdict=verdict)
        rows = data["open"]
        lines = [f"OPEN INCIDENTS: {len(rows)}   (as of {data['as_of']}; read {self.counts['alert']:,} alerts, "
                 f"{self.counts['command']:,} commands, {self.counts['result']:,} results{' since ' + since if since else ''})"]
        if rows:
            table = [("NODE", "GPU", "UUID", "VERDICT", "SEVERITY", "AGE", "LAST COMMAND", "INCIDENT", "RULE")]
            for r in rows:
                last = r["last_command"]
                table.append((_clean(r["node"], 100), "-" if r["gpu_index"] is None else _clean(r["gpu_index"], 10),
                              _short(r["gpu_uuid"]), _clean(r["classification"], 40), _clean(r["severity"], 20),
                              _age(r["age_s"]), "-" if last is None else _clean(f"{last['action']} {last['outcome']}", 60),
                              _clean(r["incident_id"], 12), _clean(r["rule"] or "-", 96)))
            lines += _columns(table)
        else:
            lines.append("  none")
        lines.append("")
        lines.append(f"HELD FOR APPROVAL: {len(data['held'])}")
        for h in data["held"]:
            lines.append(_clean(f"  {h['action']} on {h['node']} (incident {str(h['incident_id'])[:12]}, held since "
                                f"{h['since']}, expires {h['expires_at']})"))
            # A field with a character a terminal cannot show as it is (a newline, an escape) would be
            # shown escaped, and the line pasted would approve another name: no line then.
            lines.append("    " + h["approve"] if _clean(h["approve"]) == h["approve"] else
                         "    (no line to paste: the command's id or node holds characters a terminal cannot show "
                         "as they are; --json has the line)")
        b = data["breaker"]
        lines.append("")
        lines.append(_clean(f"BREAKER: {b['state']}" + (f" since {b['since']}: {b['summary']}" if b["state"] == "tripped" else "")
                            + ("" if b["state"] == "tripped" else f" ({b['summary'] if not b.get('since') else 'last storm ' + b['since']})")))
        return "\n".join(lines) + "\n"

    def result_steps(self, r: dict) -> list[tuple[str, float, bool, str]]:
        """A result's steps as (step, time, ok, detail), read as published: a step without a time
        is left out, one stamped after its answer is taken at the answer (streams.repair.step_time)."""
        answered = _ts(r.get("ts"))
        out = []
        for st in r.get("steps") or [] if isinstance(r.get("steps"), list) else []:
            if not isinstance(st, dict) or not st.get("step") or _ts(st.get("at")) <= 0:
                continue
            out.append((str(st["step"]), min(_ts(st.get("at")), answered) if answered else _ts(st.get("at")),
                        st.get("ok", True) is True, str(st.get("detail") or "")))
        return out

    def repair(self, inc: Incident) -> list[dict]:
        """Time to repair per stage (streams.repair): detection (the first command of the repair),
        then each milestone its answers reached, with the seconds since the one before it."""
        milestones: dict[str, float] = {}
        started = [_ts(c.get("ts")) for c in inc.commands if c.get("action") in REPAIR_ACTIONS and _ts(c.get("ts")) > 0]
        if started:
            milestones["detection"] = min(started)
        answers = [(c, r) for c in inc.commands for r in [self.result_for(c)] if r is not None]
        for c, r in sorted(answers, key=lambda cr: _ts(cr[1].get("ts"))):
            steps = [(n, t, ok) for n, t, ok, _ in self.result_steps(r)]
            reached(milestones, answer_milestones(str(c.get("action")), str(r.get("outcome")), _ts(r.get("ts")), steps))
        if set(milestones) <= {"detection"}:
            return []  # nothing of a repair was answered yet
        return [{**row, "at": _iso(row["at"])} for row in durations(milestones)]

    def timeline(self, inc: Incident) -> list[dict]:
        """Every alert, evidence line, command, result and result step of one incident, in time order."""
        items: list[dict] = []
        seen = set()
        # each step of a result read here is shown once: not again as the alert's copy of it
        stepped = {(str(c.get("command_id")), n) for c in inc.commands for r in [self.result_for(c)] if r is not None
                   for n, _, _, _ in self.result_steps(r)}
        for a in inc.alerts:
            rule = rule_of(a)
            items.append({"ts": a.get("ts"), "what": f"alert {a.get('state')}",
                          "text": f"{a.get('classification')} ({a.get('severity')}): {a.get('summary')}"
                                  + (f" [rule {rule['id']}]" if rule else "")})
            ev = a.get("evidence")
            for e in (ev.get("timeline") or [] if isinstance(ev, dict) else []):
                if not isinstance(e, dict):
                    continue
                data = e.get("data") if isinstance(e.get("data"), dict) else {}
                if data.get("step") is not None and (str(data.get("command_id")), str(data["step"])) in stepped:
                    continue
                k = (e.get("ts"), e.get("kind"), e.get("summary"))
                if k not in seen:
                    seen.add(k)
                    items.append({"ts": e.get("ts"), "what": f"evidence {e.get('kind')}", "text": e.get("summary", "")})
        for c in inc.commands:
            pre = "; ".join(str(p) for p in (c.get("preconditions") or []))
            rule = rule_of(c)
            items.append({"ts": c.get("ts"), "what": f"command {c.get('action')}",
                          "text": f"step {c.get('step')} {c.get('command_id')}"
                                  + (f" [rule {rule['id']}]" if rule else "")
                                  + (" HELD for approval" if c.get("requires_approval") else "")
                                  + f", expires {c.get('expires_at')}" + (f"; preconditions: {pre}" if pre else "")})
            r = self.result_for(c)
            if r is not None:
                items.append({"ts": r.get("ts"), "what": f"result {r.get('outcome')}",
                              "text": f"{c.get('action')} ({c.get('command_id')}) on {r.get('node')}: {r.get('detail', '')}"})
                for n, t, ok, detail in self.result_steps(r):
                    items.append({"ts": _iso_exact(t), "what": f"step {n}",
                                  "text": f"{c.get('action')} ({c.get('command_id')}): " + ("ok" if ok else "FAILED")
                                          + (f": {detail}" if detail else "")})
        items.sort(key=lambda i: _ts(i["ts"]))
        return items

    def incident_json(self, inc: Incident) -> dict:
        return {"incident_id": inc.id, "node": inc.last.get("node") if inc.alerts else None,
                "gpu_index": inc.gpu_index, "gpu_uuid": inc.last.get("gpu_uuid") if inc.alerts else None,
                "classification": inc.last.get("classification") if inc.alerts else None,
                "state": inc.last.get("state") if inc.alerts else None, "opened": _iso(inc.opened),
                # the rule behind the verdict, and the facts it read (streams.rules): the newest alert's
                "rule": rule_of(inc.last) if inc.alerts else None,
                "steps": self.steps(inc), "repair": self.repair(inc), "recommended_steps": inc.last.get("recommended_steps", []) if inc.alerts else [],
                "timeline": self.timeline(inc)}

    def steps(self, inc: Incident) -> list[dict]:
        """The incident's commands in order with their outcome: what was done and what is left."""
        return [{"action": c.get("action"), "step": c.get("step"), "command_id": c.get("command_id"),
                 "outcome": self.outcome(c)} for c in sorted(inc.commands, key=lambda c: (c.get("step") or 0, _ts(c.get("ts"))))]

    def render_incident(self, inc: Incident) -> str:
        data = self.incident_json(inc)
        lines = [_clean(f"INCIDENT {inc.id}: {data['classification']} on {data['node']} GPU {data['gpu_index']} "
                        f"({data['gpu_uuid']}), {data['state']}, opened {data['opened']}")]
        rule = data["rule"]
        if rule:
            lines.append(_clean(f"RULE {rule['id']}" + (f": {rule['name']}" if rule["name"] else "")))
            if rule["facts"]:
                lines.append(_clean("  facts: " + ", ".join(f"{k}={v}" for k, v in rule["facts"].items())))
        lines.append("")
        for item in data["timeline"]:
            lines.append(_clean(f"{item['ts']}  {item['what']:<24} {item['text']}"))
        lines += ["", "STEPS (done and left):"]
        for s in data["steps"]:
            mark = "done" if s["outcome"] == "succeeded" else s["outcome"]
            lines.append(_clean(f"  {s['step']}. {s['action']:<16} {mark}"))
        if data["repair"]:
            lines += ["", "TIME TO REPAIR (per stage, from the milestone before it):"]
            for row in data["repair"]:
                took = "" if row["seconds"] is None else f"+{_age(row['seconds'])}"
                total = "" if row["since_detection"] is None else f"({_age(row['since_detection'])} since detection)"
                lines.append(_clean(f"  {row['stage']:<16} {row['at']}  {took:<9} {total}".rstrip()))
        if data["recommended_steps"]:
            lines += ["", "RECOMMENDED (the alert's words):"] + [_clean(f"  - {s}") for s in data["recommended_steps"]]
        return "\n".join(lines) + "\n"


def rule_of(record: dict) -> dict | None:
    """The rule an alert or command names ({"id", "name", "facts"}), read as published: None when it
    names none (a /1 alert, a /2 command) or not as the contract says (it is shown, never trusted)."""
    rule = record.get("rule")
    if not isinstance(rule, dict) or not isinstance(rule.get("id"), str) or not rule["id"]:
        return None
    facts = rule.get("facts") if isinstance(rule.get("facts"), dict) else {}
    return {"id": rule["id"], "name": rule.get("name") if isinstance(rule.get("name"), str) else "",
            "facts": dict(list(facts.items())[:16])}


def approve_line(cmd: dict) -> str:
    """The line that releases a held command, for the approver to paste into a shell. Every field
    read from the record is shell-quoted (shlex.quote): records are read here as published, not
    decoded, and a forged command's node or id must not become words or commands of its own
    (``gpu-node-9 --key /dev/null; curl ...|sh``) in the shell of the one person with an approver
    key. ``--reason '...'`` is a placeholder for the approver's words."""
    fields = ["xidstream", "approve", str(cmd.get("command_id")), "--node", str(cmd.get("node")), "--key", "APPROVER.key"]
    return shlex.join(fields) + " --reason '...' --publish"


def _clean(value: Any, limit: int = 2000) -> str:
    """Text read from a record, for a terminal: one line, no control characters (a node can
    write an escape sequence that repaints what the operator sees), bounded."""
    return plain_text(str(value), limit) or "-"


def _short(uuid: Any) -> str:
    text = _clean(uuid or "-", 200)
    return text if len(text) <= 17 else text[:17] + "…"


def _columns(rows: list[tuple]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# -- reading ------------------------------------------------------------------------------------
def read_book(settings: Settings, since_s: float, stdin: IO[bytes] | None = None, *, detail: bool = True) -> IncidentBook:
    book = IncidentBook(detail)
    if stdin is not None:
        for line in stdin:
            if line.strip():
                book.add_raw(line, unwrap=True)
        return book
    from xidstream.transport.kafka import read_since

    since_ms = int((time.time() - since_s) * 1000)
    for m in read_since(settings, [settings.topics.name(t) for t in TOPICS], since_ms):
        book.add_raw(m.value())
    return book


def _now(book: IncidentBook, args: argparse.Namespace) -> float:
    # offline (replay output): as of the newest record, so ages read as they did then
    return book.newest if args.stdin else time.time()


def _incidents(args: argparse.Namespace, settings: Settings) -> int:
    since_s = parse_since(args.since)
    while True:
        book = read_book(settings, since_s, sys.stdin.buffer if args.stdin else None, detail=False)
        now = _now(book, args)
        if args.json:
            sys.stdout.write(orjson.dumps(book.summary_json(now, node=args.node, verdict=args.verdict)).decode() + "\n")
        else:
            text = book.render_summary(now, node=args.node, verdict=args.verdict, since=args.since if not args.stdin else "")
            if args.watch and sys.stdout.isatty():
                text = "\x1b[H\x1b[2J" + text  # in place: home, clear
            sys.stdout.write(text)
        sys.stdout.flush()
        if not args.watch or args.stdin:
            return 0
        time.sleep(args.interval)


def _incident(args: argparse.Namespace, settings: Settings) -> int:
    book = read_book(settings, parse_since(args.since), sys.stdin.buffer if args.stdin else None)
    inc = book.find(args.incident_id)
    if args.html:
        from xidstream.report import live_samples, write_report

        gpu = inc.last.get("gpu_uuid") if inc.alerts else None
        if gpu and not args.stdin:
            book.samples[gpu] = live_samples(settings, gpu, inc)
        write_report(book, inc, args.html)
        print(f"xidstream incident: report written to {args.html}", file=sys.stderr)
        return 0
    if args.json:
        sys.stdout.write(orjson.dumps(book.incident_json(inc)).decode() + "\n")
    else:
        sys.stdout.write(book.render_incident(inc))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--since", default="7d", help="read records stamped within this long (30m, 24h, 7d; default 7d)")
    p.add_argument("--stdin", action="store_true", help="read `xidstream replay --json` lines (or bare records) from "
                                                         "stdin instead of Kafka: a post-mortem looks like a live view")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    add_kafka_args(p, partitions=False)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("incidents", help="open incidents fleet-wide, commands held for approval, the breaker")
    p.add_argument("--node", help="only this node's")
    p.add_argument("--verdict", help="only this classification (GPU_WEDGED, GPU_HARDWARE_FAULT, GPU_SUSPECT, ...)")
    p.add_argument("--watch", action="store_true", help="refresh in place every --interval seconds")
    p.add_argument("--interval", type=float, default=5.0, help="--watch: seconds between refreshes (default 5)")
    _common(p)
    p.set_defaults(handler=_incidents)
    p = sub.add_parser("incident", help="one incident's timeline: alerts, evidence, commands, results")
    p.add_argument("incident_id", help="the incident id (or a unique prefix of it)")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report with a chart instead")
    _common(p)
    p.set_defaults(handler=_incident)
