"""Credentials that hide inside values rather than under a key: a URL's userinfo
(`https://user:KEY@host`), a URL query parameter named like a key, token, secret, password
or signature (`?api_key=KEY`, `&X-Amz-Signature=...`), an HTTP credential
(`Bearer KEY`), and command-line arguments (`--token=KEY`, `--api-key KEY`, `--password`).

`value_credentials(text)` and `argument_credentials(args)` say *where* a credential sits,
never what it is: configs refuse such values with a message naming the key, and the
message must not echo the secret. `redact(text)` and `redact_arguments(args)` replace the
secrets with `***` for reprs and logs. Like the rest of the config machinery this imports
nothing else of muajax, so any layer may use it.
"""
from __future__ import annotations

import re
import urllib.parse
from collections.abc import Sequence

__all__ = ["REDACTED", "looks_secret_name", "value_credentials", "argument_credentials", "redact",
           "redact_url", "redact_arguments"]

REDACTED = "***"

# A name whose last word is one of these: `api_key`, `apiKey`, `X-Amz-Signature`, `sig`,
# `access_token`, `client_secret`, `password`, `pwd`, `auth`. Names that only refer to a
# secret (`api_key_env`, `token_file`) end in another word and pass.
_SECRET_LAST_WORD = re.compile(r"(?:key|token|secret|passw(?:or)?d|pwd|signature|sig|credentials?|auth)$")
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
# An Authorization header's value; a bare "Bearer <long token>" too. Plain words after
# "Basic" or "Token" in prose ("Basic information") are not credentials.
_HTTP_CREDENTIAL = re.compile(r"(Authorization:\s*(?:Bearer|Basic|Token)|\bBearer)\s+([A-Za-z0-9._~+/=-]{16,})",
                              re.IGNORECASE)
_FLAG = re.compile(r"^(--?[A-Za-z][A-Za-z0-9_.-]*)(?:=(.*))?$", re.DOTALL)


def looks_secret_name(name: str) -> bool:
    """True for a parameter or flag name that holds a secret (`token`, `api-key`, `apiKey`)."""
    squashed = re.sub(r"[^a-z0-9]", "", name.lower())
    return bool(squashed) and bool(_SECRET_LAST_WORD.search(squashed))


def _url_credentials(url: str) -> list[str]:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return []
    found = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        found.append("a password in the URL's userinfo (user:password@host)" if ":" in userinfo
                     else "a credential in the URL's userinfo (user@host)")
    for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if looks_secret_name(name):
            found.append(f"the URL query parameter {name!r}")
    return found


def value_credentials(text: str) -> list[str]:
    """Where `text` holds credentials (descriptions without the secrets), or []."""
    if not isinstance(text, str):
        return []
    found = [where for url in _URL.findall(text) for where in _url_credentials(url)]
    found += ["an HTTP Authorization credential" for _ in _HTTP_CREDENTIAL.finditer(text)]
    return found


def argument_credentials(args: Sequence[str]) -> list[tuple[int, str]]:
    """Where a command line holds credentials, as (index of the argument, description): a
    secret-named flag with a value (`--token=X`, `--api-key X`: the value's index), or a
    credential inside any argument."""
    found = []
    for i, arg in enumerate(args):
        if not isinstance(arg, str):
            continue
        flag = _FLAG.match(arg)
        if flag and looks_secret_name(flag.group(1)):
            inline, following = flag.group(2), args[i + 1] if i + 1 < len(args) else None
            if inline:
                found.append((i, f"the value of argument {flag.group(1)!r}"))
                continue
            if inline is None and isinstance(following, str) and not following.startswith("-"):
                found.append((i + 1, f"the value of argument {flag.group(1)!r}"))
                continue
        found += [(i, where) for where in value_credentials(arg)]
    return found


def redact_url(url: str) -> str:
    """`url` with its userinfo and secret-named query values replaced by ***."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{name}={REDACTED if looks_secret_name(name) else value}" for name, value in pairs)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(text: str) -> str:
    """`text` with every credential inside URLs and HTTP credentials replaced by ***."""
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    return _HTTP_CREDENTIAL.sub(lambda m: f"{m.group(1)} {REDACTED}", text)


def redact_arguments(args: Sequence[str]) -> list[str]:
    """A command line with the values of secret-named flags and credentials in URLs hidden."""
    out, hide_next = [], False
    for arg in args:
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        flag = _FLAG.match(arg)
        if flag and looks_secret_name(flag.group(1)):
            if flag.group(2) is not None:
                out.append(f"{flag.group(1)}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact(arg))
    return out
