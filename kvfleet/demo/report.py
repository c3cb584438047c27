"""Turn replay outcomes and scraped metrics into the demo's numbers, ``report.md``, a chart and
``summary.json``.

Per policy:

* ``hit_rate`` — cached prompt tokens / prompt tokens (from each response's
  ``usage.prompt_tokens_details.cached_tokens``);
* ``tier_hit_rate`` — the same split by the tier the hit came from (engines'
  ``kvfleet_engine_tier_hit_blocks_total`` × block size / prompt tokens, over
  pods that prefill);
* ``ttft_ms`` p50/p90/p99 — wall time to the first streamed token at the client;
* ``throughput_rps`` / ``output_tokens_per_s`` over the replay's wall time;
* ``imbalance`` — max / mean prefill tokens over the pods that prefill;
* ``misprediction`` — the EPP's |predicted − reported| cached tokens / prompt
  tokens (``kvfleet_epp_misprediction_tokens_total``), ``null`` when not exported;
* ``records`` — one compact record per request (:func:`request_records`): its
  index, pod, prompt group, the EPP's predicted cached tokens (its decision log,
  joined on the request id; ``null`` when it has no line for it), the cached
  tokens the engine reported, and TTFT; ``requests_joined`` counts those with a
  prediction.

``meta.warnings`` (e.g. a workload of a single prompt group) head ``report.md``.
``summary.json`` puts each record on one line (:func:`dump_json`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvfleet.demo.replay import Outcome


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def scrape_values(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus exposition by sample name."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


@dataclass
class PolicyResult:
    """The numbers of one policy's run (``None`` where a number could not be measured)."""

    policy: str
    ran: bool = True
    note: str = ""
    requests: int = 0
    ok: int = 0
    errors: int = 0
    hit_rate: float | None = None
    tier_hit_rate: dict[str, float] = field(default_factory=dict)
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    throughput_rps: float | None = None
    output_tokens_per_s: float | None = None
    imbalance: float | None = None
    misprediction: float | None = None
    requests_per_pod: dict[str, int] = field(default_factory=dict)
    ttft_p50_ms_per_pod: dict[str, float | None] = field(default_factory=dict)
    duration_s: float | None = None
    first_error: str = ""
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    requests_joined: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)


def summarize(
    policy: str,
    outcomes: Sequence[Outcome],
    duration_s: float,
    engine_metrics: Mapping[str, str],
    prefill_pods: Sequence[str],
    block_size: int,
    epp_metrics: str | None,
) -> PolicyResult:
    ok = [o for o in outcomes if o.ok]
    res = PolicyResult(policy=policy, requests=len(outcomes), ok=len(ok), errors=len(outcomes) - len(ok),
                       duration_s=duration_s)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        res.first_error = f"HTTP {bad[0].status}: {bad[0].error}"[:300]
    prompt = sum(o.prompt_tokens for o in ok)
    if prompt:
        res.hit_rate = sum(o.cached_tokens for o in ok) / prompt
    ttfts = [o.ttft_s * 1000 for o in ok if o.ttft_s is not None]
    res.ttft_ms = {"p50": percentile(ttfts, 0.5), "p90": percentile(ttfts, 0.9),
                   "p99": percentile(ttfts, 0.99)}
    if duration_s > 0:
        res.throughput_rps = len(ok) / duration_s
        res.output_tokens_per_s = sum(o.completion_tokens for o in ok) / duration_s
    for o in ok:
        res.requests_per_pod[o.pod] = res.requests_per_pod.get(o.pod, 0) + 1
    for pod in res.requests_per_pod:
        res.ttft_p50_ms_per_pod[pod] = percentile(
            [o.ttft_s * 1000 for o in ok if o.pod == pod and o.ttft_s is not None], 0.5)
    tiers: dict[str, float] = {}
    work: list[float] = []
    for pod, text in engine_metrics.items():
        if pod not in prefill_pods:
            continue
        vals = scrape_values(text)
        for labels, v in vals.get("kvfleet_engine_tier_hit_blocks_total", []):
            tiers[labels["tier"]] = tiers.get(labels["tier"], 0.0) + v * block_size
        work.append(sum(v for _, v in vals.get("vllm:prompt_tokens_total", [])))
    if prompt:
        res.tier_hit_rate = {t: v / prompt for t, v in tiers.items() if v}
    if work and sum(work) > 0:
        res.imbalance = max(work) / (sum(work) / len(work))
    if epp_metrics:
        vals = scrape_values(epp_metrics)
        mis = vals.get("kvfleet_epp_misprediction_tokens_total")
        routed = sum(v for _, v in vals.get("kvfleet_epp_prompt_tokens_total", []))
        if mis is not None and routed > 0:
            res.misprediction = sum(v for _, v in mis) / routed
    return res


def load_decisions(path: Path) -> dict[str, dict[str, Any]]:
    """The EPP's decision log (``KVFLEET_EPP_DECISION_LOG``) by request id; a missing file is empty."""
    out: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the EPP's stop
        if isinstance(rec, dict) and rec.get("id"):
            out[str(rec["id"])] = rec
    return out


def request_records(
    outcomes: Sequence[Outcome], groups: Sequence[str], decisions: Mapping[str, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Per request (outcome order): ``i``, ``pod``, ``group``, ``predicted`` (the EPP's decision log),
    ``reported`` (the engine's ``cached_tokens``), ``ttft_ms``; ``error`` on a failed one."""
    out = []
    for o in outcomes:
        d = decisions.get(o.request_id) if o.request_id else None
        rec: dict[str, Any] = {
            "i": o.index, "pod": o.pod, "group": groups[o.index] if o.index < len(groups) else "",
            "predicted": None if d is None else d.get("predicted"),
            "reported": o.cached_tokens if o.ok else None,
            "ttft_ms": None if o.ttft_s is None else round(o.ttft_s * 1000, 1),
        }
        if not o.ok:
            rec["error"] = f"HTTP {o.status}: {o.error}"[:120]
        out.append(rec)
    return out


def skipped(policy: str, reason: str) -> PolicyResult:
    return PolicyResult(policy=policy, ran=False, note=reason)


def _fmt(v: float | None, pct: bool = False, digits: int = 1) -> str:
    if v is None:
        return "—"
    return f"{v * 100:.{digits}f} %" if pct else f"{v:.{digits}f}"


def render_markdown(results: Sequence[PolicyResult], meta: Mapping[str, Any]) -> str:
    lines = [
        "# kvfleet demo report",
        "",
        f"Workload: {meta.get('workload')} — {meta.get('requests')} requests, "
        f"{meta.get('prompt_tokens_mean', 0):.0f} prompt tokens on average, "
        f"up to {meta.get('max_tokens')} generated.",
        f"Stack: Envoy {meta.get('envoy', '')} → kvfleet EPP → {meta.get('pods')} simulated engines in "
        f"one pool of {meta.get('pools')} prefix shards ({meta.get('topology')}), "
        f"profile {meta.get('profile')}, "
        f"time factor {meta.get('time_factor')} (1 modelled second = {meta.get('time_factor')} s "
        "of wall time).",
        f"Per-pod cache: {meta.get('gpu_blocks')} GPU blocks + {meta.get('cpu_blocks')} CPU blocks of "
        f"{meta.get('block_size')} tokens.",
        "",
        *(f"**Warning:** {w}." for w in meta.get("warnings") or ()),
        *([""] if meta.get("warnings") else []),
        "| policy | hit rate | GPU / CPU hits | TTFT p50 (ms) | p90 | p99 | req/s | out tok/s "
        "| imbalance | misprediction | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if not r.ran:
            lines.append(f"| {r.policy} | not run: {r.note} | | | | | | | | | |")
            continue
        split = " / ".join(_fmt(r.tier_hit_rate.get(t, 0.0), pct=True) for t in ("gpu", "cpu"))
        lines.append(
            f"| {r.policy} | {_fmt(r.hit_rate, pct=True)} | {split} "
            f"| {_fmt(r.ttft_ms.get('p50'), digits=0)} "
            f"| {_fmt(r.ttft_ms.get('p90'), digits=0)} | {_fmt(r.ttft_ms.get('p99'), digits=0)} "
            f"| {_fmt(r.throughput_rps)} "
            f"| {_fmt(r.output_tokens_per_s, digits=0)} | {_fmt(r.imbalance, digits=2)} "
            f"| {_fmt(r.misprediction, pct=True)} "
            f"| {r.errors}/{r.requests} |"
        )
    lines += ["", "TTFT is wall time at the client through Envoy "
                  "(the engines sleep modelled time × the time factor).",
              "Imbalance: max / mean prefill tokens over the pods that prefill. "
              "Misprediction: |EPP-predicted − engine-reported cached tokens| / prompt tokens.", ""]
    notes = [r for r in results if r.note or r.first_error]
    if notes:
        lines.append("Notes:")
        for r in notes:
            if r.note:
                lines.append(f"- {r.policy}: {r.note}")
            if r.first_error:
                lines.append(f"- {r.policy}: first error: {r.first_error}")
        lines.append("")
    lines += ["![hit rate and TTFT per policy](policies.png)", ""]
    return "\n".join(lines)


def render_chart(results: Sequence[PolicyResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if r.ran and r.hit_rate is not None]
    names = [r.policy for r in ran]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [(r.hit_rate or 0) * 100 for r in ran], color="#4c72b0")
    ax1.set_ylabel("prefix hit rate (%)")
    ax1.set_title("Prompt tokens served from cache")
    x = range(len(ran))
    for off, q, color in ((-0.27, "p50", "#55a868"), (0.0, "p90", "#dd8452"), (0.27, "p99", "#c44e52")):
        ax2.bar([i + off for i in x], [r.ttft_ms.get(q) or 0 for r in ran], width=0.27, label=q, color=color)
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(names)
    ax2.set_ylabel("TTFT (ms, wall)")
    ax2.set_title("Time to first token")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out_dir: Path, results: Sequence[PolicyResult], meta: Mapping[str, Any]) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"report": out_dir / "report.md", "chart": out_dir / "policies.png",
             "summary": out_dir / "summary.json"}
    render_chart(results, paths["chart"])
    paths["report"].write_text(render_markdown(results, meta))
    summary = {
        "meta": dict(meta),
        "policies": {
            r.policy: {
                k: v for k, v in asdict(r).items() if k not in ("policy",)
            }
            for r in results
        },
    }
    paths["summary"].write_text(dump_json(summary) + "\n")
    return paths


def dump_json(obj: Any, indent: int = 0) -> str:
    """JSON indented by two spaces, except that a list of records (mappings or lists of scalars) or of
    scalars keeps each element on one line: the per-request records stay compact and greppable."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, Mapping) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {dump_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list | tuple) and obj:
        if all(not isinstance(v, Mapping | list | tuple) for v in obj):
            return json.dumps(list(obj))
        if all(_flat(v) for v in obj):
            return ("[\n" + ",\n".join(inner + json.dumps(v, separators=(",", ":")) for v in obj)
                    + "\n" + pad + "]")
        return "[\n" + ",\n".join(inner + dump_json(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj)


def _flat(v: Any) -> bool:
    values = v.values() if isinstance(v, Mapping) else v if isinstance(v, list | tuple) else None
    return values is not None and all(not isinstance(x, Mapping | list | tuple) for x in values)
