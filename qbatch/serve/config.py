"""The service's settings, fixed when it starts (`qbatch serve` flags)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qbatch.errors import SpecError

# OpenAI's own limits for a batch input file: 200 MB and 50,000 requests.
MAX_UPLOAD_BYTES = 200 * 1024 * 1024
MAX_REQUESTS = 50_000
COMPLETION_WINDOW = "24h"
COMPLETION_WINDOW_S = 24 * 3600.0
SERVE_EXTRA_HINT = "pip install 'qbatch[serve]'"


@dataclass(frozen=True)
class ServeSettings:
    """Where the service keeps its state, how it is reached, its limits, and the Session it runs on.

    `engine` holds the Session's engine settings (model, vLLM settings, backend); `job` the `qbatch
    run` settings every batch runs with (a batch line's own sampling values win). `window_s` is how
    long the `24h` completion window lasts (a setting so that tests can use seconds).
    """

    data_dir: Path
    engine: dict[str, Any]
    job: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    max_requests: int = MAX_REQUESTS
    window_s: float = COMPLETION_WINDOW_S

    def __post_init__(self) -> None:
        # Online requests are rows someone waits on: vLLM's priority policy lets them go before the batch rows
        # queued in the engine (engines/vllm.py gives them the higher priority), unless the service was told otherwise.
        if self.engine.get("backend") != "null":
            object.__setattr__(self, "engine", {"scheduling_policy": "priority", **self.engine})
        if not is_loopback(self.host) and not self.api_key:
            raise SpecError(f"binding {self.host} exposes the service to the network, and no API key is set",
                            where="--host",
                            hint="pass --api-key KEY (or set QBATCH_API_KEY), or keep --host 127.0.0.1")
        for name in ("max_upload_bytes", "max_requests", "window_s"):
            if getattr(self, name) <= 0:
                raise SpecError(f"{name} must be > 0, got {getattr(self, name)}", where=f"--{name.replace('_', '-')}")

    @property
    def model(self) -> str:
        """The model as clients see it (/v1/models, a batch's and a response's `model`): a local folder by its
        name, never by its path on the server; a hub id or a registry name as given."""
        model = str(self.engine["model"])
        return Path(model).name if Path(model).expanduser().is_dir() else model


def is_loopback(host: str) -> bool:
    """Whether `host` (a name to bind or reach, or a client's address) is this machine only: 127.0.0.0/8,
    ::1, localhost, and ::ffff:127.0.0.1 (an IPv4 client on a dual-stack socket)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback
