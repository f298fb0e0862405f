"""Each layer's weights as its own array, aliasing the stacked params (no copy).

XLA on CPU copies a slice of a stacked weight before a dot can read it: every decode step
of the dense CPU decode (`programs._decode_reference`) would copy all the layer weights. On
a single CPU device a numpy view of one layer, put on the device, shares the parameter's
memory instead. The engine makes them per call and drops them after it: a live view would
stop a train step from donating the params. Elsewhere (a mesh, an accelerator, the paged
and Pallas decodes) the decode step scans the stacked layers.
"""
from __future__ import annotations

import jax
import numpy as np

from muajax.models.qwen3 import Qwen3Config


def layer_views(params, cfg: Qwen3Config) -> list | None:
    """[per-layer params] views of `params["layers"]`, or None where they cannot alias it
    (leaves not single CPU-device arrays)."""
    leaves, treedef = jax.tree.flatten(params["layers"])
    if not all(isinstance(x, jax.Array) and len(x.devices()) == 1 and next(iter(x.devices())).platform == "cpu"
               for x in leaves):
        return None
    hosts, layers = [np.asarray(x) for x in leaves], cfg.num_layers
    # one device_put for all the views: per-array calls cost ~2x as much host time
    flat = jax.device_put([h[i] for i in range(layers) for h in hosts], next(iter(leaves[0].devices())))
    return [treedef.unflatten(flat[i * len(hosts):(i + 1) * len(hosts)]) for i in range(layers)]
