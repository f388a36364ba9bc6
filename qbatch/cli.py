"""The command line: parse flags, merge them with the job file, call the library.

Library code raises `QbatchError`s; this module alone turns them into
`Error: ...` / `Hint: ...` messages and exit codes. Unknown failures keep
their traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import shlex
import sys
import typing
from collections.abc import Callable, Iterator
from typing import Any

import click

from qbatch._fs import is_url
from qbatch.log import log, setup as setup_log
from qbatch.errors import Interrupted, QbatchError
from qbatch.spec import DEFAULT_MODEL, ENGINE_SETTINGS, SECTIONS, SERVE_SETTINGS, JobSpec, applies_to, choices, declared
from qbatch.spec import load_job_file
from qbatch.versions import __version__
from qbatch.bench.workloads import WORKLOADS as BENCH_WORKLOADS


# The panels of every command's --help, in the order they show (after the summary and the examples), and the
# panel of each option: a setting's is declared with it (spec.py), the others' here; tests/test_cli_help.py
# fails on an option that has none. Names are the options' parameter names, one panel whatever the command.
HELP_PANELS = ("Input", "Prompt and template", "Sampling", "Structured output", "Embeddings", "Model and engine",
               "GPUs and scaling", "Chunks and order", "Output", "Exit codes and resume", "Service", "Benchmark",
               "Quantization", "Other")
PANEL_OF = {**{f.name: declared(f).panel for cls in SECTIONS.values() for f in dataclasses.fields(cls)},
            **{name: panel for panel, names in {
                "Input": ("job",), "Output": ("path", "as_json", "full_plan", "json_path", "verbose"),
                "Service": ("server", "api_key", "data_dir", "host", "port", "max_upload_bytes", "max_requests",
                            "completion_window_s"),
                "Benchmark": ("modes", "rows", "hf_rows", "repeats", "length_scale", "workload_seed", "legacy_seed",
                              "settings", "variant", "vllm_defaults", "null_engine", "prompts", "work_dir",
                              "inputs_only"),
                "Quantization": ("w_bit", "group_size", "zero_point", "awq_version", "legacy_version", "calib",
                                 "calib_samples", "calib_seq_len"),
                "Other": ("help", "version")}.items() for name in names}}


class PanelCommand(click.Command):
    """A command whose --help lists its options in HELP_PANELS' panels, plain text (no colour, no boxes:
    the same in a terminal, a pipe and the docs)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        panels: dict[str, list[tuple[str, str]]] = {panel: [] for panel in HELP_PANELS}
        help_option = self.get_help_option(ctx)
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and isinstance(param, click.Option):  # arguments show in the usage line
                name = "help" if param is help_option else param.name or ""
                panels.setdefault(PANEL_OF.get(name, "Options"), []).append(record)
        for panel, records in panels.items():
            if records:
                with formatter.section(panel):
                    formatter.write_dl(records)


class QbatchGroup(click.Group):
    command_class = PanelCommand

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except QbatchError as exc:
            click.echo(f"Error: {exc}", err=True)
            if exc.hint:
                click.echo(f"Hint: {exc.hint}", err=True)
            sys.exit(exc.exit_code)
        except Interrupted as exc:  # a signal outside a run's own handling (e.g. while shutting down)
            click.echo(f"Error: interrupted by {exc.signal_name}", err=True)
            sys.exit(exc.exit_code)


def _echo_interrupted(exc: Interrupted, output_dir: str | None) -> None:
    """What a signal did to a run, and the command that resumes it."""
    where = f" ({output_dir})" if output_dir else ""
    click.echo(f"Error: interrupted by {exc.signal_name}{where}: finished parts are kept, "
               "rows in flight are redone on resume", err=True)
    command = f": qbatch {shlex.join(sys.argv[1:])}" if sys.argv[1:2] in (["run"], ["embed"]) else ""
    click.echo(f"Hint: rerun the same command to resume{command}", err=True)


@click.group(cls=QbatchGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="qbatch")
def cli() -> None:
    """Offline batch inference for small LLMs on vLLM.

    Streams JSONL/Parquet prompt files through vLLM in length-sorted,
    token-budgeted chunks and checkpoints results to Parquet, so a killed job
    resumes where it stopped.
    """
    setup_log()  # events on stderr; `run` sets the level from --progress


def _verbosity(ctx: click.Context, param: click.Parameter, value: int) -> None:
    from qbatch.engines.vllm_output import set_verbosity

    set_verbosity(value)


# On the commands that start engines; no job setting (its value is not passed on).
VERBOSE_OPTION = click.option(
    "-v", "--verbose", count=True, expose_value=False, is_eager=True, callback=_verbosity,
    help="Show vLLM's own output on stderr (-vv: at debug level) instead of in the engine log "
         "(OUT_DIR/engine.log; serve: DATA_DIR/engine.log; bench: beside --json).  [env QBATCH_VERBOSE=1]")


def _csv(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    return None if value is None else [item.strip() for item in value.split(",") if item.strip()]


def _adapters(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str] | None:
    """--lora NAME=PATH (repeatable) -> {NAME: PATH}; a name given twice is refused."""
    if not values:
        return None
    adapters: dict[str, str] = {}
    for text in values:
        name, sep, path = (part.strip() for part in text.partition("="))
        if not sep or not name or not path:
            raise click.BadParameter(f"expected NAME=PATH, got '{text}'", ctx=ctx, param=param)
        if name in adapters:
            raise click.BadParameter(f"adapter '{name}' is given twice", ctx=ctx, param=param)
        adapters[name] = path
    return adapters


class FolderOrUrl(click.Path):
    """A local folder, checked as click.Path checks it, or an object store's folder (`s3://bucket/out`),
    checked when it is read."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if isinstance(value, str) and is_url(value) else super().convert(value, param, ctx)


def _paths(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Path arguments in normal form (`out/x`, not `./out/x/` or `a/../out/x`): as every message prints them."""
    from qbatch._fs import normal_path

    if value is None:
        return None
    return tuple(normal_path(v) for v in value) if isinstance(value, tuple) else normal_path(value)


# The flags of the settings, generated from their declarations in spec.py: each one's spelling, type, choices,
# help, shown default and panel. A flag only overrides when given, so none has a default of its own.
def _flagged() -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    """Every setting a flag sets (those with a panel), in the spec's order, with its type."""
    for cls in SECTIONS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if declared(f).panel:
                yield f, hints[f.name]


def _help_text(f: dataclasses.Field[Any]) -> str:
    """The flag's help, and the default it states: the field's own, or what `shown` says decides it."""
    setting = declared(f)
    shown = setting.shown
    if shown is None and f.default is not None and not isinstance(f.default, bool):
        shown = f"{f.default}; env {setting.envvar}" if setting.envvar else str(f.default)
    return setting.help + (f"  [default: {shown}]" if shown else "")


def flag_of(f: dataclasses.Field[Any], hint: Any) -> Callable[[Any], Any]:
    """The click option of one setting."""
    setting = declared(f)
    decls = setting.flags or (f"--{f.name.replace('_', '-')}",)
    kwargs: dict[str, Any] = {"help": _help_text(f)}
    kwargs.update({k: v for k, v in (("metavar", setting.metavar), ("envvar", setting.envvar)) if v})
    kind = next((option for option in typing.get_args(hint) if option is not type(None)), hint)
    allowed = choices(hint)
    if allowed is not None:
        kwargs["type"] = click.Choice(allowed)
    elif kind is bool:
        if not setting.flags and f.default is not False:  # on by default, or decided later: a pair
            decls = (f"{decls[0]}/--no-{f.name.replace('_', '-')}",)
        kwargs.update(default=None, **({} if "/" in decls[-1] else {"is_flag": True}))
    elif setting.folder:
        kwargs["type"] = click.Path(file_okay=False)
    elif kind in (int, float):
        kwargs["type"] = kind
    elif typing.get_origin(kind) is dict:  # lora: NAME=PATH, repeatable
        kwargs.update(multiple=True, callback=_adapters)
    elif typing.get_origin(kind) is list:
        kwargs.update({"multiple": True, "default": None} if setting.repeat else {"callback": _csv})
    return click.option(*decls, f.name, **kwargs)


def setting_options(command: str) -> Callable[[Any], Any]:
    """A decorator adding the flags of the settings `command` (run, embed or serve) takes."""
    task = "embed" if command == "embed" else "generate"
    options = [flag_of(f, hint) for f, hint in _flagged() if applies_to(f.name, task)
               and (command != "serve" or f.name in SERVE_SETTINGS)]

    def add(func: Any) -> Any:
        for one in reversed(options):
            func = one(func)
        return func
    return add


def server_options(func: Any) -> Any:
    for option in reversed(SERVER_OPTIONS):
        func = option(func)
    return func


# Options of `qbatch run` and `qbatch embed` that are no job setting: where the job runs, not what it is
# (no spec, no fingerprint: a job resumes with or without them).
SERVER_OPTIONS = [
    click.option("--server", envvar="QBATCH_SERVER", metavar="URL",
                 help="Hand the job to the `qbatch serve` at URL on this machine (e.g. http://127.0.0.1:8000): its "
                      "warm engines run it, into the same OUT_DIR, with the same summary and exit code. The "
                      "service's engine settings apply; one the job gives must match (its --seed and --lora are its "
                      "own).  [env QBATCH_SERVER]"),
    click.option("--api-key", envvar="QBATCH_API_KEY", metavar="KEY",
                 help="With --server: the service's API key.  [env QBATCH_API_KEY]"),
]
CLI_ONLY = frozenset({"job", "inputs", "server", "api_key"})


def given_values(ctx: click.Context, job: str | None, inputs: tuple[str, ...], **fixed: Any) -> dict[str, Any]:
    """The settings the user gave: the job file's keys < flags given on the command line (< `fixed`: what
    the command itself sets); no defaults."""
    values: dict[str, Any] = load_job_file(job) if job else {}
    for name, value in ctx.params.items():
        if name in CLI_ONLY:
            continue
        source = ctx.get_parameter_source(name)
        if source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT):
            values[name] = list(value) if isinstance(value, tuple) else value
    if inputs:
        values["inputs"] = list(inputs)
    values.update(fixed)
    return values


def build_spec(ctx: click.Context, job: str | None, inputs: tuple[str, ...], **fixed: Any) -> JobSpec:
    """Defaults < job file < flags given on the command line (< `fixed`: what the command itself sets)."""
    return JobSpec.from_flat(given_values(ctx, job, inputs, **fixed), source=job or "command line")


def _run_command(ctx: click.Context, job: str | None, inputs: tuple[str, ...], **fixed: Any) -> None:
    """`qbatch run` and `qbatch embed`: here, or on the service --server names (checked here first: a bad
    setting fails alike, with the same message)."""
    spec = build_spec(ctx, job, inputs, **fixed)
    server = ctx.params.get("server")
    if server:
        _hand_over(spec, given_values(ctx, job, inputs, **fixed), server, ctx.params.get("api_key"))
    else:
        _run_job(spec)


def _hand_over(spec: JobSpec, values: dict[str, Any], url: str, api_key: str | None) -> None:
    """The job run by the service at `url` (serve/client.py); shown and ended as `_run_job` does."""
    from qbatch.display import print_summary
    from qbatch.jobs.shutdown import ProcessGuard
    from qbatch.serve.client import run_remote, wait_for_release

    setup_log(spec.output.progress)
    with ProcessGuard() as guard:  # a signal: Interrupted here; the service stops the run
        try:
            summary, exit_code = run_remote(url, api_key, values, progress=spec.output.progress)
        except Interrupted as exc:
            if not wait_for_release(spec.output.output_dir):
                log.warning("the service still holds %s; a rerun may have to wait for it", spec.output.output_dir)
            _echo_interrupted(exc, spec.output.output_dir)
            sys.exit(exc.exit_code)
        guard.completed(exit_code)
    print_summary(dataclasses.replace(summary, output_dir=spec.output.output_dir))  # as given, not absolute
    if exit_code:
        sys.exit(exit_code)


@cli.command()
@click.argument("inputs", nargs=-1)
@click.option("--job", type=click.Path(dir_okay=False), help="TOML job file; flags override its keys.")
@setting_options("run")
@server_options
@VERBOSE_OPTION
@click.pass_context
def run(ctx: click.Context, /, job: str | None, inputs: tuple[str, ...], **_: Any) -> None:
    """Generate for every row of INPUT files (JSONL/Parquet, folders, globs; - for stdin) into OUT_DIR.

    \b
    Examples:
      qbatch run sample_data/prompts.jsonl -o out/ --model smollm2-135m --max-tokens 64
      cat sample_data/prompts.jsonl | qbatch run - -o out/stdin --model smollm2-135m
      qbatch run --job jobs/quickstart.toml
      qbatch run data/*.parquet -o out/ --template 'Summarize: {text}' --no-thinking
      qbatch run batch.jsonl -o out/ --output-format jsonl-openai --dry-run
      qbatch run sample_data/prompts.jsonl -o out/labels --model smollm2-135m --choice yes,no --logprobs --top-logprobs 5
      qbatch run sample_data/prompts.jsonl -o out/warm --server http://127.0.0.1:8000   # on a running qbatch serve

    Rerunning the same command resumes; see `qbatch status OUT_DIR`.
    """
    _run_command(ctx, job, inputs)


@dataclasses.dataclass(frozen=True)
class EngineHandoff:
    """What a program that calls the CLI hands it as Click's `obj` (main(pool=...)): the engine pool (an
    EnginePool) its commands run on, left open for the program unless `close` hands it over to the command,
    which then closes it when it ends. Without one, a command opens a pool of its own and closes it."""

    pool: Any
    close: bool = False


def command_pool(*, kept: bool = False) -> tuple[Any, bool]:
    """The pool this command runs on, and whether the command closes it when it ends. `kept`: its
    engines serve many runs (`qbatch serve`), see EnginePool."""
    from qbatch.engines.pool import EnginePool

    handoff = click.get_current_context().find_object(EngineHandoff)
    if handoff is None:
        return EnginePool(kept=kept), True
    return handoff.pool, handoff.close


def _run_job(spec: JobSpec) -> None:
    """`qbatch run` and `qbatch embed`: one job through the Session's path, its summary on stdout."""
    from qbatch.display import print_summary
    from qbatch.jobs.runtime import this_process
    from qbatch.jobs.shutdown import ProcessGuard
    from qbatch.output.summary import exit_code as run_exit_code
    from qbatch.session.session import Session

    setup_log(spec.output.progress)
    pool, owned = command_pool()
    # the process's machinery (engine log, MPS, reaper) for the command, up until the process ends: vLLM's last
    # lines at exit still go to the engine log, and the reaper outlives it on purpose. The reaper kills the
    # engines if this process dies without a word (SIGKILL): the null engine has none
    runtime = this_process().start(reaper=spec.engine.backend != "null" and not spec.output.dry_run)
    with ProcessGuard(reaper=runtime.reaper) as guard:
        session = Session.for_spec(spec, pool=pool)  # the Python door's code path, on the command's pool (and runtime)

        def close() -> None:  # the engines close when the command ends (a pool handed to it may stay open)
            if owned:
                runtime.route_engine_log(session.engine_log)  # vLLM's shutdown lines go with the rest
                pool.close_all()

        try:
            summary = session.run_spec(spec)
        except Interrupted as exc:
            _echo_interrupted(exc, spec.output.output_dir)
            guard.stop(close)
            sys.exit(exc.exit_code)
        except BaseException:
            close()
            raise
        exit_code = run_exit_code(summary, fail_on_row_errors=spec.output.fail_on_row_errors,
                                  max_unusable=spec.output.max_unusable)
        guard.completed(exit_code)  # the run is recorded as completed: a signal now only cuts the shutdown short
        print_summary(summary)
        guard.close_engines(close)
    if exit_code:
        sys.exit(exit_code)


@cli.command()
@click.argument("inputs", nargs=-1)
@click.option("--job", type=click.Path(dir_okay=False), help="TOML job file; flags override its keys.")
@setting_options("embed")
@server_options
@VERBOSE_OPTION
@click.pass_context
def embed(ctx: click.Context, /, job: str | None, inputs: tuple[str, ...], **_: Any) -> None:
    """Embed the text of every row of INPUT files (JSONL/Parquet, folders, globs; - for stdin) into OUT_DIR.

    Rows are text (--prompt-column, --template) or OpenAI batch lines with url /v1/embeddings.
    Results: id, carried columns, embedding (a fixed-size list of floats) and prompt_tokens.

    \b
    Examples:
      qbatch embed sample_data/prompts.jsonl -o out/vectors --model smollm2-135m
      qbatch embed docs.parquet -o out/docs --model Qwen/Qwen3-Embedding-0.6B --template '{title}: {body}'
      qbatch embed queries.jsonl -o out/q --model Qwen/Qwen3-Embedding-0.6B --dimensions 256 \\
          --instruction 'Given a web search query, retrieve relevant passages that answer the query'

    Rerunning the same command resumes; see `qbatch status OUT_DIR`.
    """
    _run_command(ctx, job, inputs, task="embed")


@cli.command()
@click.option("--data-dir", required=True, type=click.Path(file_okay=False),
              help="Folder of the service's state: the SQLite queue, uploaded files, each batch's parts and outputs.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; any other than loopback needs --api-key.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to bind.")
@click.option("--api-key", envvar="QBATCH_API_KEY", help="Key clients send as 'Authorization: Bearer KEY'.  [env QBATCH_API_KEY]")
@click.option("--max-upload-bytes", type=int, default=200 * 1024 * 1024, show_default=True,
              help="Largest batch input file accepted (OpenAI's limit: 200 MB).")
@click.option("--max-requests", type=int, default=50_000, show_default=True,
              help="Most requests in one batch input file (OpenAI's limit: 50,000).")
@click.option("--completion-window-s", type=float, default=24 * 3600.0, show_default=True,
              help="Seconds a '24h' completion window lasts; unfinished requests then expire.")
@setting_options("serve")
@VERBOSE_OPTION
@click.pass_context
def serve(ctx: click.Context, /, data_dir: str, host: str, port: int, api_key: str | None, max_upload_bytes: int,
          max_requests: int, completion_window_s: float, **_: Any) -> None:
    """Serve OpenAI's Batch API (files, batches, models) over HTTP on a warm engine, batches run FIFO.

    \b
    Examples:
      qbatch serve --model smollm2-135m --data-dir serve-data/
      qbatch serve --model Qwen/Qwen3-0.6B --data-dir /var/lib/qbatch --port 8000 --max-tokens 1024
      QBATCH_API_KEY=secret qbatch serve --model Qwen/Qwen3-0.6B --data-dir serve-data/ --host 0.0.0.0

    Clients use the openai package with base_url=http://127.0.0.1:8000/v1. A restarted service
    resumes the batch it was running from its parts and keeps the rest queued.
    """
    from pathlib import Path

    from qbatch.serve.config import ServeSettings
    from qbatch.serve.server import Service

    given = {name: list(value) if isinstance(value, tuple) else value for name, value in ctx.params.items()
             if ctx.get_parameter_source(name) in (click.core.ParameterSource.COMMANDLINE,
                                                   click.core.ParameterSource.ENVIRONMENT)}
    engine = {name: value for name, value in given.items() if name in ENGINE_SETTINGS}
    engine.setdefault("model", DEFAULT_MODEL)
    job = {name: value for name, value in given.items() if name in SERVE_SETTINGS - ENGINE_SETTINGS}
    settings = ServeSettings(Path(data_dir).resolve(), engine, job, host=host, port=port, api_key=api_key,
                             max_upload_bytes=max_upload_bytes, max_requests=max_requests,
                             window_s=completion_window_s)
    JobSpec.from_flat({**engine, **job}, source="command line")  # bad values stop here, before anything starts
    pool, owned = command_pool(kept=True)
    Service(settings, pool=pool, close_pool=owned).serve()  # the service closes its engines as it stops


@cli.command()
@click.argument("output_dir", type=FolderOrUrl(exists=True, file_okay=False), callback=_paths)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--plan", "full_plan", is_flag=True, help="Show the engines' whole plan: every LLM(...) argument and "
              "environment variable vLLM got, each with its reason.")
def status(output_dir: str, as_json: bool, full_plan: bool) -> None:
    """Show what an output folder holds: rows done, failed, remaining, whether a run is live, and its engines.

    \b
    Examples:
      qbatch status out/
      qbatch status out/ --plan
      qbatch status out/ --json | jq .rows_done
      qbatch status s3://bucket/out/
    """
    from qbatch.display import print_status
    from qbatch.output.status import read_status

    if is_url(output_dir):
        from qbatch.output.folder import IDS_ONLY
        from qbatch.storage.lock import live_holder
        from qbatch.storage.stage import viewed

        with viewed(output_dir, thin=IDS_ONLY) as view, view.naming_errors():  # status reads the parts' ids
            holder = live_holder(view.store, view.url)
            info = read_status(str(view.path), live_run=None if holder is None else (str(holder), {}))
        info["output_dir"] = output_dir
    else:
        info = read_status(output_dir)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        print_status(info, full_plan=full_plan)


@cli.command()
@click.argument("output_dir", type=FolderOrUrl(exists=True, file_okay=False), callback=_paths)
@click.option("-o", "--output", "path", type=click.Path(dir_okay=False), callback=_paths,
              help="Where to write the page.  [default: OUTPUT_DIR/report.html]")
def report(output_dir: str, path: str | None) -> None:
    """Write one self-contained HTML page about a run (charts and data inline; opens offline).

    Throughput, GPU (or CPU) use and engine state over time (from telemetry.parquet), the phase
    split, prompt/output length histograms, finish reasons, errors, per-chunk timings, settings
    and versions. Works on a running job too.

    \b
    Examples:
      qbatch report out/
      qbatch report out/ -o /tmp/run.html
      qbatch report s3://bucket/out/
    """
    from qbatch.report.page import REPORT_NAME, write_report

    if not is_url(output_dir):
        click.echo(str(write_report(output_dir, path)))
        return
    from qbatch.storage.stage import viewed
    from qbatch.storage.store import Store
    from qbatch.storage.urls import Url

    with viewed(output_dir) as view, view.naming_errors():  # the page uploaded beside the results
        page = write_report(view.path, None if path is None or is_url(path) else path)
        if path is None or is_url(path):
            target = Url.parse(path) if path else view.url.child(REPORT_NAME)
            Store(target).upload(page, target)
            click.echo(str(target))
            return
    click.echo(str(page))


def _key_values(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> list[dict[str, Any]]:
    """'KEY=VALUE KEY=VALUE' strings -> dicts; values are read as TOML (numbers, true/false), else text."""
    import tomllib

    out = []
    for text in values:
        pairs: dict[str, Any] = {}
        for item in text.split():
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise click.BadParameter(f"expected KEY=VALUE, got '{item}'", ctx=ctx, param=param)
            try:
                pairs[key] = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                pairs[key] = value
        out.append(pairs)
    return out


@cli.command()
@click.argument("workloads", nargs=-1, type=click.Choice(BENCH_WORKLOADS))
@click.option("--modes", default="vllm-text,vllm-tokens,qbatch", show_default=True, callback=_csv,
              help="Comma list of vllm-text, vllm-tokens, qbatch, session (a warm qbatch.Session fed a list of "
                   "rows), hf, vllm-best (an engine of its own on vLLM's defaults + performance_mode=throughput), "
                   "vllm-grouped (vllm-best fed docqa's rows sorted by document), first-run (qbatch, timed from "
                   "starting its engines).")
@click.option("--rows", type=int, help="Rows per workload.  [default: uniform 3072, varied/short 4096; null engine 100000]")
@click.option("--hf-rows", type=int, default=64, show_default=True, help="Rows per workload in the hf mode.")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Runs of each engine mode per workload, in alternating order; reports the mean.")
@click.option("--length-scale", type=float, default=1.0, show_default=True, help="Scale prompt and output lengths.")
@click.option("--workload-seed", type=int, default=0, show_default=True,
              help="Seed of the synthetic workloads' lengths and words (the engine's is `-s seed=N`).")
@click.option("--seed", "legacy_seed", type=int, hidden=True, help="Old name of --workload-seed.")
@click.option("-m", "--model", envvar="QBATCH_MODEL", help="Model, as in `qbatch run`.  [env QBATCH_MODEL]")
@click.option("--load-format", help="vLLM load_format (dummy: random weights, nothing downloaded).")
@click.option("-s", "--set", "settings", multiple=True, callback=_key_values, metavar="KEY=VALUE",
              help="A `qbatch run` setting for every mode (repeatable), e.g. -s max_num_seqs=512.")
@click.option("--variant", multiple=True, callback=_key_values, metavar="'KEY=VALUE ...'",
              help="Also run the qbatch mode with these planning settings (repeatable); adapters=N: with the "
                   "rows spread over N random LoRA adapters of the model.")
@click.option("--vllm-defaults", is_flag=True,
              help="Run the raw vLLM modes on vLLM's own engine defaults (the qbatch mode keeps qbatch's).")
@click.option("--null-engine", is_flag=True, help="Time qbatch's pipeline alone against bare tokenization.")
@click.option("--prompts", type=click.Path(dir_okay=False, exists=True),
              help="With --null-engine: JSONL whose `prompt`/`turns` texts are sampled.")
@click.option("--work-dir", type=click.Path(file_okay=False), help="Keep inputs and outputs here.  [default: temporary]")
@click.option("--inputs-only", is_flag=True, help="Only write the workloads' JSONL files into --work-dir.")
@click.option("--json", "json_path", default="bench.json", show_default=True, type=click.Path(dir_okay=False),
              help="Write the results here as JSON.")
@VERBOSE_OPTION
def bench(workloads: tuple[str, ...], modes: list[str], rows: int | None, hf_rows: int, repeats: int,
          length_scale: float, workload_seed: int, legacy_seed: int | None, model: str | None, load_format: str | None, settings: list[dict[str, Any]], variant: list[dict[str, Any]],
          vllm_defaults: bool, null_engine: bool, prompts: str | None, work_dir: str | None, inputs_only: bool,
          json_path: str) -> None:
    """Time synthetic workloads through raw vLLM, qbatch and Transformers, side by side on one engine.

    \b
    Examples:
      qbatch bench varied --model smollm2-135m --rows 64 --length-scale 0.25
      qbatch bench --model smollm2-135m --null-engine --rows 100000
      qbatch bench uniform varied short --model Qwen/Qwen3-0.6B --modes vllm-text,vllm-tokens,qbatch,hf
      qbatch bench varied --model Qwen/Qwen3-0.6B --modes vllm-text,qbatch --vllm-defaults --repeats 2
      qbatch bench docqa --model Qwen/Qwen3-0.6B --modes vllm-best,vllm-grouped,qbatch,first-run --repeats 3
      qbatch bench embed --model Qwen/Qwen3-0.6B --load-format dummy --repeats 2   # qbatch embed vs LLM.embed
    """
    import shlex

    from qbatch.bench import harness as benchmarks
    from qbatch.bench.settings import BenchSettings
    from qbatch.bench.workloads import DEFAULT_WORKLOADS

    run_settings = {k: v for k, v in (("model", model), ("load_format", load_format)) if v}
    for pairs in settings:
        run_settings.update(pairs)
    spec = BenchSettings(list(workloads or DEFAULT_WORKLOADS), modes or [], run_settings, rows=rows,
                                    hf_rows=hf_rows, repeats=repeats, length_scale=length_scale,
                                    seed=workload_seed if legacy_seed is None else legacy_seed,
                                    vllm_defaults=vllm_defaults, variants=variant, work_dir=work_dir)
    if inputs_only:
        if not work_dir:
            raise click.UsageError("--inputs-only needs --work-dir")
        for path in benchmarks.write_workloads(spec):
            click.echo(path)
        return
    from pathlib import Path

    from qbatch.jobs.runtime import this_process
    from qbatch.jobs.shutdown import ProcessGuard

    command = "qbatch " + shlex.join(sys.argv[1:])
    runtime = this_process().start(engine_log=Path(json_path).with_suffix(".engine.log"), reaper=not null_engine)

    def write(report: dict[str, Any]) -> None:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump({**report, "command": command}, handle, indent=2, default=str)

    def write_interrupted(report: dict[str, Any]) -> None:  # a time limit keeps the runs that finished
        write(report)
        click.echo(f"interrupted: the {len(report['runs'])} runs that finished are in {json_path}", err=True)

    engines, owned = command_pool()  # a pool handed to the command keeps its engines between modes
    pool = benchmarks.BenchPool(engines, own=owned)
    with ProcessGuard(reaper=runtime.reaper):  # a signal kills the engines; so does this process's death (the reaper)
        try:
            if null_engine:
                from qbatch.bench.pipeline import pipeline_bench

                report = pipeline_bench(spec, pool.engines, prompts_file=prompts)
            else:
                report = benchmarks.run_bench(spec, pool, interrupted=write_interrupted)
        finally:
            if pool.own:
                pool.engines.close_all()
    write(report)
    click.echo(benchmarks.format_table({**report, "command": command}))
    click.echo(f"results: {json_path}")


@cli.command()
@click.argument("model")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--w-bit", type=int, default=4, show_default=True, help="Bits per weight (AWQ is 4-bit).")
@click.option("--group-size", type=int, default=128, show_default=True,
              help="Weights sharing one scale; must divide the layer sizes (128, 64 or 32).")
@click.option("--zero-point/--no-zero-point", default=True, show_default=True, help="Asymmetric quantization (a zero point per group).")
@click.option("--awq-version", type=click.Choice(["gemm", "gemv"]), default="gemm", show_default=True,
              help="Weight packing: gemm (what vLLM loads) or gemv (AutoAWQ's own batch-1 kernel).")
@click.option("--version", "legacy_version", type=click.Choice(["gemm", "gemv"]), hidden=True,
              help="Old name of --awq-version.")
@click.option("--calib", type=click.Path(exists=True),
              help="Calibration prompts: JSONL/Parquet in any `qbatch run` shape, rendered with the chat template.  [default: sample_data/calib.jsonl]")
@click.option("--calib-samples", type=int, default=128, show_default=True, help="Calibration texts used: the first N that fit --calib-seq-len.")
@click.option("--calib-seq-len", type=int, default=512, show_default=True, help="Tokens per calibration block; longer texts are skipped.")
def quantize(model: str, out_dir: str, w_bit: int, group_size: int, zero_point: bool, awq_version: str,
             legacy_version: str | None,
             calib: str | None, calib_samples: int, calib_seq_len: int) -> None:
    """Quantize MODEL to 4-bit AWQ with AutoAWQ into OUT_DIR, a folder `qbatch run --model` loads.

    \b
    Examples:
      qbatch quantize smollm2-135m out/smollm2-awq --group-size 64
      qbatch quantize Qwen/Qwen3-0.6B out/qwen3-awq --calib sample_data/mt_bench.jsonl --calib-samples 64
      qbatch run sample_data/prompts.jsonl -o out/awq-run --model out/qwen3-awq

    `qbatch run --quantize awq` does the same once, into qbatch's cache.
    """
    from qbatch.models.quantize import AwqSettings, quantize as quantize_model, summary_lines

    settings = AwqSettings(w_bit, group_size, zero_point, legacy_version or awq_version, calib, calib_samples, calib_seq_len)
    meta = quantize_model(model, out_dir, settings)
    for line in summary_lines(meta, out_dir):
        click.echo(line)


@cli.command()
@click.argument("shard_dirs", nargs=-1, required=True, type=FolderOrUrl(exists=True, file_okay=False), callback=_paths)
@click.option("-o", "--output-dir", required=True, type=click.Path(file_okay=False), callback=_paths,
              help="Folder for the merged results.")
@flag_of(*next((f, hint) for f, hint in _flagged() if f.name == "output_format"))
def merge(shard_dirs: tuple[str, ...], output_dir: str, output_format: str) -> None:
    """Combine the outputs of `qbatch run --shard I/N` runs into one results.parquet.

    Refuses folders that ran different jobs, missing or repeated shards, and shards that did not
    cover the same inputs completely (unfinished, run with --limit, or run before rows were appended).

    \b
    Examples:
      qbatch merge out/shard-0 out/shard-1 -o out/all
      qbatch merge out/shard-* -o out/all --output-format jsonl-openai
      qbatch merge s3://bucket/out/shard-0 s3://bucket/out/shard-1 -o s3://bucket/out/all
    """
    from qbatch.output.merge import merge as merge_shards
    from qbatch.storage.stage import staged, viewed

    with contextlib.ExitStack() as folders:  # folders of an object store: local copies, the output's uploaded
        local = [str(folders.enter_context(viewed(d)).path) if is_url(d) else d for d in shard_dirs]
        target = str(folders.enter_context(staged(output_dir)).path) if is_url(output_dir) else output_dir
        counts = merge_shards(local, target, openai_jsonl=output_format == "jsonl-openai",
                              shard_names=[d if is_url(d) else None for d in shard_dirs])
    click.echo(f"merged {len(shard_dirs)} shards into {output_dir}: {counts['rows_ok']:,} results, "
               f"{counts['rows_failed']:,} errors")


def main(pool: Any = None, *, close_pool: bool = False) -> None:
    """The `qbatch` command. `pool` (an EnginePool): the engines its commands run on, left open for the
    caller unless `close_pool` (by default a command opens a pool of its own and closes it when it ends)."""
    try:
        cli(prog_name="qbatch", obj=None if pool is None else EngineHandoff(pool, close_pool))
    except SystemExit as exc:
        _exit(exc.code)


def _exit(code: int | str | None) -> None:
    """End the command. Once vLLM was loaded, without the interpreter's teardown: its final garbage
    collection of vLLM's millions of objects took seconds, with nothing left to do (the command has
    closed its engines and files); exit hooks still run."""
    if "vllm" not in sys.modules:
        sys.exit(code)
    if isinstance(code, str):  # sys.exit("message") prints it and exits 1
        print(code, file=sys.stderr)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


if __name__ == "__main__":
    main()
