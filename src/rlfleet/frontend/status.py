"""The fleet's status page, served by the RL listener (rlfleet.frontend.rl): every worker
(model, address, policy version and digest, open or gated and why, requests in flight,
tokens/s), the gate of each model, and the last policy refreshes from the journal with the
time of each phase (from the journal's store, SQLite or etcd, through rlfleet.journal's
one interface). One snapshot (`FleetStatus.snapshot`) feeds GET /fleet.json, the HTML
page (which renders it, then fetches it again every two seconds) and `rlfleet status`."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from rlfleet.journal import JournalError, JournalMissing, open_journal
from rlfleet.runtime.discovery import Discovery, DiscoveryError

PROBE_TIMEOUT = 2.0  # seconds for each worker's /health; a slow worker is shown as such
REFRESHES = 5  # refreshes shown


class FleetStatus:
    """`journal`: the refresh journal as `open_journal` takes it (a SQLite path,
    ``etcd://host:port[/name]``, ...); None shows no refreshes."""

    def __init__(self, discovery: Discovery, namespace: str, http: httpx.AsyncClient,
                 journal: str | None) -> None:
        self.discovery, self.namespace, self.http = discovery, namespace, http
        self.journal = journal

    async def _worker(self, entry: dict[str, Any]) -> dict[str, Any]:
        transport = entry.get("transport")
        w: dict[str, Any] = {
            # a string: 64-bit IDs do not survive JavaScript's numbers
            "instance_id": str(entry.get("instance_id")), "model": entry.get("model"),
            "address": transport.get("http") if isinstance(transport, dict) else None,
            "system_url": entry.get("system_url"), "gated": bool(entry.get("gated")),
            "gate_reason": entry.get("gate_reason"), "weight_version": None,
            "weight_digest": None, "running": None, "tokens_per_s": None, "error": None}
        if not w["system_url"]:
            w["error"] = "no system server"
            return w
        try:
            r = await self.http.get(f"{w['system_url']}/health", timeout=PROBE_TIMEOUT)
            health = r.json()
            for k in ("weight_version", "weight_digest", "running", "tokens_per_s",
                      "gate_reason"):
                w[k] = health.get(k, w[k])
            w["gated"] = bool(health.get("gated", w["gated"]))
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            w["error"] = f"health probe failed: {type(e).__name__}: {e}"
        return w

    def _refreshes(self) -> list[dict[str, Any]]:
        """The last refreshes (none while no coordinator has written the journal); raises
        JournalError when its store fails."""
        if not self.journal:
            return []
        try:
            journal = open_journal(self.journal, create=False)
        except JournalMissing:
            return []
        except ValueError as e:  # not a journal open_journal knows
            raise JournalError(str(e)) from e
        with journal:
            rows = journal.recent(REFRESHES)
        return [{k: r[k] for k in ("id", "started_at", "ended_at", "model", "update_path",
                                   "target_version", "target_digest", "decision", "reason")}
                | {"steps": [{"name": s["name"], "seconds": round(s["seconds"], 3)}
                             for s in r["steps"] or []]} for r in rows]

    async def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {"namespace": self.namespace, "time": time.time(),
                               "journal": self.journal, "error": None}
        try:
            entries = await self.discovery.list(self.namespace, endpoint="generate")
        except DiscoveryError as e:
            entries, out["error"] = [], f"discovery failed: {e}"
        workers = await asyncio.gather(*(self._worker(e) for e in entries))
        out["workers"] = sorted(workers, key=lambda w: (str(w["model"]), w["instance_id"]))
        models: dict[str, dict[str, Any]] = {}
        for w in workers:
            m = models.setdefault(w["model"], {"model": w["model"], "workers": 0, "gated": 0,
                                               "reasons": []})
            m["workers"] += 1
            if w["gated"]:
                m["gated"] += 1
                if w["gate_reason"] and w["gate_reason"] not in m["reasons"]:
                    m["reasons"].append(w["gate_reason"])
        for m in models.values():
            m["gate"] = ("gated" if m["gated"] == m["workers"] else
                         "partly gated" if m["gated"] else "open")
        out["models"] = sorted(models.values(), key=lambda m: str(m["model"]))
        try:
            out["refreshes"] = await asyncio.to_thread(self._refreshes)
        except JournalError as e:
            out["refreshes"] = []
            out["error"] = "; ".join(filter(None, (out["error"], f"journal failed: {e}")))
        return out


def render_text(s: dict[str, Any]) -> str:
    """The snapshot for a terminal (`rlfleet status`)."""
    lines = [f"namespace {s['namespace']}" + (f"  ({s['error']})" if s.get("error") else "")]
    for m in s["models"]:
        why = f": {'; '.join(m['reasons'])}" if m["reasons"] else ""
        lines.append(f"model {m['model']}: {m['workers']} worker(s), {m['gate']}{why}")
    lines.append(f"{'worker':>20}  {'model':<16} {'policy':<12} {'digest':<22} {'admission':<9} "
                 f"{'running':>7} {'tok/s':>8}  address")
    for w in s["workers"]:
        digest = (w["weight_digest"] or "-")[:22]
        tps = "-" if w["tokens_per_s"] is None else f"{w['tokens_per_s']:.1f}"
        lines.append(f"{w['instance_id']:>20}  {str(w['model']):<16} "
                     f"{str(w['weight_version'] or '-'):<12} {digest:<22} "
                     f"{'gated' if w['gated'] else 'open':<9} "
                     f"{'-' if w['running'] is None else w['running']:>7} {tps:>8}  "
                     f"{w['address']}" + (f"  ({w['error']})" if w["error"] else ""))
    if s["refreshes"]:
        lines.append("last refreshes:")
    for r in s["refreshes"]:
        phases = " ".join(f"{p['name']}={p['seconds']:.2f}s" for p in r["steps"])
        lines.append(f"  #{r['id']} -> {r['target_version']}: {r['decision'] or 'running'}"
                     f" ({r['reason'] or ''}) {phases}")
    return "\n".join(lines)


# One renderer (the script) for the first paint and every refresh: the snapshot the page was
# served with is drawn before the load event, then /fleet.json is fetched every two seconds.
_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>rlfleet: fleet status</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.05em;margin-top:1.5em}
table{border-collapse:collapse}td,th{padding:.25em .7em;border-bottom:1px solid #ddd;
text-align:left}th{background:#f4f4f4}.num{text-align:right}.mono{font-family:monospace}
.open{color:#17692b;font-weight:600}.gated{color:#b3261e;font-weight:600}
.partly{color:#a15c00;font-weight:600}#updated{color:#777}
</style></head><body>
<h1>rlfleet fleet status <span id="updated"></span></h1>
<div id="error"></div>
<h2>Gate</h2><table id="models"><thead><tr><th>model</th><th>workers</th><th>gate</th>
<th>why</th></tr></thead><tbody></tbody></table>
<h2>Workers</h2><table id="workers"><thead><tr><th>instance</th><th>model</th><th>address</th>
<th>policy version</th><th>digest</th><th>admission</th><th class="num">in flight</th>
<th class="num">tokens/s</th></tr></thead><tbody></tbody></table>
<h2>Last refreshes</h2><table id="refreshes"><thead><tr><th>#</th><th>target</th>
<th>outcome</th><th>phases (s)</th><th>why</th></tr></thead><tbody></tbody></table>
<script>
const first = __SNAPSHOT__;
function esc(v){return v===null||v===undefined?"-":String(v).replace(/[&<>"]/g,
  c=>({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]))}
function rows(id, html){document.querySelector("#"+id+" tbody").innerHTML=html.join("")}
function render(s){
  document.getElementById("updated").textContent =
    "(updated "+new Date(s.time*1000).toLocaleTimeString()+")";
  document.getElementById("error").textContent = s.error || "";
  rows("models", s.models.map(m=>`<tr data-model="${esc(m.model)}"><td>${esc(m.model)}</td>`+
    `<td class="num">${m.workers}</td><td class="${m.gate==="open"?"open":m.gate==="gated"?
    "gated":"partly"}">${esc(m.gate)}</td><td>${esc(m.reasons.join("; ")||"")}</td></tr>`));
  rows("workers", s.workers.map(w=>`<tr data-instance="${esc(w.instance_id)}">`+
    `<td class="mono">${esc(w.instance_id)}</td><td>${esc(w.model)}</td>`+
    `<td class="mono">${esc(w.address)}</td><td>${esc(w.weight_version)}</td>`+
    `<td class="mono" title="${esc(w.weight_digest)}">${esc((w.weight_digest||"").slice(0,20)||null)}</td>`+
    `<td class="admission ${w.gated?"gated":"open"}" title="${esc(w.gate_reason)}">`+
    `${w.gated?"gated":"open"}</td><td class="num">${esc(w.running)}</td>`+
    `<td class="num">${w.tokens_per_s===null?"-":w.tokens_per_s.toFixed(1)}</td></tr>`+
    (w.error?`<tr><td></td><td colspan="7">${esc(w.error)}</td></tr>`:"")));
  rows("refreshes", s.refreshes.map(r=>`<tr><td>${r.id}</td><td>${esc(r.target_version)}</td>`+
    `<td>${esc(r.decision||"running")}</td><td class="mono">`+
    `${r.steps.map(p=>esc(p.name)+" "+p.seconds.toFixed(2)).join(", ")}</td>`+
    `<td>${esc(r.reason)}</td></tr>`));
}
render(first);
setInterval(async()=>{
  try{const r=await fetch("fleet.json",{cache:"no-store"}); if(r.ok) render(await r.json());}
  catch(e){document.getElementById("error").textContent="refresh failed: "+e;}
}, 2000);
</script></body></html>
"""


def render_page(snapshot: dict[str, Any]) -> str:
    # inside <script>, "</" must not appear: it could close the element
    data = json.dumps(snapshot).replace("</", "<\\/")
    return _PAGE.replace("__SNAPSHOT__", data)


