"""`lmiserve serve`: parse arguments, build settings, serve (server/lifecycle.py); and `lmiserve bench`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from lmiserve.bench.cli import add_bench_parser, run_bench_command
from lmiserve.config import ConfigError, load_settings, parse_override


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmiserve", description="LLM inference server (LMI, TGI and OpenAI protocols)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP")
    serve.add_argument(
        "--model-id", help="local transformers directory, .gguf file, or a model id in the local HF cache"
    )
    serve.add_argument("--model-dir", help="directory holding serving.properties and/or weights (like /opt/ml/model)")
    serve.add_argument("--properties", help="a serving.properties file")
    serve.add_argument(
        "--model-store", help="serve every model sub-directory of DIR (named after it); see the README, 'A model store'"
    )
    serve.add_argument("--host", help="bind address (default 0.0.0.0)")
    serve.add_argument("--port", type=int, help="port (default 8080, or SAGEMAKER_BIND_TO_PORT)")
    serve.add_argument(
        "--metrics-port", type=int, help="also serve GET /metrics on this port, open (no API key); see SECURITY.md"
    )
    serve.add_argument(
        "-o", "--option", action="append", default=[], metavar="KEY=VALUE", help="set any option (repeatable)"
    )
    serve.add_argument(
        "--api-key", help="require 'Authorization: Bearer <key>' on every route but health probes (or API_KEY)"
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level (default info)")
    serve.add_argument(
        "--log-format", choices=["text", "json"], help="log lines as text (default) or JSON lines (one object a line)"
    )
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return run_bench_command(args, argv)
    try:
        overrides: dict[str, object] = dict(parse_override(o) for o in args.option)
        for key in ("model_id", "host", "port", "metrics_port", "log_level", "log_format", "api_key", "model_store"):
            value = getattr(args, key)
            if value is not None:
                overrides[key] = value
        settings = load_settings(overrides, properties_file=args.properties, model_dir=args.model_dir)
        services = store_services(settings, settings.model_store) if settings.model_store else None
    except ConfigError as exc:
        print(f"lmiserve: configuration error: {exc}", file=sys.stderr)
        return 2  # ExitCode.CONFIG_ERROR (lmiserve/server/lifecycle.py, imported with uvicorn only to serve)
    return serve(settings, services)


def store_services(settings, store: str) -> list:
    """One ModelService per model directory of the store, each with its own merged settings."""
    from lmiserve.models.service import ModelService
    from lmiserve.models.store import model_settings, scan_store

    if settings.model_id:
        raise ConfigError(
            f"--model-store cannot be combined with model_id ({settings.sources.get('model_id', 'given')}): "
            "put that model in the store as a sub-directory instead"
        )
    services = []
    for name, directory in scan_store(store):
        try:
            services.append(ModelService(model_settings(settings, directory, name), name=name))
        except ConfigError as exc:
            raise ConfigError(f"model {name} ({directory}): {exc}") from None
    return services


def serve(settings, services: list | None = None) -> NoReturn:
    """Serve until stopped, then exit the process with a `lmiserve.server.lifecycle.ExitCode` (see the
    README, "Signals and exit codes")."""
    from lmiserve.models.service import ModelService
    from lmiserve.server.lifecycle import Lifecycle, exit_process
    from lmiserve.server.log_setup import configure_logging
    from lmiserve.server.playground import url as playground_url

    configure_logging(settings.log_level, settings.log_format)
    log = logging.getLogger("lmiserve")
    for line in settings.summary():
        log.info("option %s", line)
    services = services or [ModelService(settings)]
    for service in services:
        log.info("model %s: %s from %s", service.name, service.kind, service.settings.model_id or "the bundled default")
    log.info("playground: %s", playground_url(settings))
    exit_process(Lifecycle().serve(settings, services))


if __name__ == "__main__":
    raise SystemExit(main())
