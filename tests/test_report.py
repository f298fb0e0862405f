import json
import math
import os
import subprocess
import sys

import matplotlib.image as mpimg
import pytest

from muajax import report
from muajax.train.metrics import MetricsWriter


def grpo_record(step, **override):
    """One GRPO step's record with the key names the trainer writes (values follow `step`)."""
    rec = {
        "reward": step / 10, "partial": 0.5, "all_correct_ratio": step / 20, "all_wrong_ratio": 1 - step / 20,
        "turns": 20.0 + step, "response_tokens": 300.0 - step, "calls": {"get_order": step * 0.5, "refund": 1.0},
        "kl": step * 1e-4, "entropy": 1.0 - step / 100, "grad_norm": 10.0 ** -step, "loss": 0.1,
    }
    rec.update(override)
    return rec


def last_json(stdout):
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    return json.loads(lines[-1])


@pytest.fixture
def run_dir(tmp_path):
    """Steps 1-5, then a restart from the step-3 checkpoint written by an appending writer
    (no --resume): steps 4 and 5 appear twice, and the later records must win."""
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in range(1, 6):
            w.write(step, grpo_record(step))
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(4, grpo_record(4, reward=0.9))
        w.write(5, grpo_record(5, reward=0.75, entropy=math.nan))
        w.write(6, grpo_record(6, reward=0.8, entropy=float("nan"), grad_norm=float("inf")))
    with MetricsWriter(tmp_path / "sft", tensorboard=False) as w:
        for step in range(1, 11):
            w.write(step, {"loss": 5.0 / step, "nll": 5.0 / step, "entropy": 2.0})
    return tmp_path


def test_panel_png_and_figures_from_a_known_sequence(run_dir, capsys):
    assert report.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    result = last_json(out)
    png = run_dir / report.DEFAULT_NAME
    assert result["png"] == str(png) and png.is_file()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = mpimg.imread(str(png))
    assert image.shape[:2] == (1200, 1500)  # 12 × 15 inches at the default 100 dpi
    assert image.std() > 0  # something was drawn

    fig = result["figures"]
    assert result["grpo_steps"] == 6 and result["sft_steps"] == 10
    assert result["replaced_records"] == 2  # steps 4 and 5 written twice
    assert fig["reward"]["first"] == pytest.approx(0.1) and fig["reward"]["last"] == pytest.approx(0.8)
    assert fig["all_correct_ratio"]["last"] == pytest.approx(6 / 20)
    assert fig["all_wrong_ratio"]["first"] == pytest.approx(1 - 1 / 20)
    assert fig["turns"] == {"first": 21.0, "last": 26.0, "first_step": 1, "last_step": 6, "points": 6,
                            "nonfinite": 0}
    assert fig["response_tokens"]["last"] == 294.0
    assert fig["calls/get_order"]["first"] == 0.5 and fig["calls/get_order"]["last"] == 3.0
    assert fig["calls/refund"]["last"] == 1.0
    assert fig["kl"]["last"] == pytest.approx(6e-4)
    # Entropy is NaN at steps 5 (the record that won) and 6: the last finite value is step 4's.
    assert fig["entropy"]["last"] == pytest.approx(0.96) and fig["entropy"]["last_step"] == 4
    assert fig["entropy"]["nonfinite"] == 2 and fig["entropy"]["points"] == 4
    assert fig["grad_norm"]["last"] == pytest.approx(1e-5) and fig["grad_norm"]["nonfinite"] == 1
    assert fig["sft/loss"]["first"] == 5.0 and fig["sft/loss"]["last"] == 0.5
    assert result["not_logged"] == []
    # One readable summary line per curve, before the JSON line.
    assert "reward: 0.1 → 0.8 (steps 1–6, 6 points)" in out
    assert "entropy: 0.99 → 0.96 (steps 1–4, 4 points, 2 non-finite)" in out
    assert "replaced by a later one" in out


def test_missing_metrics_say_not_logged_and_out_path(tmp_path, capsys):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in (1, 2, 3):
            rec = grpo_record(step)
            del rec["kl"], rec["calls"]  # e.g. β = 0 and no tool call ever parsed
            w.write(step, rec)
    out_png = tmp_path / "plots" / "dyn.png"
    assert report.main([str(tmp_path), "--out", str(out_png), "--dpi", "50"]) == 0
    out = capsys.readouterr().out
    result = last_json(out)
    assert result["png"] == str(out_png)
    assert mpimg.imread(str(out_png)).shape[:2] == (600, 750)
    assert result["not_logged"] == ["calls/*", "kl"]
    assert result["sft_steps"] == 0 and "sft/loss" not in result["figures"]
    assert "kl: not logged" in out and "calls/*: not logged" in out
    assert not (tmp_path / report.DEFAULT_NAME).exists()


@pytest.mark.parametrize("content, why", [
    (None, "no such file"),
    ("", "no metric records"),
    ("\n\n", "no metric records"),
])
def test_missing_or_empty_metrics_exit_2(tmp_path, capsys, content, why):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert report.main([str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert why in captured.err and captured.err.startswith("error: ")
    assert last_json(captured.out) == {"png": None, "error": captured.err[len("error: "):].strip()}
    assert not (tmp_path / report.DEFAULT_NAME).exists()


def test_unparseable_lines_only_and_bad_arguments_exit_2(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5\n[1, 2]\n')  # cut off; not a record
    with pytest.warns(RuntimeWarning, match="skipped 2 malformed line"):
        assert report.main([str(tmp_path)]) == 2
    assert "no metric records" in capsys.readouterr().err
    assert report.main([str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(2, grpo_record(2))  # a crash-cut line above is skipped, the record after it is read
    assert report.main([str(tmp_path), "--out", str(tmp_path / "x.jpg")]) == 2
    assert "must end in .png" in capsys.readouterr().err
    assert report.main([str(tmp_path), "--dpi", "5"]) == 2
    assert "--dpi" in capsys.readouterr().err
    with pytest.warns(RuntimeWarning, match="malformed"):
        assert report.main([str(tmp_path)]) == 0
    assert last_json(capsys.readouterr().out)["figures"]["reward"]["first"] == 0.2


def test_module_entry_point(run_dir):
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # no display and no backend setting: the module must still draw
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "muajax.report", str(run_dir), "--out", str(run_dir / "p.png")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = last_json(proc.stdout)
    assert result["png"] == str(run_dir / "p.png") and os.path.isfile(result["png"])
    assert result["figures"]["reward"]["last"] == pytest.approx(0.8)
    bad = subprocess.run([sys.executable, "-m", "muajax.report", str(run_dir / "sft" / "none")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no such run directory" in bad.stderr
