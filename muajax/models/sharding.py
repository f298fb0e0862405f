"""Where the model's weights live on a mesh: its logical axes mapped by `muajax.parallel`'s rules."""
from __future__ import annotations

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding

from muajax import parallel
from muajax.models.qwen3 import Qwen3Config, abstract_params, logical_axes


def param_shardings(cfg: Qwen3Config, mesh: Mesh, rules=parallel.LOGICAL_RULES):
    """A NamedSharding per parameter, from its logical axes."""
    abstract = nn.meta.unbox(abstract_params(cfg))
    return jax.tree.map(
        lambda x, a: NamedSharding(mesh, parallel.logical_to_spec(x.shape, a, mesh, rules)),
        abstract, logical_axes(cfg), is_leaf=lambda a: isinstance(a, tuple),
    )
