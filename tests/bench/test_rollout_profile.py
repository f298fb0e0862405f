"""`python -m muajax.bench rollout --quick`: the τ2-profile rollout in both engine modes.

No timing is asserted. The counts must add up: every sampled token is a decode token, every
token fed to a conversation (its prompt past the shared system pages, its replies) is an
extend token, the engine computed at least as many positions as it had real tokens, and
the ratios the bench reports are those counts' ratios.
"""
import math

from tests.bench.test_engine_benches import positive, run_bench

MODE_KEYS = ("extend_computed_over_real", "decode_computed_over_real", "busy_share", "wall_s", "device_s",
             "calls", "extend_calls", "decode_calls", "extend_tokens", "extend_positions", "decode_tokens",
             "decode_positions", "prefix_hits", "prefix_prefill_tokens", "prefix_tokens", "compile_s")


def test_rollout_quick_counts_real_and_computed_positions_in_both_modes():
    result, stdout = run_bench("rollout")
    work, modes = result["workload"], result["modes"]
    assert set(modes) == {"fixed", "packed"} and result["mode"] == "packed"
    assert work["profile"] == "tau2-retail" and work["conversations"] == 4 and work["user_replies"] > 0
    n, sampled = work["conversations"], work["sampled_tokens"]
    for name, m in modes.items():
        assert all(key in m and m[key] is not None for key in MODE_KEYS), (name, m)
        assert m["decode_tokens"] == sampled  # every drawn agent token was sampled and counted
        shared = m["prefix_tokens"]
        assert 0 < shared <= work["system_prompt_tokens"] and m["prefix_hits"] == n
        assert m["prefix_prefill_tokens"] == shared and m["preemptions"] == 0
        # fed tokens: the shared pages once, each prompt past them and every reply; the last
        # token of each turn's input is fed by the decode
        fed = work["real_tokens"] - sampled - n * shared
        assert m["extend_tokens"] == shared + fed - n, (name, m["extend_tokens"], shared, fed)
        assert m["extend_positions"] >= m["extend_tokens"] > 0 and m["decode_positions"] >= m["decode_tokens"] > 0
        assert math.isclose(m["extend_computed_over_real"], m["extend_positions"] / m["extend_tokens"])
        assert math.isclose(m["decode_computed_over_real"], m["decode_positions"] / m["decode_tokens"])
        assert math.isclose(m["busy_share"], m["device_s"] / m["wall_s"])
        assert 0 < m["busy_share"] <= 1 and m["calls"] == m["extend_calls"] + m["decode_calls"] > 0
    fixed, packed = modes["fixed"], modes["packed"]
    assert fixed["engine_kwargs"]["batch_rows"] == n  # today's rollout.deterministic: a row per conversation
    # one row per conversation in every call pads what a turn arriving alone needs
    assert packed["extend_positions"] < fixed["extend_positions"]
    for key in ("extend_computed_over_real", "decode_computed_over_real", "busy_share", "wall_s"):
        assert result[key] == packed[key] and result[f"fixed_{key}"] == fixed[key]
        assert math.isclose(result[f"{key}_ratio"], packed[key] / fixed[key])
        assert positive(result[key])
    assert result["targets"] == {"extend_computed_over_real": 1.5, "decode_computed_over_real": 1.3}
    assert "fixed rows today" in stdout
