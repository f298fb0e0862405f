"""One real server on 127.0.0.1 for the serving tests: the chain model of tests/test_serve.py
(greedy, it always writes CHAIN_TEXT; sampled, its text depends on the seed), 4 slots."""
import httpx
import pytest

from tests.test_serve import MODEL, chain_model

CONTEXT = 1024
MAX_BODY_BYTES = 256 * 1024


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    from muajax.serve import build_service, parse_args
    from muajax.serving.app import BackgroundServer, create_app

    args = parse_args(["--checkpoint", chain_model(tmp_path_factory), "--model-name", MODEL, "--slots", "4",
                       "--max-len", str(CONTEXT), "--max-tokens", "64", "--decode-chunk", "8", "--port", "0",
                       "--max-body-bytes", str(MAX_BODY_BYTES)])
    _, service = build_service(args)
    with BackgroundServer(create_app(service)) as server:
        server.service = service
        server.base = server.url.removesuffix("/v1")
        yield server


def health(server) -> dict:
    return httpx.get(server.base + "/health", timeout=30).json()
