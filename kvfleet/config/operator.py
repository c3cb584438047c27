"""Settings of the operator: images, the names it gives shared objects, and the ports it wires.

The ports are the ones each role listens on (``kvfleet engine``: OpenAI HTTP and
``/metrics`` on ``engine_port``, KV events ZMQ PUB on ``kv_events_port``, the
simulator's P/D KV transfers on ``transfer_port``; the ``kvfleet agent`` sidecar:
metrics on ``agent_metrics_port``, its transfer server on ``agent_transfer_port``
and its KV events on ``agent_kv_events_port`` (+1 for replay), apart from the
engine's, since both containers share the pod's network namespace; ``kvfleet epp``:
ext_proc gRPC on ``epp_port``). The operator writes them into the pods and
InferencePools it renders.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorSettings:
    """How KVCachePools become Deployments, Services, ConfigMaps and InferencePools."""

    #: The kvfleet image (every role); the chart sets it to the released tag.
    image: str = "kvfleet:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    #: Default engine images when a KVCachePool names none: the newest releases the interop suite checks
    #: (tests/interop), both publishing KV events the EPP indexes.
    vllm_image: str = "vllm/vllm-openai:v0.33.0"
    sglang_image: str = "lmsysorg/sglang:v0.5.23"
    #: The EPP Service that rendered InferencePools name in endpointPickerRef.
    epp_service: str = "kvfleet-epp"
    epp_port: int = 9002
    #: Secret holding the transfer engine's shared key, when a pool names none.
    transfer_secret: str = "kvfleet-transfer"
    transfer_secret_key: str = "secret"
    engine_port: int = 8000
    kv_events_port: int = 5557
    kv_events_replay_port: int = 5558
    agent_metrics_port: int = 9091
    transfer_port: int = 7000
    agent_transfer_port: int = 7001
    agent_kv_events_port: int = 5559
    #: Liveness endpoint of ``kvfleet operator`` (kopf's --liveness).
    liveness_port: int = 8080
    #: How often each KVCachePool's ready counts and conditions are refreshed.
    status_interval_s: float = 10.0
    #: Back-off of retried (transient) API errors.
    retry_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        names = ("epp_port", "engine_port", "kv_events_port", "kv_events_replay_port", "agent_metrics_port",
                 "transfer_port", "agent_transfer_port", "agent_kv_events_port", "liveness_port")
        for name in names:
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                raise ValueError(f"{name} must be a port number in 1..65535, got {port}")
        pod_ports = [self.engine_port, self.kv_events_port, self.kv_events_replay_port,
                     self.agent_metrics_port, self.transfer_port, self.agent_transfer_port,
                     self.agent_kv_events_port, self.agent_kv_events_port + 1]
        if len(set(pod_ports)) != len(pod_ports):
            raise ValueError("an engine pod's ports must differ (its containers share one network "
                             f"namespace): {pod_ports}")
        if self.status_interval_s <= 0 or self.retry_backoff_s <= 0:
            raise ValueError("status_interval_s and retry_backoff_s must be > 0")
