"""HF checkpoint loading and export: sharded files, bit-identical round trip, clear errors."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from muajax.models.hf import load_config, load_params, save_hf
from muajax.models.safetensors_io import CheckpointError
from tests.support.tiny_models import make_hf_checkpoint


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sharded"))
    make_hf_checkpoint(path, seed=1, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 3
    return path


def all_tensors(path):
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_to_muajax_to_hf_is_bit_identical(tmp_path, dtype):
    src = make_hf_checkpoint(str(tmp_path / "src"), seed=2, max_shard_size="40KB", dtype=dtype)
    params, cfg = load_params(src)  # params in float32 even for a bf16 checkpoint: exact widening
    out = str(tmp_path / "out")
    files = save_hf(params, cfg, out, dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                    max_shard_bytes=50_000)
    assert len(files) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    a, b = all_tensors(src), all_tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == torch.bfloat16 else a[name],
                           b[name].view(torch.uint8) if b[name].dtype == torch.bfloat16 else b[name]), name


def test_exported_directory_loads_in_transformers_with_same_logits(tmp_path, sharded):
    import transformers

    params, cfg = load_params(sharded)
    save_hf(params, cfg, str(tmp_path))
    tokens = torch.tensor(np.random.RandomState(0).randint(0, 256, (2, 7)))
    with torch.no_grad():
        want = transformers.Qwen3ForCausalLM.from_pretrained(sharded)(tokens).logits
        got = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path))(tokens).logits
    assert torch.equal(want, got)


def test_both_config_formats_are_accepted(tmp_path, sharded):
    cfg = load_config(sharded)  # transformers 5 writes rope_parameters
    hub = json.load(open(os.path.join(sharded, "config.json")))
    hub.pop("rope_parameters")
    hub["rope_theta"] = cfg.rope_theta
    os.makedirs(tmp_path / "hub")
    json.dump(hub, open(tmp_path / "hub" / "config.json", "w"))
    assert load_config(str(tmp_path / "hub")) == cfg


def copy_of(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def shard_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_missing_shard_names_the_file(tmp_path, sharded):
    path = copy_of(sharded, tmp_path / "c")
    victim = shard_files(path)[1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(CheckpointError, match=victim):
        load_params(path)


def test_truncated_shard_names_file_and_tensor(tmp_path, sharded):
    path = copy_of(sharded, tmp_path / "c")
    victim = os.path.join(path, shard_files(path)[2])
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"extends past the end.*|truncated") as info:
        load_params(path)
    assert shard_files(path)[2] in str(info.value) and "tensor" in str(info.value)


def test_garbage_header_is_reported(tmp_path, sharded):
    path = copy_of(sharded, tmp_path / "c")
    victim = os.path.join(path, shard_files(path)[0])
    with open(victim, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_params(path)


def test_not_qwen3_config(tmp_path, sharded):
    path = copy_of(sharded, tmp_path / "c")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="not a Qwen3 checkpoint"):
        load_params(path)


def test_shape_mismatch_names_file_and_tensor(tmp_path, sharded):
    path = copy_of(sharded, tmp_path / "c")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["intermediate_size"] = 80
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"model-\d+-of-\d+\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"):
        load_params(path)


def test_missing_tensor_is_reported(tmp_path):
    import transformers

    path = make_hf_checkpoint(str(tmp_path / "m"), seed=3)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.*missing"):
        load_params(path)
    del transformers
