"""Credentials inside config values (a URL's userinfo or secret query parameter, a secret
command-line argument) are refused naming the key, never echoing the secret; redaction
hides them in what is printed and logged."""
import pytest

from muajax.config.schema import ConfigError, load_config
from muajax.settings.secrets import (argument_credentials, looks_secret_name, redact, redact_arguments, redact_url,
                                   value_credentials)

KEY = "sk-muajax-9f8e7d6c5b4a3210"
MCP = ["env.domain=mcp", "env.mcp.scenarios=[notes.yaml]"]


@pytest.mark.parametrize("overrides, key, where", [
    (["user.base_url=https://me:KEY@api.example.com/v1"], "user.base_url", "a password in the URL's userinfo"),
    (["user.base_url=https://KEY@api.example.com/v1"], "user.base_url", "a credential in the URL's userinfo"),
    (["user.base_url=https://api.example.com/v1?api_key=KEY"], "user.base_url", "the URL query parameter 'api_key'"),
    (["user.base_url=https://h.example/v1?x=1&X-Amz-Signature=KEY"], "user.base_url", "'X-Amz-Signature'"),
    (["user.base_url=https://h.example/v1?accessToken=KEY"], "user.base_url", "'accessToken'"),
    ([*MCP, "env.mcp.servers.notes.command=python", "env.mcp.servers.notes.args=[server.py, --token=KEY]"],
     "env.mcp.servers.notes.args[1]",
     "the value of argument '--token'"),
    ([*MCP, "env.mcp.servers.notes.command=python", "env.mcp.servers.notes.args=[server.py, --api-key, KEY]"],
     "env.mcp.servers.notes.args[2]", "the value of argument '--api-key'"),
    ([*MCP, "env.mcp.servers.notes.command=npx", "env.mcp.servers.notes.args=[srv, --db, 'postgres://app:KEY@db:5432/x']"],
     "env.mcp.servers.notes.args[2]", "userinfo"),
    ([*MCP, "env.mcp.servers.notes.command=srv", "env.mcp.servers.notes.args=[--password, KEY]"],
     "env.mcp.servers.notes.args[1]",
     "'--password'"),
    ([*MCP, "env.mcp.servers.notes.url=https://mcp.example.com/sse?token=KEY"], "env.mcp.servers.notes.url",
     "the URL query parameter 'token'"),
    (["rollout.system_text='Use Authorization: Bearer KEY when calling'"], "rollout.system_text", "Authorization"),
])
def test_credentials_inside_config_values_are_refused_without_echoing_them(overrides, key, where):
    with pytest.raises(ConfigError) as info:
        load_config(None, [o.replace("KEY", KEY) for o in overrides])
    message = str(info.value)
    assert f"'{key}' holds a credential (" in message and where in message, message
    assert KEY not in message and "environment variable" in message


def test_a_config_file_with_a_credential_is_refused_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"user:\n  kind: openai\n  model: m\n  base_url: https://u:{KEY}@api.example.com/v1\n")
    with pytest.raises(ConfigError, match=r"'user.base_url' holds a credential") as info:
        load_config(path)
    assert KEY not in str(info.value)
    # other errors that quote a value do not echo a credential inside it either
    with pytest.raises(ConfigError, match=r"'user.timeout_s' must be a float") as info:
        load_config(None, [f"user.timeout_s=https://u:{KEY}@h.example/v1"])
    assert KEY not in str(info.value) and "https://***@h.example/v1" in str(info.value)


def test_values_that_only_look_alike_pass():
    cfg = load_config(None, [
        "user.base_url=http://127.0.0.1:8000/v1?model=x&page=2", *MCP,
        "env.mcp.servers.notes.command=python",
        "env.mcp.servers.notes.args=[s.py, --port, '8080', --max-tokens, '5', --token-file, /run/t,"
        " --api-key-env, MY_KEY, --verbose, --auth]", "rollout.system_text='Basic information: tokens cost money.'"])
    assert cfg.env.mcp.servers["notes"].args[2] == "8080"
    assert not value_credentials("see https://example.com/docs?q=keyboard#token")


def test_names_and_arguments():
    for name in ("api_key", "apiKey", "X-Api-Key", "token", "access_token", "client_secret", "password", "pwd",
                 "X-Amz-Signature", "sig", "auth", "credentials"):
        assert looks_secret_name(name), name
    for name in ("api_key_env", "token_file", "max_tokens", "tokenizer", "keyword", "page", "model", "signed"):
        assert not looks_secret_name(name), name
    assert argument_credentials(["--token", "--port", "1"]) == []  # a flag with no value holds nothing
    assert argument_credentials(["--api-key"]) == []
    assert argument_credentials(["a", "--api-key", "K"]) == [(2, "the value of argument '--api-key'")]


def test_redaction():
    assert redact_url(f"https://me:{KEY}@api.example.com/v1?api_key={KEY}&m=1") == \
        "https://***@api.example.com/v1?api_key=***&m=1"
    text = redact(f"POST https://api.example.com/v1?token={KEY} failed; Authorization: Bearer {KEY}")
    assert KEY not in text and "token=***" in text and "Bearer ***" in text
    assert redact_arguments(["srv", f"--token={KEY}", "--api-key", KEY, "--port", "1", f"http://u:{KEY}@h"]) == \
        ["srv", "--token=***", "--api-key", "***", "--port", "1", "http://***@h"]
