import dataclasses
from typing import Literal, Optional

import pytest

from muajax import parallel
from muajax.settings import fields as F
from muajax.settings import loader as L
from muajax.config import schema as C
from muajax.config.schema import ConfigError, load_config


def write(path, text):
    path.write_text(text)
    return path


def test_defaults_match_paper():
    cfg = load_config()
    g, r = cfg.grpo, cfg.rollout
    assert (r.n_per_task, r.tasks_per_step, r.max_turns) == (8, 32, 30)
    assert (r.max_new_tokens_per_turn, r.max_context) == (1024, 32768)
    assert (r.temperature, r.top_p, r.end_on_malformed_call) == (1.0, 1.0, False)
    assert g.learning_rate == 1e-6 and g.schedule == "constant"
    assert g.betas == (0.9, 0.999) and g.weight_decay == 0.01 and g.grad_clip == 1.0
    assert (g.clip_low, g.clip_high, g.dual_clip) == (0.2, 0.2, 3.0)
    assert (g.kl_coef, g.kl_estimator, g.kl_clamp) == (0.001, "k3", 10.0)
    assert (g.agg, g.ratio_level, g.advantage_scale, g.advantage_eps) == ("token-mean", "token", "std", 1e-6)
    assert g.ppo_epochs == 1 and g.dynamic_sampling is False and g.epochs in (25, 30)
    s = cfg.sft
    assert (s.epochs, s.batch_size, s.learning_rate, s.schedule) == (2, 128, 5e-6, "warmup_cosine")
    assert cfg.user.temperature == 0.0 and cfg.user.api_key_env == "OPENAI_API_KEY"
    assert (cfg.eval.trials, cfg.eval.temperature, cfg.eval.communicate_info) == (4, 0.0, True)
    assert cfg.checkpoint.keep == 3
    assert cfg == C.TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.grpo.learning_rate = 1.0  # type: ignore[misc]


def test_yaml_and_overrides(tmp_path):
    f = write(tmp_path / "run.yaml", """
run: {name: exp1, stages: [grpo]}
grpo:
  learning_rate: 2e-6        # PyYAML reads this as a string; it must still become a float
  clip_high: 0.28
  dual_clip: null
rollout: {n_per_task: 4}
""")
    cfg = load_config(f, ["grpo.kl_coef=0", "rollout.tasks_per_step=16", "grpo.betas=[0.8, 0.99]",
                          "run.name=exp2", "grpo.steps=1e3"])
    assert cfg.run.name == "exp2" and cfg.run.stages == ("grpo",)
    assert cfg.grpo.learning_rate == 2e-6 and isinstance(cfg.grpo.learning_rate, float)
    assert cfg.grpo.clip_high == 0.28 and cfg.grpo.dual_clip is None and cfg.grpo.kl_coef == 0.0
    assert cfg.grpo.betas == (0.8, 0.99) and cfg.grpo.steps == 1000
    assert (cfg.rollout.n_per_task, cfg.rollout.tasks_per_step) == (4, 16)
    assert cfg.grpo.clip_low == 0.2  # untouched fields keep defaults
    assert cfg.run_dir.endswith("exp2") and cfg.checkpoint_dir.endswith("checkpoints")


def test_parse_overrides():
    assert L.parse_overrides(["a.b=3", "c=[1,2]", "d=null", "e.f.g=x y", "h=", "a.c=true"]) == {
        "a": {"b": 3, "c": True}, "c": [1, 2], "d": None, "e": {"f": {"g": "x y"}}, "h": ""}
    with pytest.raises(ConfigError, match="'noequals'.*key=value"):
        L.parse_overrides(["noequals"])
    with pytest.raises(ConfigError, match="malformed key"):
        L.parse_overrides(["a..b=1"])
    with pytest.raises(ConfigError, match="conflicts with an earlier override"):
        L.parse_overrides(["a=1", "a.b=2"])
    with pytest.raises(ConfigError, match="not valid YAML"):
        L.parse_overrides(["a=[1, 2"])
    with pytest.raises(ConfigError, match="list of 'key=value'"):
        L.parse_overrides("a=1")


@pytest.mark.parametrize("override, message", [
    ("grpo.lr=1e-5", r"unknown key 'grpo.lr' \(did you mean 'grpo.learning_rate'\?\)"),
    ("grpo.lerning_rate=1e-5", r"did you mean 'grpo.learning_rate'"),
    ("model.arch.hiden_size=8", r"unknown key 'model.arch.hiden_size' \(did you mean 'model.arch.hidden_size'\?\)"),
    ("env.mcp.servers.a.comand=[x]", r"unknown key 'env.mcp.servers.a.comand' \(did you mean 'env.mcp.servers.a.command'\?\)"),
    ("learning_rate=1e-5", r"unknown key 'learning_rate' \(did you mean 'grpo.learning_rate'\?\)"),
    ("zzz=1", r"unknown key 'zzz' \(known keys: run, model"),
])
def test_unknown_keys_with_suggestions(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_unknown_key_in_yaml_file(tmp_path):
    f = write(tmp_path / "c.yaml", "rollout:\n  max_turn: 10\n")
    with pytest.raises(ConfigError, match=r"'rollout.max_turn' \(did you mean 'rollout.max_turns'"):
        load_config(f)


@pytest.mark.parametrize("override, message", [
    ("grpo.agg=token_mean", r"'grpo.agg' must be one of 'token-mean', .*got 'token_mean' \(did you mean 'token-mean'\?\)"),
    ("grpo.kl_estimator=k4", r"'grpo.kl_estimator' must be one of 'k1', 'k2', 'k3'; got 'k4'"),
    ("run.stages=[sft, ppo]", r"'run.stages\[1\]' must be one of 'sft', 'grpo'; got 'ppo'"),
    ("run.seed=1.5", r"'run.seed' must be an int, got float 1.5"),
    ("run.seed=abc", r"'run.seed' must be an int, got str 'abc'"),
    ("rollout.max_turns=true", r"'rollout.max_turns' must be an int, got bool True"),
    ("metrics.jsonl=1", r"'metrics.jsonl' must be a bool"),
    ("grpo.learning_rate=fast", r"'grpo.learning_rate' must be a float, got str 'fast'"),
    ("grpo.betas=[0.9]", r"'grpo.betas' must have exactly 2 items, got 1"),
    ("grpo.betas=0.9", r"'grpo.betas' must be a list of float"),
    ("grpo.clip_low=null", r"'grpo.clip_low' must not be null \(expected float\)"),
    ("run.name=[a]", r"'run.name' must be a string, got list"),
    ("grpo={lr: 1}", r"unknown key 'grpo.lr'"),
    ("grpo=3", r"'grpo' must be a mapping of GRPOConfig fields, got int 3"),
    ("model.param_dtype=fp16", r"'model.param_dtype' must be one of 'float32', 'bfloat16'"),
])
def test_bad_types_and_choices(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, message", [
    (["grpo.learning_rate=0"], r"'grpo.learning_rate' must be > 0, got 0.0"),
    (["grpo.clip_low=1.2"], r"'grpo.clip_low' must be < 1, got 1.2"),
    (["grpo.dual_clip=0.5"], r"'grpo.dual_clip' must be > 1, got 0.5"),
    (["grpo.betas=[0.9, 1.0]"], r"'grpo.betas\[1\]' must be < 1, got 1.0"),
    (["grpo.grad_clip=0"], r"'grpo.grad_clip' must be > 0, got 0.0"),
    (["grpo.steps=10", "grpo.warmup_steps=10"], r"'grpo.warmup_steps' \(10\) must be smaller than steps \(10\)"),
    (["mesh.data=-1"], r"'mesh.fsdp' is -1 but so is data"),
    (["mesh.tensor=0"], r"'mesh.tensor' must be >= 1 or -1"),
    (["model.preset=qwen3-8b"], r"'model.preset' conflicts.*model.arch=null"),
    (["model.arch=null"], r"set exactly one of .*got none"),
    (["model.arch.num_heads=3"], r"'model.arch.num_heads' \(3\) must be a multiple of num_kv_heads \(2\)"),
    (["rollout.max_new_tokens_per_turn=40000"], r"'rollout.max_new_tokens_per_turn' \(40000\) must be smaller"),
    (["rollout.top_p=0"], r"'rollout.top_p' must be in \(0, 1\], got 0.0"),
    (["rollout.top_p=1.5"], r"'rollout.top_p' must be in \(0, 1\], got 1.5"),
    (["rollout.n_per_task=1"], r"'rollout.n_per_task' must be >= 2 for GRPO"),
    (["grpo.microbatch_size=7"], r"'grpo.microbatch_size' \(7\) must divide the rollout batch .* 256"),
    (["run.stages=[sft]", "env.domain=retail", "user.kind=openai", "user.model=m"], r"'sft.data' is required"),
    (["run.stages=[grpo, sft]", "sft.data=x"], r"'run.stages' must list each stage once, 'sft' \(the cold start\) before 'grpo'"),
    (["run.stages=[]"], r"'run.stages' must list at least one"),
    (["run.stages=[grpo, grpo]"], r"'run.stages' must list each stage once"),
    (["run.name=a/b"], r"'run.name' must be a plain directory name"),
    (["env.builtin_kind_weights={refund: 1}"], r"'env.builtin_kind_weights' .*unknown task kind 'refund'"),
    (["env.builtin_kind_weights={cancel: -1}"], r"'env.builtin_kind_weights' .*finite number >= 0"),
    (["env.builtin_kind_weights={cancel: lots}"], r"'env.builtin_kind_weights.cancel' must be a float, got str 'lots'"),
    (["user.kind=openai"], r"'user.model' is required when user.kind is 'openai'"),
    (["env.domain=mcp"], r"'env.mcp.scenarios' must list at least one scenario file"),
    (["env.mcp.servers.s.url=http://x", "env.mcp.servers.s.command=run"], r"'env.mcp.servers.s.command' conflicts"),
    (["env.mcp.servers.s.args=[x]"], r"'env.mcp.servers.s.command' or 'url' is required"),
    (["env.mcp.servers.s.url=ftp://x"], r"'env.mcp.servers.s.url' must be an http\(s\) URL"),
    (["env.mcp.servers.s.url=http://x", "env.mcp.servers.s.env_vars=[HOME]"],
     r"'env.mcp.servers.s.env_vars' applies only to a stdio server"),
    (["env.mcp.servers.s.command=run", "env.mcp.servers.s.env_vars=[sk-abc]"],
     r"'env.mcp.servers.s.env_vars\[0\]' must be NAME or SERVER_NAME=NAME"),
    (["env.mcp.servers.s.url=http://x", "env.mcp.servers.s.headers_env={Authorization: Bearer abc}"],
     r"'env.mcp.servers.s.headers_env.Authorization' must be the NAME of an environment variable"),
    (["sft.microbatch_size=48"], r"'sft.microbatch_size' \(48\) must divide batch_size \(128\)"),
    (["rollout.max_context=50000"], r"'rollout.max_context' \(50000\) exceeds model.arch.max_position_embeddings"),
    (["metrics.profile_steps=[3, 2]"], r"'metrics.profile_steps' must be \[first, last\] with 1 <= first <= last.*"
                                       r"got \[3, 2\]"),
    (["metrics.profile_steps=[0, 1]"], r"'metrics.profile_steps' must be \[first, last\].*got \[0, 1\]"),
    (["metrics.profile_steps=[2]"], r"'metrics.profile_steps' must be \[first, last\].*got \[2\]"),
    (["metrics.profile_steps=2"], r"'metrics.profile_steps' must be a list of int"),
])
def test_cross_field_validation(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_variants_are_value_sets():
    dapo = load_config(None, ["grpo.clip_high=0.28", "grpo.dynamic_sampling=true", "grpo.kl_coef=0"])
    gspo = load_config(None, ["grpo.ratio_level=sequence", "grpo.clip_low=3e-4", "grpo.clip_high=4e-4"])
    dr = load_config(None, ["grpo.advantage_scale=none", "grpo.agg=seq-mean-token-sum-norm"])
    assert dapo.grpo.dynamic_sampling and dapo.grpo.kl_coef == 0.0
    assert gspo.grpo.clip_low == 3e-4 and gspo.grpo.ratio_level == "sequence"
    assert dr.grpo.advantage_scale == "none"
    preset = load_config(None, ["model.preset=qwen3-8b", "model.arch=null", "model.param_dtype=bfloat16"])
    assert preset.model.arch is None and preset.model.preset == "qwen3-8b"


def test_mesh_resolve():
    assert C.MeshConfig().resolve(8) == (1, 8, 1, 1, 1)
    assert C.MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 2, 1, 1)
    assert C.MeshConfig(data=2, fsdp=4, tensor=1).resolve(8) == (2, 4, 1, 1, 1)
    assert C.MeshConfig(fsdp=-1, sequence=4).resolve(8) == (1, 2, 1, 4, 1)
    assert C.MeshConfig(fsdp=-1, tensor=2, expert=2).resolve(8) == (1, 2, 2, 1, 2)
    assert C.MeshConfig(fsdp=2, expert=-1).resolve(8) == (1, 2, 1, 1, 4)
    with pytest.raises(ConfigError, match=r"mesh \{'data': 2, 'fsdp': 2, 'tensor': 1, 'sequence': 1, 'expert': 1\} "
                                          "has 4 devices "):
        C.MeshConfig(data=2, fsdp=2, tensor=1).resolve(8)
    with pytest.raises(ConfigError, match="8 devices are not divisible by 3"):
        C.MeshConfig(data=3, fsdp=-1, tensor=1).resolve(8)
    with pytest.raises(ConfigError, match="mesh.sequence.*at most one axis may be -1"):
        load_config(None, ["mesh.sequence=-1"])
    with pytest.raises(ConfigError, match="mesh.expert.*at most one axis may be -1"):
        load_config(None, ["mesh.expert=-1"])


def test_resolve_mesh_shape_pads_the_axes_left_out():
    # callers naming (data, fsdp, tensor, sequence) by position keep working: expert is 1
    assert parallel.resolve_mesh_shape(2, -1, 1, 1, 8) == (2, 4, 1, 1, 1)
    assert parallel.resolve_mesh_shape(1, 2, 1, 1, 4, 8) == (1, 2, 1, 1, 4)
    with pytest.raises(TypeError, match="1 to 5 sizes"):
        parallel.resolve_mesh_shape(1, 1, 1, 1, 1, 1, 8)


def test_mesh_config_has_one_field_per_mesh_axis():
    # every axis, in order, and `topology` (what the run is planned for: not an axis)
    assert tuple(f.name for f in dataclasses.fields(C.MeshConfig)) == (*parallel.MESH_AXES, "topology")
    assert tuple(C.MeshConfig().sizes()) == parallel.MESH_AXES


def test_base_inheritance(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "root.yaml", "run: {name: root, seed: 7}\ngrpo: {learning_rate: 3.0e-6, clip_high: 0.3}\n")
    write(tmp_path / "sub" / "mid.yaml", "base: ../root.yaml\ngrpo: {clip_high: 0.28}\nrollout: {n_per_task: 4}\n")
    child = write(tmp_path / "child.yaml", "base: sub/mid.yaml\nrun: {name: child}\n")
    cfg = load_config(child, ["rollout.n_per_task=6"])
    assert cfg.run.name == "child" and cfg.run.seed == 7  # deep merge keeps the base's sibling keys
    assert cfg.grpo.learning_rate == 3e-6 and cfg.grpo.clip_high == 0.28
    assert cfg.rollout.n_per_task == 6


def test_dot_relative_checkpoint_paths_follow_their_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "base.yaml", "model: {hf_dir: ./tiny, arch: null}\n")
    child = write(tmp_path / "child.yaml", "base: sub/base.yaml\n")
    monkeypatch.chdir(tmp_path)  # not the files' directory for sub/base.yaml
    assert load_config(child).model.hf_dir == str(tmp_path / "sub" / "tiny")  # beside the file that says it
    plain = write(tmp_path / "sub" / "plain.yaml", "model: {hf_dir: checkpoints/Qwen3-8B, arch: null}\n")
    assert load_config(plain).model.hf_dir == "checkpoints/Qwen3-8B"  # plain relative: the working directory
    # on the command line "./" keeps meaning the working directory
    assert load_config(child, ["model.hf_dir=./other"]).model.hf_dir == "./other"
    # the SFT data and MCP scenario files shipped beside a config follow it too
    data = write(tmp_path / "sub" / "data.yaml", "sft: {data: ./sft.jsonl}\nenv:\n  domain: mcp\n"
                 "  mcp: {scenarios: [./a.yaml, b.yaml, ../c.yaml]}\n")
    cfg = load_config(data)
    assert cfg.sft.data == str(tmp_path / "sub" / "sft.jsonl")
    assert cfg.env.mcp.scenarios == (str(tmp_path / "sub" / "a.yaml"), "b.yaml", str(tmp_path / "c.yaml"))


def test_base_errors(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"loops: a.yaml -> b.yaml -> a.yaml"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "c.yaml", "base: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"not found: .*missing.yaml \(the base of .*c.yaml\)"):
        load_config(tmp_path / "c.yaml")
    write(tmp_path / "d.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="d.yaml: the top level must be a mapping"):
        load_config(tmp_path / "d.yaml")
    write(tmp_path / "e.yaml", "grpo:\n  kl_coef: 0\n  kl_coef: 1\n")
    with pytest.raises(ConfigError, match="e.yaml: invalid YAML.*duplicate key 'kl_coef'"):
        load_config(tmp_path / "e.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("override, where", [
    ("user.api_key=sk-abc123", "user.api_key"),
    ("user.token=abc", "user.token"),
    ("env.mcp.servers.gh.GITHUB_TOKEN=ghp_x", "env.mcp.servers.gh.GITHUB_TOKEN"),
    ("user.password=hunter2", "user.password"),
    ("client_secret=zq9-xy", "client_secret"),
])
def test_literal_secret_rejected(override, where):
    with pytest.raises(ConfigError, match=rf"'{where}' holds a literal secret.*environment variable") as info:
        load_config(None, [override])
    assert override.split("=", 1)[1] not in str(info.value)  # the secret is never echoed


def test_secret_like_names_that_are_fine():
    assert not F._looks_secret("max_new_tokens_per_turn")
    assert not F._looks_secret("pad_token") and not F._looks_secret("api_key_env")
    assert F._looks_secret("hf_token") and F._looks_secret("openai_api_key")
    with pytest.raises(ConfigError, match="NAME of an environment variable"):
        load_config(None, ["user.api_key_env=sk-live-abc"])


def test_round_trip(tmp_path):
    cfg = load_config(None, ["run.stages=[sft, grpo]", "sft.data=data/sft.jsonl", "grpo.learning_rate=1e-7",
                             "env.mcp.servers.fs.command=npx", "env.mcp.servers.fs.args=[server]",
                             "env.mcp.servers.fs.env_vars=[HOME]", "env.mcp.servers.web.url=http://127.0.0.1:1/mcp",
                             "env.mcp.servers.web.headers_env={Authorization: WEB_AUTH}",
                             "mesh.data=2", "grpo.dual_clip=null"])
    text = L.dump_yaml(cfg, tmp_path / "dump.yaml")
    assert "learning_rate: 1.0e-07" in text and (tmp_path / "dump.yaml").read_text() == text
    again = load_config(tmp_path / "dump.yaml")
    assert again == cfg
    servers = F.config_to_dict(again)["env"]["mcp"]["servers"]
    assert servers["fs"]["command"] == "npx" and servers["fs"]["args"] == ["server"]
    assert servers["web"]["headers_env"] == {"Authorization": "WEB_AUTH"}


def test_generic_from_dict():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        k: int

        def validate(self):
            F.check(self.k != 13, "k", "is unlucky")

    @dataclasses.dataclass(frozen=True)
    class Outer:
        items: dict[str, Inner] = dataclasses.field(default_factory=dict)
        names: list[str] = dataclasses.field(default_factory=list)
        mode: Optional[Literal["a", "b"]] = None
        either: int | str = 0

    out = F.from_dict(Outer, {"items": {"x": {"k": 1}}, "names": ["p", 3], "mode": "b", "either": "s"})
    assert out.items == {"x": Inner(1)} and out.names == ["p", "3"] and out.mode == "b" and out.either == "s"
    with pytest.raises(ConfigError, match=r"missing required key 'root.items.y.k'"):
        F.from_dict(Outer, {"items": {"y": {}}}, path="root")
    with pytest.raises(ConfigError, match=r"'root.items.z.k' is unlucky"):
        F.from_dict(Outer, {"items": {"z": {"k": 13}}}, path="root")
    with pytest.raises(ConfigError, match=r"'either' must be int or str, got list"):
        F.from_dict(Outer, {"either": [1]})
    with pytest.raises(TypeError, match="needs a dataclass"):
        F.from_dict(dict, {})


def test_validate_config_after_replace():
    cfg = load_config()
    bad = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, learning_rate=-1.0))
    with pytest.raises(ConfigError, match=r"'sft.learning_rate' must be > 0"):
        F.validate_config(bad)
    F.validate_config(cfg)
    # a section that code also builds directly checks itself as it is built
    with pytest.raises(ConfigError, match=r"'kl_coef' must be >= 0"):
        dataclasses.replace(cfg.grpo, kl_coef=-1.0)


def test_partial_rollouts_need_an_asynchronous_step():
    with pytest.raises(ConfigError, match=r"rollout.partial.*needs grpo.max_staleness >= 1"):
        load_config(None, ["rollout.partial=true"])
    assert load_config(None, ["rollout.partial=true", "grpo.max_staleness=1"]).rollout.partial


def test_an_inline_arch_describes_a_mixture_of_experts():
    """model.arch takes Qwen3-MoE's fields (a tiny MoE run on CPU) and checks them where written."""
    from muajax.models.qwen3_config import Qwen3Config
    moe = "model.arch={num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 32, norm_topk_prob: true}"
    arch = load_config(None, ["model.hf_dir=null", moe]).model.arch
    model = Qwen3Config(**dataclasses.asdict(arch))
    assert model.is_moe and (model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size) == (4, 2, 32)
    assert model.norm_topk_prob and not Qwen3Config(**dataclasses.asdict(C.ArchConfig())).is_moe
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_config(None, ["model.hf_dir=null", "model.arch={num_experts: 4, num_experts_per_tok: 5, "
                           "moe_intermediate_size: 32}"])
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        load_config(None, ["model.hf_dir=null", "model.arch={num_experts: 4, num_experts_per_tok: 2}"])
