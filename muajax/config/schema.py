"""The run configuration: typed, frozen dataclasses loaded from YAML plus dotted overrides.

`load_config("run.yaml", ["grpo.learning_rate=2e-6"])` reads the file (following its
`base:` chain, relative paths), applies the overrides (YAML-typed values), builds and
validates the `TrainConfig`; every error is a `ConfigError` naming the dotted key. Configs
hold only the *names* of environment variables for secrets (`user.api_key_env`).

Defaults follow the paper's settings "as run" (shared/PAPER.md). Sections whose classes
code also builds directly live next to that code and are composed here: `rollout`
(`muajax.agent.rollout_config`) and `grpo` (`muajax.rl.grpo`, with the GRPO variants as
value sets). The machinery is `muajax.settings.fields` (typed dataclasses) and
`muajax.settings.loader` (YAML files and overrides).
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from muajax import parallel
from muajax.agent.rollout_config import RolloutConfig
from muajax.settings.fields import ConfigError, bounded, check, from_dict
from muajax.settings.loader import deep_merge, parse_overrides, read_yaml
from muajax.domains.builtin.tasks import check_kind_weights
from muajax.domains.user_config import UserConfig
from muajax.domains.mcp.config import McpConfig, McpServerConfig
from muajax.rl.grpo import GRPOConfig

__all__ = ["ConfigError", "load_config", "TrainConfig", "RunConfig", "ArchConfig", "ModelConfig", "MeshConfig",
           "McpServerConfig", "McpConfig", "EnvConfig", "UserConfig", "RolloutConfig", "GRPOConfig", "SFTConfig",
           "CheckpointConfig", "MetricsConfig", "EvalConfig"]


Stage = Literal["sft", "grpo"]
Dtype = Literal["float32", "bfloat16"]
Schedule = Literal["constant", "warmup_cosine"]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The run: its name, where it writes, its seed and which stages it runs."""

    name: str = "muajax"  # the run's directory name, under out_dir (<out_dir>/<name>)
    out_dir: str = "runs"  # the folder that holds the runs' directories
    seed: int = 0  # seeds initial params, task order, sampling and the warm-up data
    stages: tuple[Stage, ...] = ("grpo",)  # the stages run, in order: "sft" (cold start), then "grpo"
    # jax's persistent compilation cache: a resumed (or repeated) run reads its compiled
    # programs back instead of compiling them again. Shared safely between runs.
    compilation_cache_dir: str | None = None
    # The share of each GPU's memory jax may take: the trainer sets XLA_CLIENT_MEM_FRACTION to
    # it before jax starts (unless XLA_CLIENT_MEM_FRACTION or XLA_PYTHON_CLIENT_MEM_FRACTION is
    # already set: the environment wins), and the planner judges a GPU plan against it. jax's
    # own 0.75 would leave 20 GB of an 80 GB card unused; 0.9 leaves 8 GB for what is allocated
    # outside jax's pool (the CUDA context, NCCL's buffers). Nothing on TPU or CPU.
    gpu_memory_fraction: float = bounded(0.9, gt=0, le=1)

    def validate(self) -> None:
        stages = list(self.stages)
        check(bool(self.name) and not re.search(r"[/\\]", self.name) and self.name not in (".", ".."),
              "name", f"must be a plain directory name, got {self.name!r}")
        check(len(stages) > 0, "stages", "must list at least one of 'sft', 'grpo'")
        check(len(set(stages)) == len(stages) and stages == sorted(stages, key=("sft", "grpo").index), "stages",
              f"must list each stage once, 'sft' (the cold start) before 'grpo', got {stages}")


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    """An inline architecture: by default a tiny Qwen3 for CPU runs and tests (with Qwen3's
    vocabulary, so the real tokenizer's ids fit)."""

    vocab_size: int = bounded(151936, ge=1)  # token ids (Qwen3's tokenizer: 151936)
    hidden_size: int = bounded(64, ge=1)  # the residual stream's width
    intermediate_size: int = bounded(128, ge=1)  # the MLP's hidden width
    num_layers: int = bounded(2, ge=1)  # transformer blocks
    num_heads: int = bounded(4, ge=1)  # query heads
    num_kv_heads: int = bounded(2, ge=1)  # key/value heads (grouped-query attention)
    head_dim: int = bounded(16, ge=1)  # width of one attention head (even: rotary embeddings)
    rope_theta: float = bounded(1_000_000.0, gt=0)  # the rotary embeddings' base
    rms_norm_eps: float = bounded(1e-6, gt=0)  # RMSNorm's epsilon
    tie_word_embeddings: bool = True  # the LM head reuses the embedding table
    max_position_embeddings: int = bounded(40960, ge=1)  # the longest sequence; rollout.max_context must fit
    # A mixture of experts (Qwen3-MoE) when num_experts > 0: every layer's MLP is num_experts
    # experts of width moe_intermediate_size, each token routed to num_experts_per_tok of them.
    num_experts: int = bounded(0, ge=0)  # 0: a dense MLP of intermediate_size
    num_experts_per_tok: int = bounded(0, ge=0)  # experts per token (top k of the router's softmax)
    moe_intermediate_size: int = bounded(0, ge=0)  # one expert's hidden width
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1 (Qwen3-30B-A3B: true)
    router_aux_loss_coef: float = bounded(0.001, ge=0)  # the router's load-balancing loss in the training loss

    def validate(self) -> None:
        check(self.num_heads % self.num_kv_heads == 0, "num_heads", f"({self.num_heads}) must be a multiple "
              f"of num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.num_experts:
            check(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                  f"({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})")
            check(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive with num_experts > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Exactly one source: a named `preset`, an HF checkpoint folder `hf_dir`, or `arch`."""

    preset: str | None = None  # a named Qwen3 architecture (configs/models/<name>.yaml, e.g. qwen3-8b)
    hf_dir: str | None = None  # an HF Qwen3 checkpoint folder (config, weights, tokenizer) to start from
    arch: ArchConfig | None = dataclasses.field(default_factory=ArchConfig)  # an inline architecture
    param_dtype: Dtype = "float32"  # the dtype the params are kept and trained in
    dtype: Dtype = "float32"  # the compute (activation) dtype
    # Training's rematerialization per layer: "none" keeps every activation, "full" recomputes
    # them in the backward pass, "dots" keeps the matmul outputs, "dots_no_batch" those with no
    # batch dimension.
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    # Full-sequence attention (training, SFT, the shared-prefix forward): splash on TPU,
    # cuDNN on GPU, blockwise `chunked` on CPU past a length; `xla` is the einsum reference.
    attention: Literal["auto", "xla", "chunked", "splash", "cudnn"] = "auto"
    # The LM head in float32 whatever the compute dtype, so that the engine's and the
    # trainer's logprobs of a sampled token agree to rounding.
    logits_fp32: bool = True
    # "domain": renumber the tokenizer's ids to the subset the domain uses (tiny CPU
    # models; see muajax.models.vocab): built for an inline `arch`, or read from an
    # `hf_dir` checkpoint's domain_vocab.json.
    vocab: Literal["full", "domain"] = "full"

    def validate(self) -> None:
        given = [n for n in ("preset", "hf_dir", "arch") if getattr(self, n) is not None]
        hint = " (add 'model.arch=null' to drop the inline architecture)" if "arch" in given[1:] else ""
        check(len(given) == 1, "preset", "conflicts: set exactly one of model.preset, model.hf_dir, "
              f"model.arch; got {given or 'none'}{hint}")
        check(self.vocab == "full" or self.preset is None, "vocab",
              "'domain' needs an inline model.arch or an hf_dir with a domain_vocab.json (a preset's "
              "vocabulary is Qwen3's)")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device-mesh axis sizes, one field per `parallel.MESH_AXES` entry; one of them may be
    -1, meaning "all remaining devices". `sequence` > 1 splits each row's positions over
    that many devices (context parallelism, for rows too long for one device); `expert` > 1
    splits a mixture-of-experts model's experts (and, elsewhere, the batch)."""

    data: int = 1  # data parallelism with replicated weights
    fsdp: int = -1  # data parallelism with weights and optimizer state sharded (ZeRO-3 style)
    tensor: int = 1  # tensor parallelism over heads, MLP width and vocabulary
    sequence: int = 1  # context parallelism: each row's positions split over this many devices
    # expert parallelism (mixture-of-experts models): experts split over this many devices, tokens
    # sent to them by all-to-all; outside the experts it splits the batch like data
    expert: int = 1
    # The slice the run is sized for (v5p-128, v6e-64, v5p:4x4x4, or h100:8 for a GPU node):
    # what `python -m muajax.plan --config` compiles for. The trainer uses the devices it finds.
    topology: str | None = None

    def validate(self) -> None:
        wild = [n for n in parallel.MESH_AXES if getattr(self, n) == -1]
        for name in parallel.MESH_AXES:
            size = getattr(self, name)
            check(size == -1 or size >= 1, name, f"must be >= 1 or -1 (the rest of the devices), got {size}")
            if name in wild[1:]:
                check(False, name, f"is -1 but so is {wild[0]}; at most one axis may be -1")

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in parallel.MESH_AXES}

    def resolve(self, num_devices: int) -> tuple[int, ...]:
        """Sizes in `parallel.MESH_AXES` order for `num_devices`, filling in the -1 axis."""
        try:
            return parallel.resolve_mesh_shape(*self.sizes().values(), num_devices)
        except ValueError as e:
            raise ConfigError(f"{e} (set one axis to -1 to absorb the rest)") from None


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """The environment: the task domain(s), their splits and the built-in domain's data."""

    # The tasks' domain; "bfcl" (BFCL-v3 multi-turn, the optional nvidia-bfcl install) is
    # evaluation-only: no train split
    domain: Literal["builtin", "retail", "airline", "telecom", "mcp", "bfcl", "tau1-retail", "tau1-airline",
                    "acebench"] = "builtin"
    # several τ2 domains trained together (e.g. [retail, airline]); overrides `domain`
    domains: tuple[Literal["retail", "airline", "telecom"], ...] = ()
    builtin_seed: int = 0  # seeds the built-in domain's database and tasks
    builtin_terse_tools: bool = False  # shorter tool schemas in the prompt (tiny CPU runs)
    # The built-in database's size: many distinct users (names, zips, ids) make a tiny model
    # learn to copy from the conversation rather than memorise the few it saw.
    builtin_users: int = bounded(60, ge=2, le=300)
    builtin_test_users: int = bounded(12, ge=0)  # users only the test split has; 0: shared users, held-out tasks
    builtin_train_tasks: int = bounded(200, ge=1)  # tasks in the built-in domain's train split
    builtin_test_tasks: int = bounded(50, ge=1)  # tasks in the built-in domain's test split
    # A "validation" split of this many tasks from the train users (none duplicates a train
    # task): tune on it, and keep the test split for the figures you report.
    builtin_validation_tasks: int = bounded(0, ge=0)
    # The share of each task kind in both splits (kind -> weight; null: the domain's own mix).
    builtin_kind_weights: dict[str, float] | None = None
    bfcl_category: Literal["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param",
                           "multi_turn_long_context"] = "multi_turn_base"  # BFCL-v3's multi-turn category
    train_split: str = "train"  # the split training draws its tasks from
    eval_split: str = "test"  # the split evaluations run on
    # At most this many train tasks from each domain (the first of its train split): smoke runs.
    max_train_tasks: int | None = bounded(None, ge=1)
    # τ2's agent tools: "muajax" adds MUA-RL's general think (and calculate where τ2 lacks
    # it); "tau2" is exactly the list τ2's own agent gets (python -m muajax.eval uses it).
    tau2_tools: Literal["muajax", "tau2"] = "muajax"
    mcp: McpConfig = dataclasses.field(default_factory=McpConfig)  # MCP servers and scenarios (env.domain mcp)
    # env.domain tau1-retail / tau1-airline: a checkout of sierra-research/tau-bench (τ1's task files)
    tau1_dir: str | None = None
    # env.domain acebench (evaluation only): a checkout of ACEBench (git clone https://github.com/ACEBench/ACEBench)
    acebench_dir: str | None = None
    acebench_language: Literal["en", "zh"] = "en"  # env.domain acebench: its English or Chinese Agent items

    def validate(self) -> None:
        check(self.domain != "mcp" or bool(self.mcp.scenarios), "mcp.scenarios",
              "must list at least one scenario file when env.domain is 'mcp' (see muajax.domains.mcp.scenario)")
        check(not self.domain.startswith("tau1-") or bool(self.tau1_dir), "tau1_dir",
              f"must name a checkout of sierra-research/tau-bench when env.domain is {self.domain!r} "
              "(git clone https://github.com/sierra-research/tau-bench)")
        check(self.domain != "acebench" or bool(self.acebench_dir), "acebench_dir",
              "must name a checkout of ACEBench when env.domain is 'acebench' "
              "(git clone https://github.com/ACEBench/ACEBench)")
        if self.builtin_kind_weights is not None:
            try:
                check_kind_weights(self.builtin_kind_weights)
            except ValueError as exc:
                check(False, "builtin_kind_weights", str(exc))


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The supervised cold start (stage "sft") on conversations, before GRPO."""

    data: str | None = None  # a JSONL file of conversations (python -m muajax.synth)
    # With no data on the built-in domain, the scripted expert writes it; this share of its
    # tasks it handles carelessly (writes before the user confirms), like real cold-start data.
    expert_careless: float = bounded(0.3, ge=0, le=1)
    steps: int | None = bounded(None, ge=1)  # if set, caps the steps the epochs make
    weight_decay: float = bounded(0.01, ge=0)  # AdamW's, on every parameter
    grad_clip: float | None = bounded(1.0, gt=0)  # the gradients' global-norm bound; null: no clipping
    epochs: int = bounded(2, ge=1)  # passes over the data
    batch_size: int = bounded(128, ge=1)  # conversations per update
    learning_rate: float = bounded(5e-6, gt=0)  # the peak learning rate
    schedule: Schedule = "warmup_cosine"  # "warmup_cosine": linear warmup, then cosine decay to 0
    warmup_ratio: float = bounded(0.0, ge=0, lt=1)  # the share of the steps spent in linear warmup
    max_len: int = bounded(32768, ge=1)  # tokens per conversation; longer ones are cut
    # Rows per gradient pass (a multiple of data*fsdp); several passes add up to one update.
    microbatch_size: int | None = bounded(None, ge=1)
    # Positions per LM-head chunk: the [T, V] logits never exist at once (any T works).
    logits_chunk: int | None = bounded(None, ge=1)
    # Conversations packed into rows of the longest one's length, with segment ids (attention
    # never crosses a conversation; positions restart). "auto" packs when that computes fewer
    # tokens a step than a row per conversation with the shared system prompt run once.
    packing: Literal["auto", "on", "off"] = "auto"
    # Loss weight of the conversation's other tokens (user turns, tool results; never the
    # system prompt) beside the assistant's own (weight 1). MUA-RL's cold start uses 0. A
    # model trained from scratch (the embedded default) has no pretraining to copy ids and
    # names with; predicting the whole dialogue gives it that signal in the same forward.
    context_weight: float = bounded(0.0, ge=0)
    # Steps of synthetic copy training (a span, then the span again) before the SFT data:
    # the in-context copying a pretrained base model brings, for models trained from
    # scratch (the embedded default). 0 for pretrained checkpoints.
    copy_warmup_steps: int = bounded(0, ge=0)
    copy_warmup_length: int = bounded(256, ge=4)  # tokens per copy row (a span, then the span again)
    # Steps on short windows of the built-in domain's expert conversations in *other* shops
    # (other database seeds), each ending at a tool call, before the SFT data: dense practice
    # at copying names, zips and ids into calls, which a model trained from scratch lacks
    # (muajax.domains.builtin.copy_windows). Built-in domain only; 0 for pretrained checkpoints.
    domain_warmup_steps: int = bounded(0, ge=0)
    domain_warmup_batch_size: int = bounded(32, ge=1)  # windows per domain warm-up step
    domain_warmup_shops: int = bounded(8, ge=1)  # the other shops: seeds env.builtin_seed+1 .. +this
    # Open each window with the run's system prompt (policy and tools; shared, so computed
    # once per batch): a model that never saw that prompt is lost behind it.
    domain_warmup_system_prompt: bool = False
    max_consecutive_skips: int | None = bounded(3, ge=0)  # as grpo.max_consecutive_skips

    def validate(self) -> None:
        check(self.microbatch_size is None or self.batch_size % self.microbatch_size == 0, "microbatch_size",
              f"({self.microbatch_size}) must divide batch_size ({self.batch_size})")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of each stage: where, how often, how many are kept."""

    dir: str | None = None  # None: <run.out_dir>/<run.name>/checkpoints
    every_steps: int = bounded(10, ge=1)  # save every this many steps (and, on SIGTERM, the last finished step)
    keep: int = bounded(3, ge=1)  # the newest this many checkpoints are kept


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """What the run logs, and an optional profiler trace."""

    jsonl: bool = True  # one record per step in <run>/metrics.jsonl (SFT: <run>/sft/metrics.jsonl)
    tensorboard: bool = True  # TensorBoard event files in the metrics folder's tensorboard/
    progress_bar: bool = True  # a progress bar on the main process
    # [first, last]: a jax.profiler trace of those steps (1-based, inclusive; each stage's own
    # steps) into <run>/profile (SFT: <run>/sft/profile), for TensorBoard or ui.perfetto.dev
    profile_steps: tuple[int, ...] | None = None

    def validate(self) -> None:
        steps = self.profile_steps
        check(steps is None or (len(steps) == 2 and 1 <= steps[0] <= steps[1]), "profile_steps",
              f"must be [first, last] with 1 <= first <= last (steps count from 1), or null; got "
              f"{None if steps is None else list(steps)}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluations of the policy on env.eval_split."""

    trials: int = bounded(4, ge=1)  # τ2's n for pass^k
    temperature: float = bounded(0.0, ge=0)  # sampling temperature; 0 (greedy) runs one trial per task
    communicate_info: bool = True  # τ-bench's output check: dropped in training, kept here
    max_tasks: int | None = bounded(None, ge=1)  # evaluate on the first N tasks of the split
    # The simulated user of evaluations (the trainer's and `python -m muajax.eval` on this
    # run); null: the training user. MUA-RL trained against gpt-4o-2024-11-20 and evaluated
    # with GPT-4.1: a gap that tests transfer beyond the training simulator.
    user: UserConfig | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    user: UserConfig = dataclasses.field(default_factory=UserConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.run.out_dir, self.run.name)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")

    @property
    def eval_user(self) -> UserConfig:
        """The user evaluations talk to: `eval.user`, else the training user."""
        return self.eval.user if self.eval.user is not None else self.user

    def validate(self) -> None:
        r, arch, mb = self.rollout, self.model.arch, self.grpo.microbatch_size
        check(self.env.domain != "bfcl", "env.domain",
              "'bfcl' has no train split (BFCL-v3 is an evaluation benchmark): evaluate with "
              "`python -m muajax.eval --domain bfcl`")
        check("sft" not in self.run.stages or self.sft.data is not None or self.env.domain == "builtin",
              "sft.data", "is required when run.stages includes 'sft' (only the built-in domain has an expert "
              "to synthesize it)")
        check(not self.sft.domain_warmup_steps or self.env.domain == "builtin", "sft.domain_warmup_steps",
              f"needs env.domain 'builtin' (its windows come from the built-in shop), got {self.env.domain!r}")
        # The group std is undefined for one rollout, so every advantage would be 0.
        check("grpo" not in self.run.stages or r.n_per_task >= 2, "rollout.n_per_task",
              f"must be >= 2 for GRPO's group advantages, got {r.n_per_task}")
        batch, mini = r.n_per_task * r.tasks_per_step, self.grpo.minibatch_size
        check(mini is None or batch % mini == 0, "grpo.minibatch_size",
              f"({mini}) must divide the rollout batch n_per_task*tasks_per_step = {batch}")
        check(mb is None or (mini or batch) % mb == 0, "grpo.microbatch_size",
              f"({mb}) must divide the rollout batch n_per_task*tasks_per_step = {batch}" if mini is None else
              f"({mb}) must divide grpo.minibatch_size ({mini})")
        buckets = self.grpo.length_buckets
        check(not buckets or buckets[-1] >= r.max_context, "grpo.length_buckets",
              f"must reach rollout.max_context ({r.max_context}): the longest is {buckets and buckets[-1]}")
        check(not r.partial or self.grpo.max_staleness >= 1, "rollout.partial",
              "needs grpo.max_staleness >= 1: a synchronous step updates the weights only between rollouts, so "
              "no conversation is ever in flight at an update")
        check(arch is None or r.max_context <= arch.max_position_embeddings, "rollout.max_context",
              f"({r.max_context}) exceeds model.arch.max_position_embeddings ({arch and arch.max_position_embeddings})")


# Paths a config file may give as "./x": resolved against that file (a checkpoint shipped
# beside it), where plain relative paths mean the working directory.
FILE_RELATIVE_KEYS = ("model.hf_dir", "sft.data", "env.mcp.scenarios")


def load_config(path: str | os.PathLike | None = None,
                overrides: Sequence[str] | Mapping[str, Any] = ()) -> TrainConfig:
    """The validated `TrainConfig` from a YAML file (or the defaults) plus overrides."""
    data = read_yaml(os.fspath(path), file_relative=FILE_RELATIVE_KEYS) if path is not None else {}
    extra = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides)
    return from_dict(TrainConfig, deep_merge(data, extra))
