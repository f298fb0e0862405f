"""Every run config shipped in configs/ loads and validates."""
import glob
import math
import os

import pytest
import yaml

from muajax.config.schema import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = sorted(glob.glob(os.path.join(ROOT, "configs", "runs", "qwen3-*.yaml")))


@pytest.mark.parametrize("path", RUNS, ids=os.path.basename)
def test_run_config_loads(path):
    cfg = load_config(path)
    tau1 = (cfg.env.domain, cfg.env.domains, cfg.env.eval_split) == ("tau1-retail", (), "tau2-test")  # -tau1.yaml
    assert cfg.model.hf_dir and (cfg.env.domains == ("retail", "airline") or tau1)
    assert cfg.user.kind == "openai" and cfg.rollout.n_per_task == 8 and cfg.grpo.kl_coef == 0.001


def test_embedded_default_loads():
    cfg = load_config(os.path.join(ROOT, "configs", "embedded-cpu.yaml"))
    assert cfg.env.domain == "builtin" and cfg.user.kind == "scripted" and cfg.run.stages == ("sft", "grpo")


def test_there_are_real_scale_configs_for_each_size_and_hardware():
    names = {os.path.basename(p) for p in RUNS}
    for size in ("8b", "14b", "32b"):
        for hw in ("v5p", "v6e", "h100"):
            # 32B's train state, reference and engine copy alone exceed one 8x H100 node (docs/scale.md)
            assert (f"qwen3-{size}-tau2-{hw}.yaml" in names) == ((size, hw) != ("32b", "h100"))


def test_the_embedded_default_starts_from_the_shipped_base_which_never_saw_its_shop():
    import json

    from muajax.models.vocab import DomainTokenizer
    from muajax.runtime.policy import load_policy
    from muajax.domains.builtin.base_record import BASE_META_FILE

    cfg = load_config(os.path.join(ROOT, "configs", "embedded-cpu.yaml"))
    assert cfg.model.hf_dir == os.path.join(ROOT, "configs", "embedded-base") and cfg.model.vocab == "domain"
    meta = json.load(open(os.path.join(cfg.model.hf_dir, BASE_META_FILE)))
    assert cfg.env.builtin_seed not in meta["shop_seeds"]
    assert meta["command"].startswith("python -m muajax.pretrain")
    policy = load_policy(cfg.model.hf_dir)
    assert isinstance(policy.tokenizer, DomainTokenizer) and policy.model_cfg.vocab_size == 512
    assert cfg.rollout.max_context <= policy.model_cfg.max_position_embeddings


def test_the_shipped_base_is_a_qwen3_checkpoint_transformers_agrees_with():
    import numpy as np
    import torch
    import transformers

    from muajax.models.hf import load_config as load_hf_config, load_params
    from muajax.models.qwen3 import forward

    path = os.path.join(ROOT, "configs", "embedded-base")
    tokens = np.random.RandomState(0).randint(0, 478, (2, 24))
    with torch.no_grad():
        want = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor(tokens)).logits
    params, cfg = load_params(path, load_hf_config(path))
    got, _ = forward(params, cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", [p for p in RUNS if p.endswith(("-v5p.yaml", "-v6e.yaml", "-h100.yaml"))],
                         ids=os.path.basename)
def test_hardware_configs_never_pad_a_microbatch(path):
    """On its slice every microbatch is whole rows on each data-parallel device, so the 256
    rollouts of a step (and SFT's 128 conversations) are never padded with empty rows."""
    from muajax.runtime.host_batch import batch_divisor, check_microbatch_sizes, microbatch_count

    cfg = load_config(path)
    sizes = cfg.mesh.sizes()
    assert -1 not in sizes.values(), "a hardware config names its slice's mesh"

    class SliceMesh:
        shape = sizes

    check_microbatch_sizes(cfg, SliceMesh())
    rows = cfg.rollout.n_per_task * cfg.rollout.tasks_per_step
    micro = microbatch_count(rows, cfg.grpo.microbatch_size, SliceMesh(), "grpo.microbatch_size")
    assert rows % batch_divisor(SliceMesh(), micro) == 0
    assert cfg.grpo.logits_chunk and cfg.sft.logits_chunk and cfg.run.compilation_cache_dir


def test_the_tau2_smoke_config_needs_only_the_user_endpoint():
    from muajax.config.schema import ConfigError

    path = os.path.join(ROOT, "configs", "smoke-tau2.yaml")
    with pytest.raises(ConfigError, match="'user.model' is required"):
        load_config(path)
    cfg = load_config(path, ["user.base_url=http://127.0.0.1:9/v1", "user.model=M"])
    assert cfg.run.stages == ("sft", "grpo") and cfg.env.domains == ("retail", "airline")
    assert cfg.sft.data == os.path.join(ROOT, "configs", "smoke-tau2-sft.jsonl") and os.path.isfile(cfg.sft.data)
    assert cfg.grpo.steps == 2 and cfg.env.max_train_tasks == 1 and cfg.rollout.tasks_per_step == 2


@pytest.mark.parametrize("path", [p for p in RUNS if p.endswith("-v6e.yaml")], ids=os.path.basename)
def test_v6e_configs_name_the_v6e_slice_their_header_names(path):
    from muajax.planning import topology

    cfg = load_config(path)
    spec = topology.parse_topology(cfg.mesh.topology)  # what `python -m muajax.plan --config` compiles for
    assert spec.platform == "tpu" and spec.generation == "v6e"
    assert math.prod(cfg.mesh.sizes().values()) == spec.chips
    with open(path) as f:
        header = f.readline()
    assert f"TPU {cfg.mesh.topology} slice ({spec.chips} chips" in header
    if topology.libtpu_available():  # the slice's chips take the mesh (a 4x4 lays out axes of 4 or 16 only)
        from muajax import parallel

        mesh = parallel.make_mesh(**cfg.mesh.sizes(), devices=topology.tpu_devices(spec))
        assert mesh.size == spec.chips


@pytest.mark.parametrize("path", [p for p in RUNS if p.endswith("-h100.yaml")], ids=os.path.basename)
def test_h100_configs_set_the_share_of_each_gpu_their_plan_is_judged_against(path):
    from muajax.planning.topology import judged_hbm, parse_topology

    cfg = load_config(path)
    with open(path) as f:
        own = yaml.safe_load(f)
    fraction = own["run"]["gpu_memory_fraction"]  # the file's own, not a default it inherits
    assert cfg.run.gpu_memory_fraction == fraction
    spec = parse_topology(cfg.mesh.topology)
    hbm, _ = judged_hbm(spec.chip, fraction)
    assert spec.gpu == "h100" and hbm == int(fraction * spec.chip.hbm_bytes) < spec.chip.hbm_bytes
