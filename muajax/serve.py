"""`python -m muajax.serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--slots N] [--max-len L]`.

An OpenAI-compatible chat server for a muajax policy (a muajax run/checkpoint directory
or a Hugging Face Qwen3 directory): POST /v1/chat/completions (tools in, `tool_calls`
out; temperature, top_p, max_tokens, seed, stop and `stream` honored) and GET /v1/models.
It is backed by the muajax engine with continuous batching: up to --slots requests
decode together, joining and leaving the batch between decode chunks; more wait in a
queue (--max-queue; beyond it, 503 with Retry-After). Every request is checked before it
reaches the engine: a body over --max-body-bytes gets 413, one nested deeper than
--max-json-depth, or any out-of-range field, 400.

Binds 127.0.0.1 unless told otherwise. With --api-key-env NAME, requests must carry
`Authorization: Bearer <value of $NAME>`; the key is read from the environment only.
Port 0 picks a free port; the line "serving <model> at http://HOST:PORT/v1" says which.
"""
from __future__ import annotations

import argparse
import os
import sys

import uvicorn

from muajax.serving.app import bind, create_app
from muajax.serving.loading import ServeOptions, build_service
from muajax.runtime.policy import PolicyLoadError


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m muajax.serve", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="muajax run/checkpoint directory, or a HF directory")
    p.add_argument("--stage", choices=("sft", "grpo"))
    p.add_argument("--step", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=8, help="requests decoded side by side")
    p.add_argument("--max-len", type=int, default=8192, help="context per request: prompt + completion tokens")
    p.add_argument("--max-tokens", type=int, default=1024, help="completion tokens when a request sets none")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot (beyond the free ones) before 503s; 0: never wait")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body (beyond it, 413)")
    p.add_argument("--max-json-depth", type=int, default=128,
                   help="deepest JSON nesting of a request body or of tool-call arguments (beyond it, 400)")
    p.add_argument("--decode-chunk", type=int, default=16,
                   help="decode steps per engine step: requests join/leave and streams update at this granularity")
    p.add_argument("--model-name", help="the model id clients use (default: the checkpoint directory's name)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"))
    p.add_argument("--api-key-env", help="NAME of an env var holding the key clients must send")
    p.add_argument("--warmup", action="store_true",
                   help="compile every batch/width program before serving (slower start, no compile stalls)")
    args = p.parse_args(argv)
    for name in ("slots", "max_len", "max_tokens", "decode_chunk", "max_body_bytes", "max_json_depth"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_queue < 0:
        p.error("--max-queue must be >= 0")
    if not 0 <= args.port < 65536:
        p.error("--port must be in [0, 65535]")
    if args.api_key_env and not os.environ.get(args.api_key_env):
        p.error(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    return args


def options_from_args(args) -> ServeOptions:
    return ServeOptions(checkpoint=args.checkpoint, stage=args.stage, step=args.step, dtype=args.dtype,
                        slots=args.slots, max_len=args.max_len, max_tokens=args.max_tokens, max_queue=args.max_queue,
                        decode_chunk=args.decode_chunk, model_name=args.model_name, api_key_env=args.api_key_env,
                        warmup=args.warmup, max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        policy, service = build_service(options_from_args(args))
        sock = bind(args.host, args.port)
    except (PolicyLoadError, OSError) as e:
        print(f"muajax.serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"loaded {policy.describe()}", flush=True)
    print(f"serving {service.model_name} at http://{host}:{port}/v1 ({args.slots} slots, context "
          f"{service.max_len})", flush=True)
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
