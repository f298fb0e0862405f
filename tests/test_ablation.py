"""`python -m muajax.ablation`: the three arms per seed, their mean and spread, a chart."""
import json
import os

import pytest

from muajax import ablation
from muajax.ablation import draw, summarize, table
from tests.support.tiny_models import arch_override

TINY = ["model.hf_dir=null", "model.vocab=domain", arch_override(),
        "env.builtin_users=12", "env.builtin_test_users=2", "env.builtin_train_tasks=8", "env.builtin_test_tasks=3",
        "sft.steps=2", "sft.batch_size=4", "rollout.n_per_task=2", "rollout.tasks_per_step=2", "rollout.max_turns=3",
        "rollout.max_new_tokens_per_turn=8", "rollout.max_context=1536", "grpo.steps=1", "grpo.microbatch_size=null",
        "metrics.tensorboard=false"]


def fake(seed, rl, sft, both, floor=0.5):
    return {"seed": seed, "floor_success": floor, "rl_only": {"success": rl, "confirm_rate": None},
            "sft_only": {"success": sft, "confirm_rate": 0.25}, "sft_grpo": {"success": both, "confirm_rate": 0.75}}


def test_mean_and_spread_per_arm_and_an_undefined_rate_is_left_out(tmp_path):
    per_seed = [fake(0, 0.4, 0.6, 0.8), fake(1, 0.5, 0.7, 0.9)]
    stats = summarize(per_seed)
    assert stats["sft_grpo"]["success"] == {"mean": pytest.approx(0.85), "min": 0.8, "max": 0.9, "n": 2}
    assert stats["rl_only"]["confirm_rate"]["mean"] is None and stats["rl_only"]["confirm_rate"]["n"] == 0
    text = table(per_seed, stats)
    assert "SFT then GRPO | 0.850 (0.80–0.90)" in text and "never writes (floor) | 0.500" in text
    draw(per_seed, stats, str(tmp_path / "a.png"))
    assert os.path.getsize(tmp_path / "a.png") > 5000


def test_one_seed_end_to_end(tmp_path, capsys):
    assert ablation.main(["--seeds", "3", "--out", str(tmp_path), *TINY]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    (seed,) = result["per_seed"]
    assert seed["seed"] == 3 and 0 <= seed["sft_grpo"]["success"] <= 1 and 0 <= seed["rl_only"]["success"] <= 1
    assert seed["floor_success"] is not None
    assert os.path.isfile(result["png"]) and os.path.isfile(tmp_path / "ablation.json")
    for name in ("seed3-sft-grpo", "seed3-rl-only"):  # each arm is a real run with its own folder
        assert os.path.isfile(tmp_path / name / "eval_grpo.json")
    assert not os.path.exists(tmp_path / "seed3-rl-only" / "eval_sft.json")


def test_bad_seeds_and_a_failing_run_are_reported(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ablation.main(["--seeds", "1", "1"])
    assert ablation.main(["--seeds", "0", "--out", str(tmp_path), "grpo.no_such_key=1"]) == 1
    assert "unknown key 'grpo.no_such_key'" in capsys.readouterr().err
