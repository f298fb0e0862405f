"""`python -m muajax.export --checkpoint DIR --out HF_DIR [--dtype bfloat16|float32]`.

Writes a Hugging Face Qwen3 directory that `transformers` loads as `Qwen3ForCausalLM`:
weights (`muajax.models.hf.save_hf`: streamed one tensor at a time, in the checkpoint's own
dtype unless --dtype says otherwise), config.json, the tokenizer files (with Qwen3's chat
template) and a generation_config.json (Qwen3's special ids; greedy, the setting MUA-RL
evaluates at).

Domain-vocabulary models (`model.vocab: domain`, tiny CPU runs) are *expanded* back to
Qwen3's 151,936 ids rather than refused, so the export works with the stock tokenizer:
each embedding row (and, untied, each LM-head column) is scattered to its Qwen3 id and
every other row is zero. The consequence to know: the logit of an id outside the domain
is exactly 0, not -inf (Qwen3 has no LM-head bias that could push it down), so the
exported model can sample such ids where the muajax model could only produce its single
UNK id. Greedy decoding is unaffected whenever an in-domain logit is above 0. The domain's
UNK row and the padding rows of the compact vocabulary have no Qwen3 id and are dropped.
`muajax_export.json` records what was done.

Ends with one JSON line: the output directory, files, dtype and parameter count.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

QWEN3_VOCAB_SIZE = 151936
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                    "added_tokens.json", "chat_template.jinja", "chat_template.json")


def expand_domain_vocab(params, model_cfg, vocab, vocab_size: int = QWEN3_VOCAB_SIZE):
    """(params, cfg) with the compact vocabulary scattered back to Qwen3 ids: the embedding
    (and an untied head) on the host, widened; every other leaf stays where it is (the
    export streams them a layer at a time)."""
    from muajax.models.host_blocks import host_array

    ids = np.asarray(vocab.qwen_ids, np.int64)
    if ids.max() >= vocab_size:
        raise ValueError(f"the domain vocabulary holds id {ids.max()}, beyond vocab_size={vocab_size}")
    embed = host_array(params["embed"])
    wide = np.zeros((vocab_size, embed.shape[1]), embed.dtype)
    wide[ids] = embed[: len(ids)]
    out = dict(params, embed=wide)
    if not model_cfg.tie_word_embeddings:
        head = host_array(params["lm_head"])  # [hidden, vocab]
        wide_head = np.zeros((head.shape[0], vocab_size), head.dtype)
        wide_head[:, ids] = head[:, : len(ids)]
        out["lm_head"] = wide_head
    return out, model_cfg.replace(vocab_size=vocab_size)


def _tokenizer_source(policy) -> str:
    from muajax.models.tokenizer import bundled_tokenizer_dir

    if policy.kind == "hf" and os.path.isfile(os.path.join(policy.path, "tokenizer.json")):
        return policy.path
    hf_dir = getattr(getattr(policy.config, "model", None), "hf_dir", None) if policy.config else None
    if hf_dir and os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return hf_dir
    return bundled_tokenizer_dir()


def write_tokenizer(policy, out_dir: str) -> list[str]:
    """Copy the tokenizer files verbatim: the bundled tokenizer's config carries Qwen3's chat
    template, which a tokenizer rebuilt from tokenizer.json alone would lose."""
    source = _tokenizer_source(policy)
    copied = []
    for name in _TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(out_dir, name))
            copied.append(name)
    if "tokenizer.json" not in copied:
        raise RuntimeError(f"{source}: no tokenizer.json to export")
    return copied


def write_generation_config(out_dir: str) -> str:
    from muajax.models.tokenizer import IM_END_ID, PAD_ID

    config = {"bos_token_id": PAD_ID, "eos_token_id": [IM_END_ID, PAD_ID], "pad_token_id": PAD_ID,
              "do_sample": False}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return "generation_config.json"


def checkpoint_dtype(params) -> str:
    """The dtype the checkpoint's params are stored in (the export's default)."""
    import jax

    dtypes = sorted({str(np.dtype(leaf.dtype)) for leaf in jax.tree.leaves(params)})
    if len(dtypes) != 1:
        raise ValueError(f"the checkpoint's params mix dtypes {dtypes}: pass --dtype")
    return dtypes[0]


def export(checkpoint: str, out_dir: str, *, dtype: str | None = None, stage: str | None = None,
           step: int | None = None, overwrite: bool = False) -> dict:
    from muajax.models.hf import save_hf
    from muajax.runtime.policy import load_policy

    if os.path.abspath(out_dir) == os.path.abspath(checkpoint):
        raise ValueError(f"--out {out_dir} is the checkpoint itself; choose another directory")
    # stale shards of an earlier export would sit beside the new ones and confuse loaders
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ValueError(f"--out {out_dir} exists and is not empty (pass --overwrite to write into it)")
    policy = load_policy(checkpoint, stage=stage, step=step)
    params, model_cfg = policy.params, policy.model_cfg
    note = None
    if policy.vocab is not None:
        params, model_cfg = expand_domain_vocab(params, model_cfg, policy.vocab)
        note = (f"domain vocabulary of {len(policy.vocab.qwen_ids)} Qwen3 ids expanded to {QWEN3_VOCAB_SIZE}: rows of "
                "other ids are zero, so their logits are exactly 0 (not -inf)")
    dtype = dtype or checkpoint_dtype(params)
    files = save_hf(params, model_cfg, out_dir, dtype=dtype) + ["config.json"]
    files += write_tokenizer(policy, out_dir)
    files.append(write_generation_config(out_dir))
    info = {"source": policy.path, "kind": policy.kind, "stage": policy.stage, "step": policy.step, "dtype": dtype,
            "vocab_size": model_cfg.vocab_size, "domain_vocab_ids": None if policy.vocab is None else
            len(policy.vocab.qwen_ids), "note": note}
    with open(os.path.join(out_dir, "muajax_export.json"), "w") as f:
        json.dump(info, f, indent=2)
    files.append("muajax_export.json")
    return {"out": os.path.abspath(out_dir), "files": files, "dtype": dtype, "vocab_size": model_cfg.vocab_size,
            "num_params": model_cfg.num_params(), "domain_vocab_expanded": policy.vocab is not None,
            "source": policy.path}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m muajax.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="muajax run/checkpoint directory or HF directory")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="weights dtype (default: the checkpoint's)")
    parser.add_argument("--stage", choices=("sft", "grpo"), help="which stage of a run (default: the latest)")
    parser.add_argument("--step", type=int, help="which step (default: the newest)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from muajax.runtime.policy import PolicyLoadError

    start = time.time()
    try:
        result = export(args.checkpoint, args.out, dtype=args.dtype, stage=args.stage, step=args.step,
                        overwrite=args.overwrite)
    except (PolicyLoadError, ValueError) as e:
        print(f"muajax.export: error: {e}", file=sys.stderr)
        print(json.dumps({"error": str(e)}), flush=True)
        return 2
    print(f"exported {result['source']} -> {result['out']} ({result['dtype']}, {result['num_params']:,} params)",
          flush=True)
    print(json.dumps({**result, "wall_s": round(time.time() - start, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
