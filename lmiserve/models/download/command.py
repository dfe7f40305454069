"""`lmiserve download MODEL`: fill the caches ahead of time, from the same sources with the same options as
`lmiserve serve`, for images built with the weights inside and for air-gapped machines (docs/models.md).

It prints the local path of the model on stdout; the progress and the log go to stderr. Exit status: 0 done,
2 a configuration error, 5 the download failed (one line saying why: the same as `lmiserve serve`'s).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

DOWNLOAD_FAILED = 5  # lmiserve.server.lifecycle.ExitCode.MODEL_DOWNLOAD_FAILED (not imported: no uvicorn here)
CONFIG_ERROR = 2


def add_download_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "download",
        help="download a model (Hub id, s3:// or gs:// URL) into the caches, without serving it",
        description=(
            "Download a model into the caches `lmiserve serve` reads: a Hub id into the Hugging Face cache "
            "(HF_HOME, HF_HUB_CACHE), an s3:// or gs:// URL into download_dir. Prints the local path."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="org/name, org/repo:Q4_K_M, s3://bucket/prefix or gs://...")
    parser.add_argument("--revision", help="branch, tag or commit of a Hub model")
    parser.add_argument("--gguf-file", help="the .gguf file of a Hub repository of GGUF files")
    parser.add_argument("--download-dir", help="where s3:// and gs:// models go (default: the user cache)")
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other setting (download_retries, trust_remote_code, ...)",
    )


def run_download_command(args: argparse.Namespace) -> int:
    from lmiserve.config import ConfigError, load_settings, parse_override
    from lmiserve.models.download import FetchOptions, fetch, is_remote
    from lmiserve.models.download.progress import CHATTY_LOGGERS
    from lmiserve.models.errors import ModelLoadError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        overrides: dict[str, object] = dict(parse_override(text) for text in args.option)
        given = {"revision": args.revision, "gguf_file": args.gguf_file, "download_dir": args.download_dir}
        overrides.update({key: value for key, value in given.items() if value is not None})
        overrides["model_id"] = args.model
        settings = load_settings(overrides)
    except ConfigError as exc:
        print(f"lmiserve: configuration error: {exc}", file=sys.stderr)
        return CONFIG_ERROR
    if not is_remote(args.model):
        print(
            f"lmiserve: configuration error: {args.model!r} is not a Hub id (org/name), s3:// or gs:// URL: "
            "nothing to download",
            file=sys.stderr,
        )
        return CONFIG_ERROR
    try:
        path = fetch(args.model, FetchOptions.from_settings(settings))
    except ModelLoadError as exc:
        print(f"lmiserve: model download failed: {args.model}: {' '.join(str(exc).split())}", file=sys.stderr)
        return DOWNLOAD_FAILED
    print(path)
    return 0
