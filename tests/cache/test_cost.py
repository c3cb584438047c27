"""The one cost rule (kvfleet/cache/cost.py): the seeds' promotion inequality in its three outcomes, the value
of a hit, and the parts that decide with it (the agent's tier costs, the engine simulator, the EPP's tier
weights)."""

from __future__ import annotations

import pytest

from kvfleet.agent.tiers.cost import CostModel, TierCost
from kvfleet.cache import cost
from kvfleet.cache.cost import Action
from kvfleet.cache.tiers import Tier
from kvfleet.config.epp import CostModelSettings
from kvfleet.config.tiers import ModelProfile
from kvfleet.epp.router import tier_weights


@pytest.mark.parametrize(("prefill", "read", "write", "action"), [
    (1.0, 0.3, 0.3, Action.PROMOTE),
    (1.0, 0.6, 0.6, Action.SERVE_IN_PLACE),
    (1.0, 1.0, 0.0, Action.RECOMPUTE),
    (1.0, 0.5, 0.5, Action.SERVE_IN_PLACE),  # equal costs do not pay: strict inequalities
])
def test_promotion_rule(prefill: float, read: float, write: float, action: Action) -> None:
    assert cost.promotion(prefill, read, write) is action


def test_hit_value_is_the_share_of_the_prefill_a_hit_saves() -> None:
    assert cost.hit_value(1.0, 0.25) == 0.75
    assert cost.hit_value(1.0, 2.0) == 0.0 and cost.hit_value(0.0, 1.0) == 0.0
    assert cost.move_s(2e9, 1e9, 0.5) == 2.5 and cost.prefill_s(8000, 8000.0) == 1.0


def test_every_part_decides_with_the_same_rule() -> None:
    """The agent's CostModel, the EPP's tier weights and the settings' defaults come from the core module."""
    m = CostModel(ModelProfile(prefill_tokens_per_s=1000.0),
                  {Tier.CPU: TierCost(1e9, 1e9, 0.0), Tier.GPU: TierCost(1e9, 1e9, 0.0)})
    d = m.decide(Tier.CPU, Tier.GPU, 16, 4_000_000, 4_000_000)  # prefill 16 ms, read 4 ms, write 4 ms
    assert d.action is cost.promotion(d.prefill_s, d.read_s, d.write_s) is Action.PROMOTE
    w = tier_weights(CostModelSettings(prefill_tokens_per_s=10_000, kv_bytes_per_token=100_000, cpu_gbps=10,
                                       ssd_gbps=1, remote_gbps=0.5))
    assert w[Tier.CPU.rank] == pytest.approx(cost.hit_value(1e-4, 1e-5))
    assert (ModelProfile().prefill_tokens_per_s == CostModelSettings().prefill_tokens_per_s
            == cost.DEFAULT_PREFILL_TOKENS_PER_S)
    assert (ModelProfile().kv_bytes_per_token == CostModelSettings().kv_bytes_per_token
            == cost.DEFAULT_KV_BYTES_PER_TOKEN)
