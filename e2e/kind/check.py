"""Requests through the kind gateway: what a user's first cluster must do (stdlib + kubectl/helm).

1. Prefix reuse: for several shared system prompts, the first request warms a
   pod; every follow-up with the same prefix must report cached prompt tokens
   (``usage.prompt_tokens_details.cached_tokens``) covering most of that prefix —
   which only happens when the EPP sends it to the pod holding the prefix.
2. P/D: a request for the prefill/decode model succeeds, and the decode pod's
   engine reports KV bytes it pulled from the prefill engine (``kvfleet_transfer_bytes_total``),
   two pods with their own pod IPs.
The response phase reaches the EPP (with a Helm release): every EPP replica's served-endpoint and
engine-cached-token counters grow and no pick is left waiting for its first token, and the EPP left
half the responses' bodies unread (values-kind.yaml's ``response_body_sample: 0.5``): through the
chart's own Envoy (ext_proc BUFFERED) Envoy honours the picker's ``mode_override`` and skips them;
through Envoy Gateway (full duplex) Envoy sends them all and the EPP's front hands them back unread.
3. Restricted: the namespace enforces Pod Security "restricted"; every container runs as non-root on
   a read-only root filesystem (tried by writing to it in each running container).
4. Discovery: each EPP replica counts, from the API server, every ready engine pod of each pool.
5. A deleted engine pod is replaced by its ReplicaSet (a new address); new prefixes are reused
   on follow-ups and the new pod serves.
6. One of two EPP replicas killed under load: no request fails beyond those in flight.
7. ``helm upgrade`` with a changed value rolls the Deployment it touches; CRDs, KVCachePools and
   InferencePools survive (same UIDs); traffic is served after.
8. ``helm uninstall`` (after the KVCachePools are deleted) leaves no pod of the release.

With ``--gateway envoy-gateway`` (Envoy Gateway in front, ``make e2e-kind-eg``; its ext_proc streams the
body in full duplex, where Envoy sends every response body whatever the picker asks), one more, before 3:

* both failure modes with every EPP replica gone: the FailClose pool (``sim-unified``, the default route)
  answers 503, the FailOpen pool (``sim-pd``, the route for header ``X-Gateway-Base-Model-Name``, which
  GIE's body-based routing sets) is served by its shard's headless Service; routing comes back with the
  EPP.

There, every request carries ``X-Gateway-Base-Model-Name`` (what body-based routing would set), so each
model's requests take its InferencePool's route, and the EPP keeps each pick in the pool its route invoked.

1 and 2 run on one machine too, against the real API server and a node that runs the pods
(tests/cluster/test_serving.py); all eight run on kind (``make e2e-kind``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

#: send ``X-Gateway-Base-Model-Name`` (the body's model), as GIE's body-based routing does in front of a
#: Gateway API implementation, so the per-model HTTPRoutes pick each model's InferencePool
BASE_MODEL_HEADER = False


def complete(url: str, model: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8}).encode()
    headers = {"content-type": "application/json"}
    if BASE_MODEL_HEADER:
        headers["X-Gateway-Base-Model-Name"] = model
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        result: dict[str, Any] = json.loads(resp.read())
    return result


def cached(resp: dict[str, Any]) -> int:
    return int(((resp.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def check_prefix_routing(url: str) -> None:
    for tenant in range(4):
        system = (f"You are assistant #{tenant} of the kvfleet e2e test. "
                  + "Answer briefly and precisely. " * 40)
        first = complete(url, "llama-3-8b", system + "Question 0?")
        prefix_tokens = int(first["usage"]["prompt_tokens"]) - 8
        for q in range(1, 6):
            resp = complete(url, "llama-3-8b", system + f"Question {q}?")
            hit = cached(resp)
            if hit < prefix_tokens * 0.8:
                sys.exit(f"tenant {tenant} question {q}: {hit} cached tokens of a ~{prefix_tokens}-token "
                         "shared prefix: not routed to its pod")
        print(f"tenant {tenant}: follow-ups reused the cached prefix (>= 80% of {prefix_tokens} tokens)")


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus exposition."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def engine_metrics(namespace: str, deployment: str) -> str:
    """The /metrics of a Deployment's engine container, read inside the pod (``kubectl exec``)."""
    code = ("import urllib.request;"
            "print(urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode())")
    return subprocess.run(["kubectl", "-n", namespace, "exec", f"deploy/{deployment}", "-c", "engine", "--",
                           "python", "-c", code],
                          capture_output=True, text=True, check=True).stdout


def check_pd(url: str, decode_metrics: Callable[[], str], model: str = "llama-3-8b-pd") -> None:
    """A P/D request succeeds and the decode engine pulled its prompt's KV from the prefill engine
    (``kvfleet_transfer_bytes_total{direction="received"}`` on the decode engine's /metrics grew)."""
    before = metric_sum(decode_metrics(), "kvfleet_transfer_bytes_total")
    resp = complete(url, model, "Summarise the kvfleet design in one line. " * 60)
    if not resp.get("choices"):
        sys.exit(f"P/D request returned no choices: {resp}")
    after = metric_sum(decode_metrics(), "kvfleet_transfer_bytes_total")
    if after <= before:
        sys.exit("P/D request moved no KV bytes to the decode pod")
    print(f"P/D: decode pod received {after - before:.0f} KV bytes from the prefill pod")


def kubectl(*args: str) -> str:
    r = subprocess.run(["kubectl", *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kubectl {' '.join(args)} failed: {r.stderr.strip()[-800:]}")
    return r.stdout


def kget(namespace: str, *args: str) -> Any:
    return json.loads(kubectl("-n", namespace, "get", *args, "-o", "json"))


def ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def ready_pods(namespace: str, selector: str) -> dict[str, str]:
    """name -> pod IP of the ready pods that match ``selector``."""
    return {p["metadata"]["name"]: p["status"]["podIP"]
            for p in kget(namespace, "pods", "-l", selector)["items"] if ready(p)}


def wait(what: str, probe: Callable[[], Any], timeout_s: float = 180, interval_s: float = 1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(interval_s)
    sys.exit(f"timed out after {timeout_s:.0f} s waiting for {what}")


def http_in_pod(namespace: str, pod: str, container: str, url: str) -> str:
    """GET ``url`` from inside a pod (its own Python): pod IPs are not routed to the host."""
    code = f"import urllib.request;print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    return kubectl("-n", namespace, "exec", pod, "-c", container, "--", "python", "-c", code)


def check_restricted(namespace: str) -> None:
    """The namespace enforces Pod Security "restricted"; in every running container the runtime gives a
    non-root uid and a read-only root filesystem (tried, not read from the spec)."""
    labels = json.loads(kubectl("get", "namespace", namespace, "-o", "json"))["metadata"]["labels"]
    if labels.get("pod-security.kubernetes.io/enforce") != "restricted":
        sys.exit(f"namespace {namespace} does not enforce Pod Security restricted: {labels}")
    probe = ("import os,sys\ntry:\n open('/kvfleet-probe','w')\nexcept OSError as e:\n"
             " print(os.getuid(), e.errno); sys.exit(0)\nprint(os.getuid(), 'writable')")
    seen = 0
    for pod in kget(namespace, "pods")["items"]:
        if not ready(pod):
            continue
        for c in pod["spec"]["containers"]:
            name = pod["metadata"]["name"]
            if c["image"].startswith("kvfleet/envoy"):
                cmd = ["sh", "-c", "id -u; touch /kvfleet-probe 2>/dev/null && echo writable || echo 30"]
            else:
                cmd = ["python", "-c", probe]
            uid, rofs = kubectl("-n", namespace, "exec", name, "-c", c["name"], "--", *cmd).split()
            if uid == "0" or rofs != "30":  # 30: EROFS
                sys.exit(f"{name}/{c['name']}: uid {uid}, root filesystem {rofs}: not restricted")
            seen += 1
    print(f"restricted: {seen} containers run as non-root on a read-only root filesystem "
          f"(namespace enforces Pod Security restricted)")


def check_thread_names(namespace: str) -> None:
    """Each EPP's threads carry their names in the kernel under the real runtime
    (kvfleet/cache/threadnames.py: ``top -H`` and ``/proc`` tell the ext_proc loop, the KV-event and gossip
    threads apart)."""
    code = ("import os\nfor t in sorted(os.listdir('/proc/1/task')):\n"
            " print(open(f'/proc/1/task/{t}/comm').read().strip())")
    for pod in ready_pods(namespace, "app.kubernetes.io/component=epp"):
        out = kubectl("-n", namespace, "exec", pod, "-c", "epp", "--", "python", "-c", code)
        names = set(out.splitlines())
        if not {"ext-proc-loop", "kv-events"} <= names:
            sys.exit(f"EPP {pod}: its threads are not named: {sorted(names)}")
        print(f"thread names: EPP {pod}: {', '.join(sorted(n for n in names if n != 'python'))}")


def check_discovery(namespace: str) -> None:
    """Every EPP replica sees, from the API server, each pool's ready engine pods."""
    pools = kget(namespace, "inferencepools")["items"]
    want = {p["metadata"]["name"]: len(ready_pods(namespace, ",".join(
        f"{k}={v}" for k, v in p["spec"]["selector"]["matchLabels"].items()))) for p in pools}
    epps = ready_pods(namespace, "app.kubernetes.io/component=epp")
    if len(epps) < 1:
        sys.exit("no ready EPP pod")

    def seen(pod: str) -> dict[str, float]:
        text = http_in_pod(namespace, pod, "epp", "http://127.0.0.1:9090/metrics")
        return {line.split('name="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("inference_pool_ready_pods{")}

    for pod in epps:
        def counts_all(pod: str = pod) -> dict[str, float] | None:
            s = seen(pod)
            return s if all(s.get(k) == v for k, v in want.items()) else None

        got = wait(f"EPP {pod} to count every ready engine pod {want}", counts_all, timeout_s=60)
        print(f"discovery: EPP {pod} counts ready pods per pool {got} (API server: {want})")


def check_replacement(url: str, namespace: str, model: str = "llama-3-8b", pool: str = "sim-unified") -> None:
    selector = f"kvfleet.io/pool={pool}"
    before = ready_pods(namespace, selector)
    victim = sorted(before)[0]
    kubectl("-n", namespace, "delete", "pod", victim, "--wait=false")
    now: dict[str, str] = wait("the replacement engine pod Ready", lambda: (
        lambda r: r if victim not in r and len(r) == len(before) else None)(ready_pods(namespace, selector)))
    (new,) = set(now) - set(before)
    if now[new] in before.values():
        sys.exit(f"replacement pod {new} reuses an old address {now[new]}")
    # new tenants until the replacement has served some (at least 16; up to 64): which pod a new tenant
    # lands on is the picker's choice (its pool by prefix shard, then hit, load and cache use), so a few
    # tenants may all land elsewhere; a replacement out of rotation gets none of 64
    queries, tenants = 0.0, 0
    while tenants < 64 and (tenants < 16 or queries <= 0):
        for i in range(tenants, tenants + 8):
            system = f"Replacement round, tenant {i}. " + "Keep answers short. " * 30
            first = complete(url, model, system + "first?")
            again = complete(url, model, system + "second?")
            if cached(again) < (int(first["usage"]["prompt_tokens"]) - 8) * 0.8:
                sys.exit(f"after the replacement, tenant {i}'s follow-up missed its prefix: {again['usage']}")
        tenants += 8
        text = http_in_pod(namespace, new, "engine", "http://127.0.0.1:8000/metrics")
        queries = metric_sum(text, "vllm:prefix_cache_queries_total")
    if queries <= 0:
        sys.exit(f"the replacement pod {new} ({now[new]}) got none of {tenants} new tenants' requests")
    print(f"replacement: {victim} deleted; {new} at {now[new]} (new address) serves "
          f"({queries:.0f} prefix-cache queries after {tenants} new tenants); follow-ups still reuse their "
          "prefixes")


def check_epp_failover(url: str, namespace: str, model: str = "llama-3-8b", workers: int = 4,
                       seconds: float = 20.0) -> None:
    """Kill one of the EPP replicas (force delete: SIGKILL, no drain) while ``workers`` clients send
    requests; at most the requests in flight at that moment may fail."""
    epps = ready_pods(namespace, "app.kubernetes.io/component=epp")
    if len(epps) < 2:
        sys.exit(f"the EPP failover check needs 2 EPP replicas, found {sorted(epps)}")
    ok: list[float] = []
    failed: list[str] = []
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def client(w: int) -> None:
        i = 0
        while time.monotonic() < stop:
            i += 1
            prompt = f"Load client {w} conversation {i % 5}. " + "Context sentence. " * 40 + f"turn {i}?"
            try:
                complete(url, model, prompt)
                with lock:
                    ok.append(time.monotonic())
            except Exception as exc:  # every failure is counted and reported
                with lock:
                    failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")

    threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    time.sleep(seconds / 4)
    victim = sorted(epps)[0]
    kubectl("-n", namespace, "delete", "pod", victim, "--grace-period=0", "--force", "--wait=false")
    killed_at = time.monotonic()
    for t in threads:
        t.join()
    after = sum(1 for t in ok if t > killed_at)
    print(f"EPP failover: {victim} killed under load ({workers} clients); {len(ok)} requests served "
          f"({after} after the kill), {len(failed)} failed{': ' + '; '.join(failed) if failed else ''}")
    if len(failed) > workers:
        sys.exit(f"{len(failed)} requests failed when one EPP replica was killed (at most {workers} were "
                 f"in flight): {failed[:5]}")
    if after == 0:
        sys.exit("no request was served after the EPP replica was killed")
    wait("the EPP Deployment back at 2 ready replicas",
         lambda: len(ready_pods(namespace, "app.kubernetes.io/component=epp")) == 2)


def epp_metric(namespace: str, name: str) -> dict[str, float]:
    """``name``'s sum in each ready EPP replica's /metrics."""
    return {pod: metric_sum(http_in_pod(namespace, pod, "epp", "http://127.0.0.1:9090/metrics"), name)
            for pod in ready_pods(namespace, "app.kubernetes.io/component=epp")}


def post(url: str, model: str, prompt: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def check_response_phase(url: str, namespace: str) -> None:
    """The gateway's response phase reaches the EPP: the endpoint that served, the engine's cached tokens, the
    first token (no pick still pending). Every replica is checked after traffic spread over them. The EPP
    reads one response body in 2 (values-kind.yaml): the others are skipped (the chart's Envoy, ext_proc
    BUFFERED, honours the picker's ``mode_override``) or handed back unread (Envoy Gateway, full duplex),
    and the rest still bring their usage."""
    served = epp_metric(namespace, "kvfleet_epp_served_total")
    cached_before = epp_metric(namespace, "kvfleet_epp_engine_cached_tokens_total")
    skipped_before = epp_metric(namespace, "kvfleet_epp_response_bodies_skipped_total")
    system = "You are the response-phase check. " + "Keep answers short. " * 40
    for i in range(24):
        complete(url, "llama-3-8b", system + f"Question {i}?")
    grew = wait("every EPP replica told of the served endpoints", lambda: (
        (now := epp_metric(namespace, "kvfleet_epp_served_total"))
        and all(now.get(p, 0) > served.get(p, 0) for p in now) and now), timeout_s=60)
    cached = epp_metric(namespace, "kvfleet_epp_engine_cached_tokens_total")
    if sum(cached.values()) <= sum(cached_before.values()):
        sys.exit(f"no engine-reported cached tokens reached the EPP through the gateway: {cached}")
    pending = wait("every pick's first token back", lambda: (
        (p := epp_metric(namespace, "kvfleet_epp_pod_pending_tokens")) and sum(p.values()) == 0 and p),
        timeout_s=60)
    skipped = epp_metric(namespace, "kvfleet_epp_response_bodies_skipped_total")
    if sum(skipped.values()) <= sum(skipped_before.values()):
        sys.exit(f"the EPP read every response body: bodies left unread {skipped}")
    print(f"response phase through the gateway: served endpoints reported {grew}, engine cached tokens "
          f"{cached}, pending first tokens {pending}, response bodies skipped {skipped}")


def check_failure_modes(url: str, namespace: str) -> None:
    """Every EPP replica gone: FailClose answers 503, FailOpen is served by the pool; then the EPP returns."""
    (epp,) = [d["metadata"]["name"] for d in kget(namespace, "deployments", "-l",
                                                   "app.kubernetes.io/component=epp")["items"]]
    replicas = kget(namespace, "deployment", epp)["spec"]["replicas"]
    kubectl("-n", namespace, "scale", f"deployment/{epp}", "--replicas=0")
    try:
        wait("no EPP pod left", lambda: not kget(namespace, "pods", "-l",
                                                  "app.kubernetes.io/component=epp")["items"], timeout_s=120)
        open_route = {"X-Gateway-Base-Model-Name": "llama-3-8b-pd"}
        # the gateway's health checks see the picker gone within seconds; until then a stream may fail closed
        opened = wait("the FailOpen pool served with the EPP down", lambda: (
            (r := post(url, "llama-3-8b-pd", "FailOpen check. " * 20, open_route))[0] == 200 and r),
            timeout_s=60)
        for i in range(5):
            st, body = post(url, "llama-3-8b-pd", f"FailOpen check {i}. " * 20, open_route)
            if st != 200:
                sys.exit(f"FailOpen pool with the EPP down answered {st}: {body[:300]}")
            st, body = post(url, "llama-3-8b", f"FailClose check {i}. " * 20)
            if st != 503:
                sys.exit(f"FailClose pool with the EPP down answered {st}, not 503: {body[:300]}")
        print(f"failure modes with the EPP down: FailOpen (sim-pd) 200 ({opened[1][:80]}...), "
              f"FailClose (sim-unified) 503 ({body[:120]})")
    finally:
        kubectl("-n", namespace, "scale", f"deployment/{epp}", f"--replicas={replicas}")
    wait(f"the EPP back at {replicas} ready replicas",
         lambda: len(ready_pods(namespace, "app.kubernetes.io/component=epp")) == replicas)
    wait("routing through the EPP again", lambda: post(url, "llama-3-8b", "Back? " * 20)[0] == 200,
         timeout_s=120)


def helm(*args: str) -> str:
    r = subprocess.run(["helm", *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"helm {' '.join(args[:3])} failed: {r.stderr.strip()[-1500:]}")
    return r.stdout


def uids(namespace: str, kind: str) -> dict[str, str]:
    return {o["metadata"]["name"]: o["metadata"]["uid"] for o in kget(namespace, kind)["items"]}


def check_helm_upgrade(url: str, namespace: str, release: str, chart: str, values: str,
                       sets: Sequence[str]) -> None:
    """A changed value rolls the Deployment it belongs to; CRDs, KVCachePools, InferencePools survive."""
    (epp,) = [d["metadata"]["name"] for d in kget(namespace, "deployments", "-l",
                                                   "app.kubernetes.io/component=epp")["items"]]
    dep = kget(namespace, "deployment", epp)
    gen, pools, ipools = dep["metadata"]["generation"], uids(namespace, "kvcachepools"), uids(
        namespace, "inferencepools")
    crds = kubectl("get", "crd", "-o", "name")
    helm("upgrade", release, chart, "-n", namespace, "-f", values, *(a for s in sets for a in ("--set", s)),
         "--set", "epp.resources.requests.memory=160Mi", "--wait", "--timeout", "5m")
    kubectl("-n", namespace, "rollout", "status", f"deployment/{epp}", "--timeout=180s")
    dep2 = kget(namespace, "deployment", epp)
    mem = dep2["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
    if dep2["metadata"]["generation"] <= gen or mem != "160Mi":
        sys.exit(f"helm upgrade did not roll {epp}: generation {gen} -> {dep2['metadata']['generation']}, "
                 f"memory request {mem}")
    if uids(namespace, "kvcachepools") != pools or uids(namespace, "inferencepools") != ipools:
        sys.exit("helm upgrade replaced KVCachePools or InferencePools")
    if kubectl("get", "crd", "-o", "name") != crds:
        sys.exit("helm upgrade changed the set of CRDs")
    # the first requests after the rollout: the gateway may not have the new EPP pods yet (counted, shown)
    refused: list[int] = []
    t0 = time.monotonic()

    def served() -> Any:
        try:
            return complete(url, "llama-3-8b", "after upgrade").get("choices")
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                raise
            refused.append(exc.code)
            return None

    wait("a request served after the upgrade", served, timeout_s=60, interval_s=0.25)
    after = (f"; {len(refused)} request(s) answered {sorted(set(refused))} in the "
             f"{time.monotonic() - t0:.1f} s before the first one served" if refused else "")
    print(f"helm upgrade: {epp} rolled (generation {gen} -> {dep2['metadata']['generation']}); "
          f"{len(pools)} KVCachePools, {len(ipools)} InferencePools and the CRDs kept; serving{after}")


def check_uninstall(namespace: str, release: str) -> None:
    kubectl("-n", namespace, "delete", "kvcachepools", "--all", "--timeout=120s")
    def gone() -> bool:
        return not kget(namespace, "pods", "-l", "kvfleet.io/pool")["items"] and not kget(
            namespace, "inferencepools")["items"]

    wait("the KVCachePools' pods and InferencePools gone", gone, timeout_s=180)
    helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "3m")
    left = wait("every pod of the release gone", lambda: (
        lambda p: "none" if not p else None)(kget(namespace, "pods")["items"]), timeout_s=120)
    crds = [c for c in kubectl("get", "crd", "-o", "name").split() if "kvfleet" in c or "inference" in c]
    print(f"helm uninstall: pods left: {left}; CRDs kept as Helm keeps crds/: {crds}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", default="kvfleet")
    parser.add_argument("--release", default="", help="the Helm release: runs checks 3-7 (kind)")
    parser.add_argument("--chart", default="charts/kvfleet")
    parser.add_argument("--values", default="charts/kvfleet/values-kind.yaml")
    parser.add_argument("--set", action="append", default=[], help="--set of the install, kept on upgrade")
    parser.add_argument("--gateway", choices=["kvfleet", "envoy-gateway"], default="kvfleet",
                        help="what serves --url: the chart's own Envoy, or Envoy Gateway (two more checks)")
    args = parser.parse_args()
    ns = args.namespace
    global BASE_MODEL_HEADER
    BASE_MODEL_HEADER = args.gateway == "envoy-gateway"  # one route per InferencePool: model → pool
    check_prefix_routing(args.url)
    decode = ready_pods(ns, "kvfleet.io/pool=sim-pd,kvfleet.io/role=decode")
    prefill = ready_pods(ns, "kvfleet.io/pool=sim-pd,kvfleet.io/role=prefill")
    if len(decode) != 1 or len(prefill) != 1:
        sys.exit(f"expected one prefill and one decode pod, found {prefill} {decode}")
    (dpod, dip), (ppod, pip) = next(iter(decode.items())), next(iter(prefill.items()))
    print(f"P/D: prefill {ppod} at {pip}, decode {dpod} at {dip}")
    check_pd(args.url, lambda: http_in_pod(ns, dpod, "engine", "http://127.0.0.1:8000/metrics"))
    if not args.release:
        return 0
    check_response_phase(args.url, ns)
    if args.gateway == "envoy-gateway":
        check_failure_modes(args.url, ns)
    check_restricted(ns)
    check_thread_names(ns)
    check_discovery(ns)
    check_replacement(args.url, ns)
    check_discovery(ns)
    check_epp_failover(args.url, ns)
    check_helm_upgrade(args.url, ns, args.release, args.chart, args.values, args.set)
    check_uninstall(ns, args.release)
    print("all checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
