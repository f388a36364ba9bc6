"""Which LoRA adapter a row asks for: its `adapter` column (or `lora`), or an OpenAI batch line's `body.model`.

As vLLM's server does with --lora-modules, a batch line's body.model names an adapter, or the base model
(absent means the base model too). A row naming an adapter the job does not have fails alone, as an
`unknown_adapter` error row, and one naming an adapter whose weights cannot be used (models/adapters.py), or
naming two different ones (an `adapter` and a `lora` column, or body.model and either), as a `bad_adapter`
error row: never the run. Without adapters (no --lora) none of this applies: the columns are carried like
any other and body.model changes nothing, as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qbatch.errors import RowError

ADAPTER_COLUMNS = ("adapter", "lora")
ADAPTER_COLUMN_SET = frozenset(ADAPTER_COLUMNS)


class AdapterChoice:
    """Reads a row's adapter against the job's adapters (their names), the unusable ones (name -> what is
    wrong) and the base model's name."""

    def __init__(self, adapters: dict[str, str], model: str, unusable: dict[str, str] | None = None):
        self.unusable = unusable or {}
        self.names = frozenset(adapters) | frozenset(self.unusable)
        self.base_names = frozenset({model, Path(model).name})  # "Qwen/Qwen3-0.6B" or "Qwen3-0.6B"

    def of(self, data: dict[str, Any], openai: bool) -> str | None:
        """The adapter a row names (None: the base model), or RowError("unknown_adapter" or "bad_adapter")."""
        named = self._named(data, openai)
        choices = {self._choice(name) for _, name in named}
        if len(choices) > 1:
            said = ", ".join(f"{where} names {name!r}" for where, name in named)
            raise RowError("bad_adapter", f"the row names two models: {said}; name one adapter (or none: the base "
                                          f"model) in {named[0][0]}")
        if not named or choices == {None}:
            return None
        where, name = named[0]
        if not isinstance(name, str) or name not in self.names:
            raise RowError("unknown_adapter", f"{where} names {name!r}, which is neither the base model nor one of the "
                                              f"job's adapters: {', '.join(sorted(self.names))}")
        if name in self.unusable:
            raise RowError("bad_adapter", self.unusable[name])
        return name

    def _named(self, data: dict[str, Any], openai: bool) -> list[tuple[str, Any]]:
        """(where, name) of each place the row names a model in: body.model first on an OpenAI line."""
        places = [(column, data.get(column)) for column in ADAPTER_COLUMNS]
        if openai:
            body = data.get("body")
            places.insert(0, ("body.model", body.get("model") if isinstance(body, dict) else None))
        return [(where, name) for where, name in places if name is not None and name != ""]

    def _choice(self, name: Any) -> Any:
        """The model a name picks: None for the base model; any other value as it is (a list is its repr)."""
        if isinstance(name, str):
            return None if name in self.base_names else name
        return repr(name)
