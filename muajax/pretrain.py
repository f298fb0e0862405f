"""`python -m muajax.pretrain --out DIR [--config FILE] [key=value ...]`: a tiny base model.

MUA-RL starts from a pretrained Qwen3, which arrives able to copy a name, a zip code or an
order id from the conversation into a tool call. A tiny model trained from scratch learns
that skill only from millions of dense examples, far more than fit in the embedded
default's fifteen minutes. This command is the miniature's pretraining, run once: a tiny
Qwen3 trained from scratch on tool-call windows of the built-in expert's conversations in
shops *other* than the ones a run trains and evaluates on (`muajax.envs.builtin.warmup`;
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
import time

BASE_META_FILE = "muajax_base.json"
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                              "embedded-pretrain.yaml")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m muajax.pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the base model's directory (Hugging Face format)")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (default: %(default)s)")
    parser.add_argument("--save-every", type=int, default=0, help="also write DIR/step-N every N steps")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.domain_warmup_steps=100")
    return parser.parse_args(argv)


def write_base(out_dir: str, params, model_cfg, tokenizer, meta: dict) -> None:
    """The HF directory, its domain vocabulary and its record, each file written whole."""
    from muajax.models.hf import save_hf
    from muajax.models.vocab import DOMAIN_VOCAB_FILE

    save_hf(params, model_cfg, out_dir)
    tokenizer.vocab.save(os.path.join(out_dir, DOMAIN_VOCAB_FILE))
    tmp = os.path.join(out_dir, BASE_META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, BASE_META_FILE))


def pretrain(cfg, out_dir: str, *, save_every: int = 0, command: str = "") -> dict:
    """Train the base described by `cfg` (its model.arch, sft optimizer and sft.domain_warmup_*)
    and write it to `out_dir`; returns its figures."""
    from muajax import runtime
    from muajax.envs.builtin.warmup import warmup_shop_seeds
    from muajax.trainer import Trainer

    start = time.time()
    trainer = Trainer(cfg)
    s = cfg.sft
    shops = [cfg.env.builtin_seed, *warmup_shop_seeds(cfg.env.builtin_seed, s.domain_warmup_shops)]
    meta = {"command": command, "steps": s.domain_warmup_steps, "batch_size": s.domain_warmup_batch_size,
            "learning_rate": s.learning_rate, "system_prompt": s.domain_warmup_system_prompt,
            "vocab_size": len(trainer.tok)}
    if trainer.hf_dir:  # continued from an earlier base: its shops count as seen too
        with open(os.path.join(trainer.hf_dir, BASE_META_FILE)) as f:
            meta["init"] = json.load(f)
        shops = sorted(set(shops) | set(meta["init"]["shop_seeds"]))
    meta["shop_seeds"] = shops

    def snapshot(step: int, params, nll: float) -> None:
        if save_every and step % save_every == 0 and step < s.domain_warmup_steps:
            write_base(os.path.join(out_dir, f"step-{step}"), params, trainer.model_cfg, trainer.tok,
                       dict(meta, steps=step, nll=nll, wall_s=time.time() - start))

    params = runtime.initial_params(trainer.model_cfg, trainer.hf_dir, trainer.mesh, cfg.run.seed)
    params = trainer.domain_warmup(params, on_step=snapshot)
    figures = {"out": out_dir, "steps": s.domain_warmup_steps, "nll": trainer.summary["domain_warmup_nll"],
               "nll_first": trainer.summary["domain_warmup_nll_first"], "wall_s": round(time.time() - start, 1)}
    write_base(out_dir, params, trainer.model_cfg, trainer.tok, dict(meta, **figures))
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from muajax.config import ConfigError, dump_yaml, load_config

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
    print(json.dumps(pretrain(cfg, args.out, save_every=args.save_every, command=command)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
