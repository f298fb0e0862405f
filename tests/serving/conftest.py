"""One real server on 127.0.0.1 for the serving tests: the chain model of tests/serving/test_serve.py
(greedy, it always writes CHAIN_TEXT; sampled, its text depends on the seed), 4 slots."""
import httpx
import pytest

from tests.serving.test_serve import MODEL, chain_model

CONTEXT = 1024
MAX_BODY_BYTES = 256 * 1024


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    from muajax.serving.app import BackgroundServer, create_app
    from muajax.serving.loading import ServeOptions, build_service

    _, service = build_service(ServeOptions(checkpoint=chain_model(tmp_path_factory), model_name=MODEL, slots=4,
                                            max_len=CONTEXT, max_tokens=64, decode_chunk=8,
                                            max_body_bytes=MAX_BODY_BYTES))
    with BackgroundServer(create_app(service)) as server:
        server.service = service
        server.base = server.url.removesuffix("/v1")
        yield server


def health(server) -> dict:
    return httpx.get(server.base + "/health", timeout=30).json()
