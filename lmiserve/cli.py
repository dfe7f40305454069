"""`lmiserve serve`: parse arguments, build settings, serve (server/lifecycle.py); `lmiserve options`: every
setting with its default and meaning (lmiserve/config/reference.py); `lmiserve bench`; `lmiserve download`
(models/download/command.py); `lmiserve --version`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import NoReturn

from lmiserve.bench.cli import add_bench_parser, run_bench_command
from lmiserve.config import ConfigError, load_settings, parse_override
from lmiserve.config.flags import add_setting_flags, flag_values
from lmiserve.config.reference import group_of, option_docs, render_markdown, render_text, search
from lmiserve.core import threads
from lmiserve.models.download.command import add_download_parser, run_download_command

SERVE_EPILOG = """\
Every setting is also an option: -o KEY=VALUE (repeatable), the OPTION_<KEY> environment variable, or
KEY=VALUE in serving.properties. Highest precedence first: command line (a flag beats -o), environment,
serving.properties, defaults. An unknown -o key is an error.

  lmiserve options                 every key with its default and meaning
  lmiserve options --search batch  the keys that mention "batch"
  lmiserve options --markdown      the same as docs/configuration.md
"""


def version() -> str:
    """The installed package's version (its metadata), else the source tree's."""
    try:
        return metadata.version("lmiserve")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree that is not installed
        from lmiserve import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmiserve", description="LLM inference server (LMI, TGI and OpenAI protocols)"
    )
    parser.add_argument("--version", action="version", version=f"lmiserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP",
        description="Serve a model over HTTP (LMI, TGI, OpenAI, KServe V2, TF Serving, SageMaker, Vertex AI).",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="the model to serve, as in vLLM's `vllm serve MODEL` (the same as --model-id)",
    )
    where = serve.add_argument_group("configuration sources")
    where.add_argument("--model-dir", help="directory holding serving.properties and/or weights (like /opt/ml/model)")
    where.add_argument("--properties", metavar="FILE", help="a serving.properties file")
    where.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any setting (repeatable); `lmiserve options` lists them",
    )
    add_setting_flags(serve, lambda key: group_of(key).lower())
    options = sub.add_parser(
        "options",
        help="list every setting (-o KEY=VALUE) with its default and meaning",
        description="Every setting: its key (-o KEY=VALUE, serving.properties), default and meaning.",
    )
    options.add_argument("--search", metavar="WORD", help="only the settings that mention WORD (any case)")
    options.add_argument("--markdown", action="store_true", help="as Markdown (the page docs/configuration.md)")
    add_bench_parser(sub)
    add_download_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return run_bench_command(args, argv)
    if args.command == "download":
        return run_download_command(args)
    if args.command == "options":
        return print_options(args.search, args.markdown)
    with held_config_logs() as held:
        try:
            overrides: dict[str, object] = {}
            labels: dict[str, str] = {}
            for text in args.option:
                key, value = parse_override(text)
                overrides[key], labels[key] = value, "command line -o"
            values, sources = flag_values(args)  # a flag beats -o for the same key
            if args.model is not None:  # vLLM's positional MODEL
                if values.get("model_id", args.model) != args.model:
                    flag = sources["model_id"].removeprefix("command line ")
                    raise ConfigError(f"two models: MODEL {args.model} and {flag} {values['model_id']}")
                values["model_id"], sources["model_id"] = args.model, "command line MODEL"
            overrides.update(values)
            labels.update(sources)
            settings = load_settings(
                overrides, properties_file=args.properties, model_dir=args.model_dir, cli_sources=labels
            )
            # OpenMP reads its thread count and wait policy once, when torch is first imported (below)
            threads.prepare_environment(threads.choose(settings.num_threads))
            services = store_services(settings, settings.model_store) if settings.model_store else None
        except ConfigError as exc:
            for record in held:
                if record.levelno >= logging.WARNING:
                    print(f"lmiserve: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)
            print(f"lmiserve: configuration error: {exc}", file=sys.stderr)
            return 2  # ExitCode.CONFIG_ERROR (lmiserve/server/lifecycle.py, imported with uvicorn only to serve)
    return serve(settings, services, held)


@contextlib.contextmanager
def held_config_logs() -> Iterator[list[logging.LogRecord]]:
    """Keep what the configuration layer logs (unknown keys, LMI engine names) while settings are built,
    before logging is configured from them; `serve` logs the records then, in the chosen format."""
    records: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("lmiserve.config")
    handler, level, propagate = Hold(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def print_options(word: str | None, markdown: bool) -> int:
    """`lmiserve options`: the reference as a text table (or Markdown), optionally only what mentions `word`."""
    docs = option_docs()
    if word:
        docs = search(docs, word)
        if not docs:
            print(f"lmiserve: no setting mentions {word!r}", file=sys.stderr)
            return 1
    if markdown:
        text = render_markdown(docs, page=not word)
    else:
        text = render_text(docs, width=min(max(shutil.get_terminal_size((100, 24)).columns, 80), 140))
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `lmiserve options | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


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


def start_threads(option: int | None, log: logging.Logger) -> None:
    """Apply and log the thread count `main` prepared before torch was imported (core/threads.py); unless
    the user named it, the CPU thread lowers it while other processes take cores (engine/cpu_threads.py)."""
    from lmiserve.engine import cpu_threads, torch_thread

    choice = threads.prepared(option)
    cpu_threads.apply(choice.threads)
    torch_thread.GOVERN = not choice.given
    follows = "fixed" if choice.given else "lowered while other processes take the CPUs"
    log.info("threads: %d (%s; %s); OpenMP wait: %s", choice.threads, choice.reason, follows, choice.wait_policy)


def serve(settings, services: list | None = None, held: list[logging.LogRecord] | None = None) -> NoReturn:
    """Serve until stopped, then exit the process with a `lmiserve.server.lifecycle.ExitCode` (see
    docs/shutdown.md, "Signals and exit codes"). `held`: log records of the configuration, logged once logging is
    configured."""
    from lmiserve.models.service import ModelService
    from lmiserve.server.lifecycle import Lifecycle, exit_process, startup_summary
    from lmiserve.server.log_setup import configure_logging
    from lmiserve.server.playground import url as playground_url

    configure_logging(settings.log_level, settings.log_format)
    for record in held or []:
        if record.levelno >= logging.getLogger(record.name).getEffectiveLevel():
            logging.getLogger(record.name).handle(record)
    log = logging.getLogger("lmiserve")
    if settings.node_rank > 0:  # a tensor-parallel node that only computes (docs/tensor-parallel.md)
        from lmiserve.models.service import run_worker_node
        from lmiserve.server.lifecycle import ExitCode, say

        log.info(
            "node %d of %d: tensor-parallel workers only (node 0 serves HTTP)", settings.node_rank, settings.nnodes
        )
        try:
            code = run_worker_node(settings)
        except Exception as exc:  # noqa: BLE001 - one line, as a failed start of the leader says it
            from lmiserve.models.download import DownloadError

            downloading = isinstance(exc, DownloadError)
            say(f"{'model download failed: ' if downloading else ''}{exc}")
            failed = ExitCode.MODEL_DOWNLOAD_FAILED if downloading else ExitCode.MODEL_LOAD_FAILED
            code = int(failed)
        exit_process(code)
    services = services or [ModelService(settings)]
    for line in startup_summary(settings, services, version()):
        log.info("%s", line)
    for line in settings.summary():
        log.debug("option %s", line)
    log.info("playground: %s", playground_url(settings))
    start_threads(settings.num_threads, log)
    exit_process(Lifecycle().serve(settings, services))


if __name__ == "__main__":
    raise SystemExit(main())
