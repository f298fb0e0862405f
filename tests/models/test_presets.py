"""Named Qwen3 presets: real architectures, YAML and built-in copies agree, clear errors."""
import pytest
import yaml

from muajax.models import presets
from muajax.models.hf import config_from_hf, config_to_hf
from muajax.models.presets import UnknownPresetError, list_presets, preset_config

# (hidden, intermediate, layers, heads, kv heads, tied, total params in billions as Qwen publishes them)
REAL = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True, 0.6),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, True, 1.7),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True, 4.0),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False, 8.2),
    "qwen3-14b": (5120, 17408, 40, 40, 8, False, 14.8),
    "qwen3-32b": (5120, 25600, 64, 64, 8, False, 32.8),
}


# Mixtures of experts: (hidden, moe width, layers, heads, kv heads, experts, active, total and
# active params in billions as Qwen publishes them)
REAL_MOE = {
    "qwen3-30b-a3b": (2048, 768, 48, 32, 4, 128, 8, 30.5, 3.3),
    "qwen3-235b-a22b": (4096, 1536, 94, 64, 4, 128, 8, 235.1, 22.2),
}


def test_lists_the_sizes_smallest_first():
    assert list_presets() == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-30b-a3b",
                              "qwen3-32b", "qwen3-235b-a22b"]


@pytest.mark.parametrize("name", sorted(REAL_MOE))
def test_moe_preset_matches_the_real_architecture(name):
    d, f, layers, heads, kv, experts, active, total, active_billions = REAL_MOE[name]
    cfg = preset_config(name)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (d, f, layers, heads, kv, experts,
                                                                               active, True)
    assert round(cfg.num_params() / 1e9, 1) == total
    # Qwen writes 3.3B for 30B-A3B's 3.35B active (embedding and head included)
    assert abs(cfg.num_params(active=True) / 1e9 - active_billions) < 0.06


def test_moe_config_refuses_bad_expert_counts():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        preset_config("qwen3-30b-a3b", num_experts_per_tok=129)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        preset_config("qwen3-30b-a3b", moe_intermediate_size=0)


@pytest.mark.parametrize("name", sorted(REAL))
def test_preset_matches_the_real_architecture(name):
    d, f, layers, heads, kv, tied, billions = REAL[name]
    cfg = preset_config(name)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.tie_word_embeddings) == (d, f, layers, heads, kv, tied)
    assert (cfg.vocab_size, cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        151936, 128, 1_000_000.0, 1e-6, 40960)
    assert round(cfg.num_params() / 1e9, 1) == billions


@pytest.mark.parametrize("name", sorted(REAL) + sorted(REAL_MOE))
def test_yaml_file_and_builtin_copy_agree(name):
    # The built-in dict is what a wheel install (no configs/ folder) uses; drift would be silent.
    path = presets.PRESETS_DIR / f"{name}.yaml"
    assert path.is_file(), path
    with open(path) as fh:
        assert yaml.safe_load(fh) == presets.BUILTIN[name]


def test_overrides_and_hub_ids():
    cfg = preset_config("Qwen/Qwen3-8B", param_dtype="bfloat16", dtype="bfloat16", remat="full")
    assert (cfg.hidden_size, cfg.param_dtype, cfg.dtype, cfg.remat) == (4096, "bfloat16", "bfloat16", "full")
    assert preset_config("qwen3-0.6b", num_layers=2).num_layers == 2


def test_preset_survives_an_hf_config_round_trip():
    cfg = preset_config("qwen3-14b")
    assert config_from_hf(config_to_hf(cfg, "bfloat16")) == cfg


def test_unknown_name_lists_known_presets_and_suggests():
    with pytest.raises(UnknownPresetError, match=r"unknown model preset 'qwen3-8bb'.*did you mean 'qwen3-8b'.*qwen3-32b"):
        preset_config("qwen3-8bb")
    with pytest.raises(ValueError, match="known presets: qwen3-0.6b, qwen3-1.7b"):
        preset_config("llama-7b")


def test_unknown_override_is_named():
    with pytest.raises(ValueError, match=r"unknown override\(s\) \['hidden'\]"):
        preset_config("qwen3-4b", hidden=3)


def test_falls_back_to_builtin_without_the_configs_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(presets, "PRESETS_DIR", tmp_path / "absent")
    assert list_presets() == sorted(list(REAL) + list(REAL_MOE), key=presets._size_key)
    assert preset_config("qwen3-32b").num_layers == 64
    assert "built-in" in presets.presets_source()


def test_yaml_folder_wins_and_new_files_are_found(monkeypatch, tmp_path):
    (tmp_path / "qwen3-8b.yaml").write_text(yaml.safe_dump({**presets.BUILTIN["qwen3-8b"], "num_layers": 3}))
    (tmp_path / "tiny-test.yaml").write_text(yaml.safe_dump({**presets.BUILTIN["qwen3-0.6b"], "hidden_size": 64}))
    monkeypatch.setattr(presets, "PRESETS_DIR", tmp_path)
    assert preset_config("qwen3-8b").num_layers == 3
    assert preset_config("tiny-test").hidden_size == 64
    assert "tiny-test" in list_presets()


def test_bad_yaml_files_name_the_file_and_key(monkeypatch, tmp_path):
    monkeypatch.setattr(presets, "PRESETS_DIR", tmp_path)
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({**presets.BUILTIN["qwen3-4b"], "dtype": "bfloat16"}))
    with pytest.raises(ValueError, match=r"a\.yaml: unknown key\(s\) \['dtype'\].*pass them as overrides"):
        preset_config("a")
    (tmp_path / "b.yaml").write_text("- not\n- a mapping\n")
    with pytest.raises(ValueError, match=r"b\.yaml: expected a mapping"):
        preset_config("b")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"hidden_size": 8}))
    with pytest.raises(ValueError, match=r"c\.yaml: preset 'c' is missing required field\(s\) \['head_dim'"):
        preset_config("c")
