"""TLS for both HTTP servers, with vLLM's flags handed to uvicorn as vLLM does:
`--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs`, `--ssl-cert-reqs` (an `ssl.CERT_*` value;
CERT_REQUIRED with `--ssl-ca-certs` asks every client for a certificate signed by those CAs).

Without `--ssl-certfile` the server speaks plain HTTP. The files are checked before the
engine starts: a missing one is a ValueError naming its flag, not a uvicorn traceback after
the model has loaded.
"""

from __future__ import annotations

import argparse
import os
import ssl
from typing import Any


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's TLS flags (names, defaults and help as `vllm serve` has them)."""
    parser.add_argument(
        "--ssl-keyfile", type=str, default=None, help="The file path to the SSL key file."
    )
    parser.add_argument(
        "--ssl-certfile", type=str, default=None, help="The file path to the SSL cert file."
    )
    parser.add_argument("--ssl-ca-certs", type=str, default=None, help="The CA certificates file.")
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        help="Whether client certificate is required (see stdlib ssl module's).",
    )


def uvicorn_tls_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `uvicorn.Config` keywords for the TLS flags in `args` (checked: ValueError)."""
    keyfile = getattr(args, "ssl_keyfile", None)
    certfile = getattr(args, "ssl_certfile", None)
    ca_certs = getattr(args, "ssl_ca_certs", None)
    cert_reqs = int(getattr(args, "ssl_cert_reqs", ssl.CERT_NONE))
    if keyfile and not certfile:
        # uvicorn would serve plain HTTP: a key alone does not turn TLS on.
        raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate of that key).")
    if cert_reqs not in {int(v) for v in ssl.VerifyMode}:
        raise ValueError(
            f"--ssl-cert-reqs must be one of {sorted(int(v) for v in ssl.VerifyMode)} "
            f"(ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED), got {cert_reqs}."
        )
    for flag, path in (
        ("--ssl-keyfile", keyfile),
        ("--ssl-certfile", certfile),
        ("--ssl-ca-certs", ca_certs),
    ):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file.")
    return {
        "ssl_keyfile": keyfile,
        "ssl_certfile": certfile,
        "ssl_ca_certs": ca_certs,
        "ssl_cert_reqs": cert_reqs,
    }


def scheme(args: argparse.Namespace) -> str:
    """ "https" when the flags turn TLS on, else "http" (for the startup log line)."""
    return "https" if getattr(args, "ssl_certfile", None) else "http"
