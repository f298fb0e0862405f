"""Host-side batches: the SFT loss mask, the context weights, row padding, mini-batches, and
the one GRPO path from trajectories to the placed update batches."""
import numpy as np
import pytest


from muajax.agent.chat import render_messages_ids, system_prompt_ids
from muajax.domains.builtin import BuiltinEnvironment
from muajax.domains.builtin.expert import expert_conversation
from muajax.models.tokenizer import IM_END_ID, IM_START_ID, PAD_ID
from muajax.runtime.host_batch import sft_batch


def test_sft_loss_mask_covers_exactly_the_assistant_tokens(tokenizer):
    tok = tokenizer
    env = BuiltinEnvironment()
    task = env.tasks("train")[1]
    messages, _ = expert_conversation(env, task, careless=0.0, seed=0)
    tools = env.reset(task).tools()
    ids, mask = render_messages_ids(tok, env.policy(), tools, messages)
    batch = sft_batch([(ids, mask)], PAD_ID, 4096)
    tokens, loss_mask = batch["tokens"][0], batch["loss_mask"][0]
    assert loss_mask[len(ids):].sum() == 0 and (tokens[len(ids):] == PAD_ID).all()
    # every masked span is one assistant message followed by its <|im_end|>, nothing else
    spans, start = [], None
    for i, m in enumerate(list(loss_mask[: len(ids)]) + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert len(spans) == len(assistants)
    for (a, b), message in zip(spans, assistants):
        assert tokens[b - 1] == IM_END_ID
        assert tokens[a - 1] != IM_START_ID  # preceded by the generation prompt's empty think block
        text = tok.decode(tokens[a: b - 1])
        if message.get("tool_calls"):
            assert message["tool_calls"][0]["function"]["name"] in text and "<tool_call>" in text
        else:
            assert text == message["content"]
    # with a context weight, every other token after the system prompt gets that weight
    prefix = len(system_prompt_ids(tok, env.policy(), tools))
    weighted = sft_batch([(ids, mask)], PAD_ID, 4096, context_weight=0.5, context_start=prefix)
    assert (weighted["loss_mask"] == batch["loss_mask"]).all()
    context = weighted["context_mask"][0]
    assert (context[:prefix] == 0).all() and (context[len(ids):] == 0).all()
    assert (context[: len(ids)][loss_mask[: len(ids)] == 1] == 0).all()
    assert (context[prefix: len(ids)][loss_mask[prefix: len(ids)] == 0] == 0.5).all()


# --------------------------------------------------------------------------- a task a tiny model can learn


def test_padding_rows_carry_nothing_and_belong_to_no_group():
    from muajax.rl.advantages import group_advantages
    from muajax.runtime.host_batch import PAD_GROUP, minibatches, pad_to_multiple

    batch = {"tokens": np.ones((3, 4), np.int32), "loss_mask": np.ones((3, 4), np.int32),
             "rewards": np.array([1.0, 0.0, 1.0], np.float32), "group_ids": np.array([0, 0, 0], np.int32)}
    padded = pad_to_multiple(batch, 4, pad_id=PAD_ID)
    assert padded["tokens"].shape == (4, 4) and (padded["tokens"][3] == PAD_ID).all()
    assert padded["loss_mask"][3].sum() == 0 and padded["group_ids"][3] == PAD_GROUP
    adv = np.asarray(group_advantages(padded["rewards"], padded["group_ids"], 1))
    assert adv[3] == 0 and np.allclose(adv[:3], np.asarray(group_advantages(batch["rewards"], batch["group_ids"], 1)))
    assert pad_to_multiple(batch, 3, pad_id=PAD_ID) is batch
    parts = minibatches(padded, 2)
    assert [p["tokens"].shape[0] for p in parts] == [2, 2] and parts[1]["group_ids"][1] == PAD_GROUP
    with pytest.raises(ValueError, match="do not divide"):
        minibatches(padded, 3)


def test_rollout_lengths_fall_into_a_few_buckets():
    from muajax.runtime.host_batch import bucket_length, length_buckets

    buckets = length_buckets(32768)
    assert buckets == (512, 1024, 2048, 4096, 8192, 16384, 32768)
    assert length_buckets(1536) == (512, 1024, 1536) and length_buckets(300) == (512,)
    assert [bucket_length(n, buckets) for n in (1, 512, 513, 5000, 32768)] == [512, 512, 1024, 8192, 32768]
    # every length a rollout can have maps to one of 7 shapes (multiples of 512: 64)
    assert len({bucket_length(n, buckets) for n in range(1, 32769, 97)}) == 7
    with pytest.raises(ValueError, match="longer than every length bucket"):
        bucket_length(40000, buckets)


def test_microbatches_are_whole_rows_on_every_device():
    from muajax import parallel
    from muajax.settings.fields import ConfigError
    from muajax.runtime.host_batch import batch_divisor, microbatch_count

    class FakeMesh:  # 32 devices on fsdp
        shape = {"data": 1, "fsdp": 32, "tensor": 1, "sequence": 1}

    mesh = FakeMesh()
    assert parallel.batch_divisor(mesh) == 32
    assert microbatch_count(256, None, mesh, "grpo.microbatch_size") == 1
    assert microbatch_count(256, 32, mesh, "grpo.microbatch_size") == 8
    assert microbatch_count(256, 64, mesh, "grpo.microbatch_size") == 4
    # 256 rows padded only to the next multiple of the data-parallel size: not at all
    assert 256 % batch_divisor(mesh, microbatch_count(256, 32, mesh, "k")) == 0
    with pytest.raises(ConfigError, match=r"grpo.microbatch_size \(8\) must be a multiple of data\*fsdp\*expert = 32"):
        microbatch_count(256, 8, mesh, "grpo.microbatch_size")
    with pytest.raises(ConfigError, match=r"must divide the 256 rows"):
        microbatch_count(256, 96, mesh, "grpo.microbatch_size")


def _trajectory(task: str, index: int, reward: float, *, failed: bool = False, length: int = 6):
    from muajax.agent.trajectory import USER_ERROR, USER_STOP, Trajectory

    tokens = [3, 4, 5] + [7 + index] * (length - 3)  # a shared 3-token prompt, then the rollout's own
    mask = [0, 0, 0] + [1] * (length - 3)
    return Trajectory(task, 0, index, 0, tokens, mask, [-0.25 * m for m in mask], 3, [],
                      USER_ERROR if failed else USER_STOP, reward=reward)


@pytest.mark.parametrize("minibatch_size", [None, 4])
def test_grpo_update_batches_collate_mask_take_whole_group_advantages_and_place(minibatch_size):
    """One path, in one module: collate -> mask failed rows -> advantages over whole groups
    -> mini-batches -> placed (padded to the divisor). Each mini-batch's advantages are the
    whole group's, never the part of it one mini-batch holds."""
    import jax
    from muajax import parallel
    from muajax.rl.advantages import group_advantages
    from muajax.rl.grpo import GRPOConfig
    from muajax.runtime.host_batch import collate, grpo_update_batches, mask_failed

    # each group's rows straddle the two mini-batches of 4
    spec = [("a", 1.0, False), ("a", 0.0, False), ("b", 1.0, False), ("b", 1.0, False),
            ("a", 0.0, False), ("a", 1.0, True), ("b", 0.0, False), ("b", 0.0, False)]
    trajs = [_trajectory(task, i, reward, failed=failed, length=5 + i % 3) for i, (task, reward, failed) in enumerate(spec)]
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    grpo = GRPOConfig(minibatch_size=minibatch_size)
    parts = grpo_update_batches(trajs, grpo, mesh=mesh, pad_id=PAD_ID, buckets=(8, 16), first_group=0,
                                divisor=3, shared_prefix=3)
    assert len(parts) == (1 if minibatch_size is None else 2)
    for part in parts:
        assert set(part) == {"tokens", "loss_mask", "old_logprobs", "advantages"}
        assert part["tokens"].shape[0] % 3 == 0 and part["tokens"].shape[1] == 8  # placed: padded rows, bucketed length
    rows = (len(trajs) if minibatch_size is None else minibatch_size)
    got = np.concatenate([p["advantages"][:rows] for p in parts])
    failed = np.array([f for _, _, f in spec])
    whole = mask_failed(collate(trajs, length=8), failed)
    want = np.asarray(group_advantages(whole["rewards"], whole["group_ids"], 2))
    np.testing.assert_array_equal(got, want)
    assert got[5] == 0 and (np.concatenate([p["loss_mask"][:rows] for p in parts])[5] == 0).all()
    assert all((p["advantages"][rows:] == 0).all() and (p["loss_mask"][rows:] == 0).all() for p in parts)
    halves = [np.asarray(group_advantages(whole["rewards"][i:i + 4], whole["group_ids"][i:i + 4], 2)) for i in (0, 4)]
    assert not np.allclose(got, np.concatenate(halves))  # what each mini-batch alone would give
    with pytest.raises(RuntimeError, match="4-token system prompt"):
        grpo_update_batches(trajs, grpo, mesh=mesh, pad_id=PAD_ID, buckets=(8,), first_group=0, divisor=1,
                            shared_prefix=4)
