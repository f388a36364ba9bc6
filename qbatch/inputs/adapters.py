"""Which LoRA adapter a row asks for: its `adapter` column (or `lora`), or an OpenAI batch line's `body.model`.

As vLLM's server does with --lora-modules, a batch line's body.model names an adapter, or the base model
(absent means the base model too). A row naming an adapter the job does not have fails alone, as an
`unknown_adapter` error row: never the run. Without adapters (no --lora) none of this applies: the columns
are carried like any other and body.model changes nothing, as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qbatch.errors import RowError

ADAPTER_COLUMNS = ("adapter", "lora")
ADAPTER_COLUMN_SET = frozenset(ADAPTER_COLUMNS)


class AdapterChoice:
    """Reads a row's adapter against the job's adapters (their names) and the base model's name."""

    def __init__(self, adapters: dict[str, str], model: str):
        self.names = frozenset(adapters)
        self.base_names = frozenset({model, Path(model).name})  # "Qwen/Qwen3-0.6B" or "Qwen3-0.6B"

    def of(self, data: dict[str, Any], openai: bool) -> str | None:
        """The adapter a row names (None: the base model), or RowError("unknown_adapter")."""
        if openai:
            body = data.get("body")
            name, where = (body.get("model") if isinstance(body, dict) else None), "body.model"
        else:
            where = next((column for column in ADAPTER_COLUMNS if data.get(column) is not None), ADAPTER_COLUMNS[0])
            name = data.get(where)
        if name is None or name == "" or (isinstance(name, str) and name in self.base_names):
            return None
        if not isinstance(name, str) or name not in self.names:
            raise RowError("unknown_adapter", f"{where} names {name!r}, which is neither the base model nor one of the "
                                            f"job's adapters: {', '.join(sorted(self.names))}")
        return name
