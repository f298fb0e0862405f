"""`python -m muajax.pretrain --out DIR [--config FILE] [key=value ...]`: a tiny base model.

MUA-RL starts from a pretrained Qwen3, which arrives able to copy a name, a zip code or an
order id from the conversation into a tool call. A tiny model trained from scratch learns
that skill only from millions of dense examples, far more than fit in the embedded
default's fifteen minutes. This command is the miniature's pretraining, run once: a tiny
Qwen3 trained from scratch on tool-call windows of the built-in expert's conversations in
shops *other* than the ones a run trains and evaluates on (`muajax.domains.builtin.copy_windows`,
`muajax.train.pretraining.pretrain_base`;
shops `env.builtin_seed` + 1 .. + `sft.domain_warmup_shops`), careful and careless with
even odds, so it carries no preference on when to write.

DIR becomes a Hugging Face Qwen3 directory (config.json, model.safetensors) with the
compact vocabulary in `domain_vocab.json` and `muajax_base.json` (the shops it saw, its
steps, loss and wall time). A run loads it with `model.hf_dir=DIR model.vocab=domain`; a
run on one of those shops is refused, so held-out tasks stay held out. With `model.hf_dir`
instead of `model.arch` it goes on from an earlier base (whose shops it adds to its own).
`configs/embedded-base/` was made in two phases (README, "Base models for CPU runs"):
`configs/embedded-pretrain.yaml`, then `configs/embedded-pretrain-prompt.yaml`.

`--save-every N` also writes DIR/step-N snapshots. Ends with one JSON line of its figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from muajax.settings.loader import dump_yaml
from muajax.config.schema import ConfigError, load_config
from muajax.train.pretraining import pretrain_base

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                              "embedded-pretrain.yaml")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m muajax.pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the base model's directory (Hugging Face format)")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (default: %(default)s)")
    parser.add_argument("--save-every", type=int, default=0, help="also write DIR/step-N every N steps")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.domain_warmup_steps=100")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.env.domain != "builtin" or cfg.model.preset or cfg.model.vocab != "domain":
            raise ConfigError("muajax.pretrain trains a domain-vocabulary model (model.vocab=domain) from scratch "
                              "(model.arch) or from an earlier base (model.hf_dir) on the built-in domain")
        if not cfg.sft.domain_warmup_steps:
            raise ConfigError("sft.domain_warmup_steps: the number of pretraining steps must be at least 1")
    except (ConfigError, FileNotFoundError) as exc:
        print(f"muajax.pretrain: config error: {exc}", file=sys.stderr)
        return 2
    print(f"# muajax.pretrain config ({args.config})\n{dump_yaml(cfg)}", flush=True)
    command = " ".join(["python -m muajax.pretrain", *(sys.argv[1:] if argv is None else argv)])
    print(json.dumps(pretrain_base(cfg, args.out, save_every=args.save_every, command=command)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
