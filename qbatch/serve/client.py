"""`qbatch run --server URL` (and `qbatch embed --server`): the job handed to a `qbatch serve` on this machine,
which runs it on its warm engines; its log lines, bar and summary shown here as a local run shows them.

Standard library only (http.client): an install without the `serve` extra is a client. The request
carries the settings the user gave (job file and flags) with every path made absolute against this
folder; the service reads and writes the files itself, so nothing but settings is sent. Standard input
and pipes cannot be handed over (the service reads files by path): they are refused here.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from qbatch._fs import is_url, normal_path
from qbatch.errors import EXIT_USAGE, RemoteError, ServiceError, SpecError
from qbatch.inputs.spool import is_stream
from qbatch.output.summary import Summary
from qbatch.log import log
from qbatch.output.folder import OutputDir
from qbatch.serve.config import is_loopback
from qbatch.serve.wire import FOLDER_SETTINGS, RUN_ROUTE, ErrorInfo, RunEnd, RunRequest, canonical
from qbatch.spec import SETTING_FILE_SUFFIXES
from qbatch.versions import __version__

CONNECT_TIMEOUT_S = 3.0  # a service on this machine answers at once; a dead port fails at once
READ_TIMEOUT_S = 60.0  # the service writes a line every second (HEARTBEAT_S), even while it waits
UNREACHABLE_HINT = "start it (`qbatch serve --model ... --data-dir ...`), check the port, or drop --server to run here"
KEY_HINT = "pass --api-key KEY or set QBATCH_API_KEY (the key `qbatch serve` was started with)"
# An interrupted client waits this long at most for the service to let go of the output folder (it finds the
# client gone within about two seconds): the folder is then free for the next command, as a local run's is.
RELEASE_WAIT_S = 10.0


def run_remote(url: str, api_key: str | None, values: dict[str, Any], *, progress: str) -> tuple[Summary, int]:
    """Hand the job (`values`: the settings given, as build_spec reads them) to the service at `url`; its
    summary and exit code. RemoteError: the job's own error, as a local run has it; ServiceError: no service."""
    host, port = service_address(url)
    request = RunRequest(absolute_paths(values, Path.cwd()), __version__, bar=draws_bar(progress))
    connection = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)
    try:
        try:
            connection.connect()
            connection.sock.settimeout(READ_TIMEOUT_S)
            headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
            connection.request("POST", RUN_ROUTE, body=request.to_json(), headers=headers)
            response = connection.getresponse()
        except OSError as exc:
            raise ServiceError(f"cannot reach the qbatch service at {url} ({_reason(exc)})", where="--server",
                               hint=UNREACHABLE_HINT) from None
        if response.status != 200:
            raise _refusal(response, url)
        return _follow(response, url)
    finally:
        connection.close()  # a client interrupted: the service sees it gone and stops the run


def wait_for_release(output_dir: str | None, timeout_s: float = RELEASE_WAIT_S) -> bool:
    """Whether the service's run let go of `output_dir` (its run lock) within `timeout_s`."""
    if not output_dir:  # a dry run holds no folder
        return True
    folder, deadline = OutputDir(output_dir), time.monotonic() + timeout_s
    while folder.lock_holder() is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def service_address(url: str) -> tuple[str, int]:
    """(host, port) of a `http://127.0.0.1:8000` URL (a trailing /v1, as the openai client's base_url has, may
    stay); a service on another machine is refused: the job names files by their paths on this one."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise SpecError(f"--server must be an http:// URL, got '{url}'", hint="e.g. --server http://127.0.0.1:8000")
    if not is_loopback(parts.hostname):
        raise SpecError(f"--server must be a service on this machine (127.0.0.1, ::1, localhost), got '{url}'",
                        where="--server", hint="the job names files by their paths here: run it on the service's host")
    try:
        return parts.hostname, parts.port or 80
    except ValueError:
        raise SpecError(f"--server has a bad port: '{url}'", hint="e.g. --server http://127.0.0.1:8000") from None


def draws_bar(progress: str) -> bool:
    """Whether this terminal shows a bar, as a local run decides (jobs/progress.py)."""
    return progress == "bar" or (progress == "auto" and sys.stderr.isatty())


def absolute_paths(values: dict[str, Any], cwd: Path) -> dict[str, Any]:
    """The settings with their paths absolute against `cwd` (the service runs elsewhere); standard input and
    pipes refused. Globs stay globs (made absolute too), for the service to expand as a local run would."""
    out = canonical(values)
    if isinstance(out.get("inputs"), str):  # a job file's `inputs = "data.jsonl"`: one path, as JobSpec reads it
        out["inputs"] = [out["inputs"]]

    def here(path: str) -> str:
        if os.path.isabs(path) or is_url(path):  # an object store's URL (s3://...) names the same thing everywhere
            return path
        return normal_path(cwd / path)  # `link/..`: as the OS reads it

    for item in out.get("inputs") or []:
        if is_stream(item):
            raise SpecError(f"'{item}' is a stream (standard input or a pipe); a service reads its inputs from files",
                            where="--server", hint="write the rows to a file and pass its path, or drop --server")
    if out.get("inputs"):
        out["inputs"] = [here(item) for item in out["inputs"]]
    if out.get("output_dir"):
        out["output_dir"] = here(out["output_dir"])
    for name in ("json_schema", "grammar"):  # a file, or the text itself: a file here is sent by its path
        value = out.get(name)
        if isinstance(value, str) and "\n" not in value and (
                (cwd / value).is_file() or Path(value).suffix.lower() in SETTING_FILE_SUFFIXES):
            out[name] = here(value)
    for name in FOLDER_SETTINGS:
        value = out.get(name)
        if isinstance(value, str) and (cwd / value).is_dir():
            out[name] = here(value)
    if isinstance(out.get("lora"), dict):
        out["lora"] = {name: here(folder) for name, folder in out["lora"].items()}
    return out


def _reason(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"unknown host: {exc.strerror}"
    if isinstance(exc, TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT_S:.0f}s"
    return exc.strerror or type(exc).__name__


def _refusal(response: http.client.HTTPResponse, url: str) -> Exception:
    """The error a non-200 answer means: the service's own words when it is a qbatch service."""
    text = response.read(65536).decode("utf-8", "replace")
    try:
        error = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    if response.status == 401:
        return RemoteError(f"wrong or missing API key for the qbatch service at {url}", exit_code=EXIT_USAGE,
                           where="--api-key", hint=KEY_HINT)
    if response.status in (404, 405):
        return ServiceError(f"{url} is not a qbatch service that takes jobs (HTTP {response.status} on "
                            f"{RUN_ROUTE})", where="--server",
                            hint="check the port; a qbatch serve older than this client needs an update")
    if "exit_code" not in error:
        message = error.get("message") or text.strip()[:200] or response.reason
        return ServiceError(f"the service at {url} answered HTTP {response.status}: {message}", where="--server",
                            hint=UNREACHABLE_HINT)
    info = ErrorInfo.load(error, EXIT_USAGE)
    return RemoteError(info.message, exit_code=info.exit_code, where=info.where, hint=info.hint)


def _follow(response: http.client.HTTPResponse, url: str) -> tuple[Summary, int]:
    """Show the run's lines as they come; its summary and exit code at the end."""
    bar = _Bar()
    try:
        while raw := _next_line(response, url):
            item = json.loads(raw)
            if "log" in item:
                log.log(item["log"]["level"], item["log"]["message"])
            elif "progress" in item:
                bar.show(item["progress"])
            elif "summary" in item:
                bar.close()
                end = RunEnd.load(item)
                return end.summary, end.exit_code
            elif "error" in item:
                bar.close()
                info = ErrorInfo.load(item["error"], 1)
                raise RemoteError(info.message, exit_code=info.exit_code, where=info.where, hint=info.hint)
    finally:
        bar.close()
    raise ServiceError(f"the qbatch service at {url} stopped answering before the run ended", where="--server",
                       hint="its log says why; finished parts are kept: rerun the same command to resume")


def _next_line(response: http.client.HTTPResponse, url: str) -> bytes:
    try:
        return response.readline()
    except (OSError, http.client.HTTPException) as exc:
        raise ServiceError(f"the connection to the qbatch service at {url} broke ({type(exc).__name__})",
                           where="--server", hint="finished parts are kept: rerun the same command to resume"
                           ) from None


class _Bar:
    """The run's bar, drawn here as the run would draw it (tqdm on stderr), from the service's counts."""

    def __init__(self) -> None:
        self._tqdm: Any = None

    def show(self, state: dict[str, Any]) -> None:
        if self._tqdm is None:
            from tqdm import tqdm

            self._tqdm = tqdm(total=state["total"], unit="row", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
        self._tqdm.set_postfix_str(state["postfix"], refresh=False)
        self._tqdm.update(state["done"] - self._tqdm.n)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

