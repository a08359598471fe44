"""Probe a running `vllm serve` the way a stranger would: which routes answer without a key,
with a wrong key and with a right one, and how hostile requests are refused.

    vllm serve smollm2 --port 8000                         # open: no key
    python examples/security_probe.py --url http://127.0.0.1:8000
    vllm serve smollm2 --port 8001 --api-key k1 k2         # two keys
    python examples/security_probe.py --url http://127.0.0.1:8001 --api-key k1 --other-key k2

Each line prints the request, the status it got and the status the README's Security section
says it should get; the exit status is 1 when any differs. Only the loopback or your own hosts
should be probed.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Probe:
    """One request and the status the documentation promises for it."""

    what: str
    method: str
    path: str
    expected: int
    key: str | None = None
    body: Any = None
    files: dict[str, Any] | None = None
    data: dict[str, str] | None = None
    raw: bytes | None = None


def _send(client: httpx.Client, probe: Probe) -> httpx.Response:
    headers = {"Authorization": f"Bearer {probe.key}"} if probe.key else {}
    if probe.raw is not None:
        headers["Content-Type"] = "application/json"
        return client.request(probe.method, probe.path, content=probe.raw, headers=headers)
    if probe.files is not None:
        return client.request(
            probe.method, probe.path, files=probe.files, data=probe.data, headers=headers
        )
    return client.request(probe.method, probe.path, json=probe.body, headers=headers)


def _upload(key: str | None) -> dict[str, Any]:
    line = {
        "custom_id": "1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "hi", "max_tokens": 1},
    }
    return {"file": ("in.jsonl", io.BytesIO(json.dumps(line).encode()), "application/jsonl")}


def probes(model: str, key: str | None, other: str | None) -> list[Probe]:
    """The requests to send: with `key` the server is expected to have keys (and `other` to be
    a second valid key); without, to have none."""
    authed = 200 if key is None else 401
    good = key
    completion = {"model": model, "prompt": "Hello", "max_tokens": 2}
    out = [
        Probe("health needs no key", "GET", "/health", 200),
        Probe("version needs no key", "GET", "/version", 200),
        Probe("models without a key", "GET", "/v1/models", authed),
        Probe("completion without a key", "POST", "/v1/completions", authed, body=completion),
        Probe("metrics without a key", "GET", "/metrics", authed),
        Probe("files listed without a key", "GET", "/v1/files", authed),
        Probe(
            "admin pipeline without a key",
            "GET",
            "/v1/admin/pipeline",
            403 if key is None else 401,
        ),
        Probe(
            "admin re-split without a key",
            "POST",
            "/v1/admin/reshape_pipeline",
            403 if key is None else 401,
            body={"layer_split": [15, 15]},
        ),
        Probe("malformed JSON", "POST", "/v1/completions", 400, key=good, raw=b"{not json"),
        Probe(
            "negative temperature",
            "POST",
            "/v1/completions",
            400,
            key=good,
            body={**completion, "temperature": -1},
        ),
        Probe(
            "max_tokens beyond the context",
            "POST",
            "/v1/completions",
            400,
            key=good,
            body={**completion, "max_tokens": 10**9},
        ),
        Probe(
            "a known OpenAI field the server does not implement",
            "POST",
            "/v1/chat/completions",
            400,
            key=good,
            body={
                "model": model,
                "messages": [{"role": "user", "content": "hi"}],
                "audio": {"voice": "x"},
            },
        ),
        Probe(
            "a prompt far beyond the context",
            "POST",
            "/v1/completions",
            400,
            key=good,
            body={**completion, "prompt": "word " * 200_000},
        ),
        Probe(
            "a body over the size limit",
            "POST",
            "/v1/completions",
            413,
            key=good,
            raw=b'{"prompt": "' + b"x" * (33 * 2**20) + b'"}',
        ),
        Probe(
            "an upload expiring sooner than OpenAI allows",
            "POST",
            "/v1/files",
            400,
            key=good,
            files=_upload(good),
            data={
                "purpose": "batch",
                "expires_after[anchor]": "created_at",
                "expires_after[seconds]": "60",
            },
        ),
    ]
    if key is not None:
        out += [
            Probe("models with a wrong key", "GET", "/v1/models", 401, key="wrong"),
            Probe("models with the key", "GET", "/v1/models", 200, key=key),
            Probe("admin pipeline with the key", "GET", "/v1/admin/pipeline", 200, key=key),
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="The server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="A key the server accepts (if it has keys).")
    p.add_argument("--other-key", default=None, help="A second key the server accepts.")
    args = p.parse_args(argv)
    failures = 0
    with httpx.Client(base_url=args.url, timeout=120, verify=False) as client:
        model = "m"
        listed = client.get(
            "/v1/models",
            headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {},
        )
        if listed.status_code == 200:
            model = listed.json()["data"][0]["id"]
        for probe in probes(model, args.api_key, args.other_key):
            got = _send(client, probe).status_code
            ok = got == probe.expected
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {got} (documented {probe.expected}): {probe.what}")
        if args.api_key and args.other_key:
            failures += _scoping(client, args.api_key, args.other_key)
    print(f"{failures} answer(s) differ from the documentation")
    return 1 if failures else 0


def _scoping(client: httpx.Client, key: str, other: str) -> int:
    """A file uploaded with one key is invisible to another (404), visible to its owner."""
    made = client.post(
        "/v1/files",
        files=_upload(key),
        data={"purpose": "batch"},
        headers={"Authorization": f"Bearer {key}"},
    )
    if made.status_code != 200:
        print(f"FAIL {made.status_code} (documented 200): upload with the key")
        return 1
    file_id = made.json()["id"]
    failures = 0
    for who, token, expected in (("its owner", key, 200), ("another key", other, 404)):
        got = client.get(
            f"/v1/files/{file_id}", headers={"Authorization": f"Bearer {token}"}
        ).status_code
        ok = got == expected
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {got} (documented {expected}): a file read by {who}")
    client.delete(f"/v1/files/{file_id}", headers={"Authorization": f"Bearer {key}"})
    return failures


if __name__ == "__main__":
    sys.exit(main())
