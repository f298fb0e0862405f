"""A run config's default rollout profile: its τ2 domains' shipped profiles mixed by their
training tasks."""
import os

import pytest

from muajax.planning.profile_mix import PROFILES, default_profile, mix
from muajax.planning.rollout_profile import Distribution, RolloutProfile


def profile(name: str, turns: float, system: int) -> RolloutProfile:
    fixed = Distribution(10.0, {0.0: 10.0, 100.0: 10.0})
    return RolloutProfile(name=name, system_tokens=system, first_user_tokens=fixed,
                          agent_turns=Distribution(turns, {0.0: turns, 100.0: turns}), tool_turns=fixed,
                          agent_turn_tokens=fixed, user_turn_tokens=fixed, tool_result_tokens=fixed,
                          user_latency_s=Distribution(1.0), sequence_tokens=fixed, conversations=5)


def test_a_mixture_weighs_each_profile_by_its_share():
    mixed = mix([(profile("a", 10, 1000), 3.0), (profile("b", 30, 2000), 1.0)])
    assert mixed.agent_turns.mean == pytest.approx(15.0, rel=1e-3)  # 3/4 x 10 + 1/4 x 30
    assert mixed.agent_turns.percentiles[0.0] == 10 and mixed.agent_turns.percentiles[100.0] == 30
    assert mixed.system_tokens == 1250 and mixed.conversations == 10
    assert mixed.name == "a (75%) + b (25%)"
    assert mix([(profile("a", 10, 1000), 1.0)]).name == "a"
    with pytest.raises(ValueError):
        mix([(profile("a", 10, 1000), 0.0)])


def test_the_default_is_the_shipped_profiles_of_the_domains_or_none(tmp_path):
    both = default_profile({"retail": 74, "airline": 30})
    retail = RolloutProfile.load(os.path.join(PROFILES, "tau2-retail.json"))
    airline = RolloutProfile.load(os.path.join(PROFILES, "tau2-airline.json"))
    assert both.name == "tau2-airline (29%) + tau2-retail (71%)"
    want = (74 * retail.agent_turns.mean + 30 * airline.agent_turns.mean) / 104
    assert both.agent_turns.mean == pytest.approx(want, rel=0.02)
    assert default_profile({"retail": 1}).name == "tau2-retail"
    assert default_profile({"builtin": 200}) is None  # no shipped profile: plan from a run directory
    (tmp_path / "tau2-retail.json").write_text("{not json")
    with pytest.raises(Exception, match="shipped profile of retail"):
        default_profile({"retail": 1}, directory=str(tmp_path))
