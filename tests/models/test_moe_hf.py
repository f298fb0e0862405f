"""Qwen3-MoE checkpoints in and out (muajax.models.hf): both of HF's expert layouts read, the
Hub's per-expert layout written bit for bit, transformers reading the export back, the
config's MoE keys and the layouts muajax refuses, and a sharded load onto a mesh."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from muajax.models.hf import config_from_hf, config_to_hf, load_config, load_params, save_hf
from muajax.models.safetensors_io import CheckpointError
from tests.support import workers
from tests.support.tiny_models import MOE_CONFIG, load_hf_model, make_hf_moe_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def all_tensors(path):
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        bits = lambda t: t.view(torch.uint8) if t.dtype == torch.bfloat16 else t
        assert torch.equal(bits(a[name]), bits(b[name])), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_to_muajax_to_hf_is_bit_identical(tmp_path, dtype):
    src = make_hf_moe_checkpoint(str(tmp_path / "src"), seed=2, max_shard_size="100KB", dtype=dtype)
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in all_tensors(src)  # the Hub's layout
    params, cfg = load_params(src)
    out = str(tmp_path / "out")
    files = save_hf(params, cfg, out, dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                    max_shard_bytes=100_000)
    assert len(files) > 1
    assert_same_tensors(all_tensors(src), all_tensors(out))
    hf_cfg = json.load(open(os.path.join(out, "config.json")))
    assert hf_cfg["architectures"] == ["Qwen3MoeForCausalLM"] and hf_cfg["num_experts"] == 8


def test_the_fused_layout_loads_the_same_params_and_is_written_per_expert(tmp_path):
    """transformers 5's fused `gate_up_proj` / `down_proj` (save_original_format=False) and the
    per-expert layout of the same model load to the same params; the export is per expert."""
    per_expert = make_hf_moe_checkpoint(str(tmp_path / "per_expert"), seed=4)
    fused = make_hf_moe_checkpoint(str(tmp_path / "fused"), seed=4, fused=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in all_tensors(fused)
    a, _ = load_params(per_expert)
    b, cfg = load_params(fused)
    for name in ("router", "expert_gate", "expert_up", "expert_down"):
        assert np.array_equal(np.asarray(a["layers"][name]), np.asarray(b["layers"][name])), name
    save_hf(b, cfg, str(tmp_path / "out"))
    assert_same_tensors(all_tensors(per_expert), all_tensors(str(tmp_path / "out")))


def test_exported_directory_loads_in_transformers_with_same_logits(tmp_path):
    src = make_hf_moe_checkpoint(str(tmp_path / "src"), seed=5, norm_topk_prob=False)
    params, cfg = load_params(src)
    save_hf(params, cfg, str(tmp_path / "out"))
    tokens = torch.tensor(np.random.RandomState(0).randint(0, 256, (2, 7)))
    with torch.no_grad():
        want = load_hf_model(src)(tokens).logits
        model = load_hf_model(str(tmp_path / "out"))
        got = model(tokens).logits
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.norm_topk_prob is False
    assert torch.equal(want, got)


def test_the_config_round_trips_and_reads_transformers_5_s_num_local_experts():
    cfg = MOE_CONFIG.replace(router_aux_loss_coef=0.01)
    hf = config_to_hf(cfg, "float32")
    assert config_from_hf(hf) == cfg
    assert hf["model_type"] == "qwen3_moe" and hf["num_experts"] == 8 and hf["mlp_only_layers"] == []
    hf5 = {k: v for k, v in hf.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert config_from_hf(hf5) == cfg
    dense = config_from_hf(config_to_hf(cfg.replace(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                                                    norm_topk_prob=False), "float32"))
    assert not dense.is_moe


@pytest.mark.parametrize("change,message", [
    (dict(mlp_only_layers=[1]), "mlp_only_layers=\\[1\\].*every layer sparse"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
], ids=["mlp_only_layers", "decoder_sparse_step"])
def test_layouts_with_dense_layers_among_the_experts_are_refused(tmp_path, change, message):
    path = make_hf_moe_checkpoint(str(tmp_path / "c"), seed=0, num_hidden_layers=1)
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump(cfg | change, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=message):
        load_config(path)


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    path = make_hf_moe_checkpoint(str(tmp_path / "c"), seed=0, num_hidden_layers=1)
    tensors = all_tensors(path)
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts.5.up_proj.weight.*missing"):
        load_params(path)


def test_loaded_onto_8_devices_by_the_logical_axes(tmp_path):
    """Tensor by tensor onto a (fsdp 2, tensor 2, expert 2) mesh: the experts split as the
    rules say, the values and logits those of one device, the export the same files."""
    src = make_hf_moe_checkpoint(str(tmp_path / "src"), seed=6)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, workers.path("moe_sharded_load.py"), src, str(tmp_path / "out"),
                           "1,2,2,2"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["devices"] == 8 and result["equal_to_one_device"]
    for name, (got, want, blocks) in result["specs"].items():
        assert got == want, name
    assert "expert" in result["specs"]["expert_gate"][0] and result["specs"]["expert_gate"][2] > 1
    from muajax.models.qwen3 import forward_jit

    params, cfg = load_params(src)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (4, 9))
    np.testing.assert_allclose(np.asarray(result["logits"]), np.asarray(forward_jit(params, cfg, tokens)[0]),
                               atol=1e-5)
    assert_same_tensors(all_tensors(src), all_tensors(str(tmp_path / "out")))
