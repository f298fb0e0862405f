"""The sharded train step: microbatched gradients, AdamW, non-finite skip — for GRPO and SFT.

`make_train_step(loss_fn, optimizer, mesh, param_shardings, ...)` is model- and
loss-agnostic: `loss_fn(params, frozen, microbatch) -> (loss_sum, denominator, sums)`
returns one microbatch's *unnormalised* loss, the count it is normalised by, and a dict
of scalar metric sums (a key ending in "_max" holds a maximum instead). The step differentiates loss_sum per microbatch, adds the
gradients, and divides once by the total denominator, so k microbatches give the
full-batch gradient exactly (up to float associativity) whatever the normaliser
(token-mean, seq-mean, ...). `muajax.rl.grpo.make_grpo_step` and
`muajax.rl.sft.make_sft_step` are the two instances.

Batch layout (every array's leading dim is the batch, sharded over (data, fsdp, expert)):
  tokens       int32 [B, T]  the full token sequence, prompt and all turns, right-padded
                             with any valid id;
  loss_mask    [B, T]        1 where tokens[b, t] was sampled by the agent;
  old_logprobs f32 [B, T]    the rollout's logprob of tokens[b, t] (GRPO: the behaviour policy);
  prox_logprobs f32 [B, T]   the trainer's, of the params the step starts from (GRPO with
                             recompute_old_logprobs and mini-batches: the proximal policy);
  advantages   f32 [B]       each row's group advantage (GRPO).
Masks and logprobs are indexed by the *token* they describe, as the rollout stores
them. Inside the step, position t of the forward predicts token t+1: targets are
tokens[:, 1:], their mask loss_mask[:, 1:] and old logprobs old_logprobs[:, 1:]
(padded by one masked column so T stays T). Column 0 is never a target.

GRPO advantages arrive with the batch, computed on the host over whole groups
(`muajax.runtime.host_batch.with_advantages`, the one place), so a group may straddle
microbatches and mini-batches.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from muajax import parallel
from muajax.models.qwen3 import Qwen3Config, abstract_params
from muajax.rl.optim import Optimizer

LossFn = Callable[[Any, Any, dict], tuple[jax.Array, jax.Array, dict]]


class TrainState(NamedTuple):
    step: jax.Array      # int32 []: train-step calls so far, applied or skipped
    params: Any
    opt_state: Any
    skipped: jax.Array   # int32 []: updates dropped for a non-finite loss or gradient


# ----------------------------------------------------------------------------- helpers

def shift_left(x: jax.Array, fill=0) -> jax.Array:
    """x[:, 1:] padded at the end with `fill`: aligns per-token data with next-token targets."""
    pad = jnp.full_like(x[:, :1], fill)
    return jnp.concatenate([x[:, 1:], pad], axis=1)


def combine_sums(a: dict, b: dict) -> dict:
    """Two microbatches' metric sums as one: added, except the maxima (keys ending in "_max",
    of non-negative values: the scan starts them at 0), which combine by maximum."""
    return {k: jnp.maximum(a[k], b[k]) if k.endswith("_max") else jnp.add(a[k], b[k]) for k in a}


def split_microbatches(x: jax.Array, k: int, mesh) -> jax.Array:
    """[B, ...] -> [k, B/k, ...] with microbatch j = rows j, j+k, j+2k, ...

    Strided rather than contiguous: each device's contiguous block of rows then holds an
    equal share of every microbatch, so the split moves no data between devices.
    """
    b = x.shape[0]
    y = x.reshape(b // k, k, *x.shape[1:]).swapaxes(0, 1)
    spec = PartitionSpec(None, parallel.BATCH_AXES, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))


def opt_state_shardings(optimizer: Optimizer, abstract_params_tree, param_shardings, mesh):
    """Shard every params-shaped subtree of the optimizer state (mu, nu, ...) like the
    params; everything else (counts, scalars) is replicated."""
    abstract_state = jax.eval_shape(optimizer.tx.init, abstract_params_tree)
    repl = parallel.replicated(mesh)
    return optax.tree_utils.tree_map_params(
        optimizer.tx, lambda _, sharding: sharding, abstract_state, param_shardings,
        transform_non_params=lambda _: repl)


# ----------------------------------------------------------------------------- generic step

class TrainStep:
    """A jitted, sharded update `(state, batch[, frozen]) -> (state, metrics)`.

    The state is donated: do not reuse the TrainState passed in. `frozen` is a
    non-differentiated pytree passed to `loss_fn` (the GRPO reference params), sharded
    like the params; None when the loss needs none.
    """

    def __init__(self, loss_fn: LossFn, optimizer: Optimizer, mesh, param_shardings, *, microbatches: int = 1,
                 prepare_fn: Callable[[dict], dict] | None = None,
                 finalize_fn: Callable[[jax.Array, dict], dict] | None = None,
                 frozen_shardings=None, requires_frozen: bool = False, donate: bool = True):
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
        self.loss_fn, self.optimizer, self.mesh = loss_fn, optimizer, mesh
        self.param_shardings = param_shardings
        self.microbatches = microbatches
        self.prepare_fn = prepare_fn or (lambda batch: batch)
        self.finalize_fn = finalize_fn or (lambda denom, sums: dict(sums))
        self.frozen_shardings = frozen_shardings
        self.requires_frozen = requires_frozen
        self.donate = donate
        self._jitted: dict = {}
        self._init_jit = None
        self._state_sh: dict = {}

    # -- state -----------------------------------------------------------------------
    def state_shardings(self, abstract_params_tree) -> TrainState:
        # Cached: deriving the optimizer-state shardings traces tx.init, too slow per step.
        key = jax.tree.structure(abstract_params_tree), tuple(
            (x.shape, jnp.dtype(x.dtype)) for x in jax.tree.leaves(abstract_params_tree))
        if key not in self._state_sh:
            repl = parallel.replicated(self.mesh)
            opt = opt_state_shardings(self.optimizer, abstract_params_tree, self.param_shardings, self.mesh)
            self._state_sh[key] = TrainState(repl, self.param_shardings, opt, repl)
        return self._state_sh[key]

    def init_state(self, params) -> TrainState:
        """Place a *copy* of params by the rules and build the optimizer state already sharded.

        The copy matters: the state is donated at every step, and the caller's tree is
        typically also the GRPO reference policy, which must outlive the first update.
        """
        params = jax.device_put(params, self.param_shardings)
        shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        sh = self.state_shardings(shapes)
        if self._init_jit is None:
            init = lambda p: (jax.tree.map(jnp.copy, p), self.optimizer.tx.init(p))
            self._init_jit = jax.jit(init, out_shardings=(sh.params, sh.opt_state))
        params, opt_state = self._init_jit(params)
        zero = jax.device_put(jnp.zeros((), jnp.int32), sh.step)
        return TrainState(zero, params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), sh.skipped))

    def abstract_state(self, abstract_params_tree) -> TrainState:
        """ShapeDtypeStructs carrying the shardings: for ahead-of-time lowering (nothing allocated)."""
        sh = self.state_shardings(abstract_params_tree)
        opt = jax.eval_shape(self.optimizer.tx.init, abstract_params_tree)
        state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract_params_tree, opt,
                           jax.ShapeDtypeStruct((), jnp.int32))
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, sh)

    def batch_shardings(self, batch) -> dict:
        return jax.tree.map(lambda x: parallel.batch_sharding(self.mesh, len(x.shape)), batch)

    # -- the update --------------------------------------------------------------------
    def _check_batch(self, batch) -> None:
        sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
        if len(sizes) != 1:
            raise ValueError(f"every batch array needs the same leading (batch) size, got {sorted(sizes)}")
        (b,) = sizes
        k, div = self.microbatches, parallel.batch_divisor(self.mesh)
        if b % k or (b // k) % div:
            raise ValueError(f"batch size {b} must split into {k} microbatches whose size is a multiple of "
                             f"data*fsdp*expert = {div} (the devices a batch is split over)")

    def _update(self, state: TrainState, batch: dict, frozen):
        batch = self.prepare_fn(batch)
        params, k = state.params, self.microbatches
        grad_fn = jax.value_and_grad(lambda p, mb: self._loss_parts(p, frozen, mb), has_aux=True)
        if k == 1:
            (loss_sum, (denom, sums)), grads = grad_fn(params, batch)
        else:
            micro = jax.tree.map(lambda x: split_microbatches(x, k, self.mesh), batch)
            constrain = lambda g: jax.lax.with_sharding_constraint(g, self.param_shardings)

            def body(carry, mb):
                g_acc, l_acc, d_acc, s_acc = carry
                (l, (d, s)), g = grad_fn(params, mb)
                # float32 accumulation whatever the param dtype; sharded like the params.
                g_acc = constrain(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g))
                return (g_acc, l_acc + l, d_acc + d, combine_sums(s_acc, s)), None

            first = jax.tree.map(lambda x: x[0], micro)
            _, (d0, s0) = jax.eval_shape(lambda p, mb: self._loss_parts(p, frozen, mb), params, first)
            zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), t)
            init = (constrain(zeros(params)), jnp.zeros((), jnp.float32), jnp.zeros(d0.shape, jnp.float32), zeros(s0))
            (grads, loss_sum, denom, sums), _ = jax.lax.scan(body, init, micro)

        norm = jnp.maximum(denom, 1.0)
        grads = jax.tree.map(lambda g, p: (g / norm).astype(p.dtype), grads, params)
        loss = loss_sum / norm
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        updates, new_opt = self.optimizer.tx.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A select rather than lax.cond: it fuses into the update's elementwise pass, while
        # the cond measured +12% per-device temporaries in `muajax.plan` (Qwen3-8B, 16k).
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        skipped = (~finite).astype(jnp.int32)
        applied = state.step - state.skipped  # optax's count: the lr this update used
        new_state = TrainState(state.step + 1, keep(new_params, params), keep(new_opt, state.opt_state),
                               state.skipped + skipped)
        metrics = dict(self.finalize_fn(denom, sums))
        metrics.update(loss=loss, grad_norm=grad_norm, skipped=skipped.astype(jnp.float32),
                       skipped_total=new_state.skipped.astype(jnp.float32),
                       lr=jnp.asarray(self.optimizer.schedule(applied), jnp.float32),
                       step=new_state.step.astype(jnp.float32))
        return new_state, {k_: jnp.asarray(v, jnp.float32) for k_, v in metrics.items()}

    def _loss_parts(self, params, frozen, mb):
        loss_sum, denom, sums = self.loss_fn(params, frozen, mb)
        return loss_sum, (jnp.asarray(denom, jnp.float32), sums)

    def _get_jitted(self, state_sh, batch, with_frozen: bool):
        key = (jax.tree.structure(batch), tuple(len(x.shape) for x in jax.tree.leaves(batch)), with_frozen)
        if key not in self._jitted:
            in_sh = (state_sh, self.batch_shardings(batch))
            fn = self._update
            if with_frozen:
                in_sh = in_sh + (self.frozen_shardings,)
            else:
                fn = lambda state, batch: self._update(state, batch, None)
            self._jitted[key] = jax.jit(fn, in_shardings=in_sh,
                                        out_shardings=(state_sh, parallel.replicated(self.mesh)),
                                        donate_argnums=(0,) if self.donate else ())
        return self._jitted[key]

    def _args(self, state, batch, frozen):
        self._check_batch(batch)
        if frozen is None and self.requires_frozen:
            raise ValueError("this step needs its frozen params (the GRPO reference policy when kl_coef > 0): "
                             "call step(state, batch, ref_params)")
        if frozen is not None and self.frozen_shardings is None:
            raise ValueError("this step takes no frozen params (with kl_coef == 0 the reference is not used)")
        shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), state.params)
        fn = self._get_jitted(self.state_shardings(shapes), batch, frozen is not None)
        return fn, (state, batch) if frozen is None else (state, batch, frozen)

    def __call__(self, state: TrainState, batch: dict, frozen=None):
        fn, args = self._args(state, batch, frozen)
        with parallel.activation_rules(self.mesh):
            return fn(*args)

    def lower(self, state, batch, frozen=None):
        """Lower from (abstract or concrete) arguments; `.compile()` it for AOT analysis."""
        fn, args = self._args(state, batch, frozen)
        with parallel.activation_rules(self.mesh):
            return fn.lower(*args)


def make_train_step(loss_fn: LossFn, optimizer: Optimizer, mesh, param_shardings, **kwargs) -> TrainStep:
    return TrainStep(loss_fn, optimizer, mesh, param_shardings, **kwargs)


def model_abstract_params(cfg: Qwen3Config):
    return nn.meta.unbox(abstract_params(cfg))
