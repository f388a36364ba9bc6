"""The job spec: one typed object that every stage reads.

Settings come from three places, merged here and nowhere else: command-line
flags override the TOML job file, which overrides the defaults below. Job
files use the flags' names (`max_tokens` or `max-tokens`) as flat keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qbatch._fs import is_url, normal_path
from qbatch.errors import RowError, SpecError
from qbatch.sampling import SAMPLING_KEY_SET, check_params, check_structured

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
SHAPES = ("auto", "prompt", "chat", "openai")
FORMATS = ("jsonl", "parquet")
COMPRESSED_SUFFIXES = (".gz", ".zst")  # read compressed, whatever the format
OUTPUT_FORMATS = ("parquet", "jsonl-openai")
PROGRESS = ("auto", "bar", "log", "none")
ON_BAD_LINE = ("error", "skip")
ORDERS = ("longest-first", "longest-first-flat", "input")
BACKENDS = ("vllm", "ray", "null")
TASKS = ("generate", "embed")  # embed: vLLM's pooling runner (runner="pooling"), `qbatch embed`
EMBEDDING_DTYPES = ("float32", "float16")
# vLLM's StructuredOutputsConfig.backend values (the same in vLLM 0.26 and 0.32)
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
# Conveniences the type check allows besides each field's annotation (the README's "Job files" says so):
ONE_ITEM_LISTS = frozenset({"inputs", "stop"})  # one string is a one-item list
NUMBER_ITEMS = frozenset({"gpus"})  # GPU ids may be written as integers


def affects_results(default: Any = None, *, factory: Any = None) -> Any:
    """A setting that changes what a row's result is: it enters the output folder's fingerprint, so a
    rerun that changes it refuses to mix its results with the old ones (`JobSpec.result_settings`).
    Planning, engine sizing and max_model_len may change between runs (raising max_model_len and
    rerunning with --retry-errors is how rows that were too long get processed)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"affects_results": True})
    return field(default=default, metadata={"affects_results": True})


@dataclass(frozen=True)
class InputSpec:
    """Where rows come from and how a row becomes a prompt."""

    inputs: list[str] = field(default_factory=list)
    format: str | None = None  # None: by file extension
    shape: str = affects_results("auto")
    prompt_column: str = affects_results("prompt")
    messages_column: str = affects_results("messages")
    id_column: str | None = affects_results(None)  # None: `id`, or `custom_id` for OpenAI batch lines
    template: str | None = affects_results(None)
    system_prompt: str | None = affects_results(None)
    raw: bool = affects_results(False)
    thinking: bool | None = affects_results(None)  # None: the chat template's own default
    # The input columns carried to the results (the prompt's and messages' too): keep_columns None is all
    keep_columns: list[str] | None = affects_results(None)
    drop_columns: list[str] | None = affects_results(None)  # all but these
    on_bad_line: str = "error"
    dedupe: bool = affects_results(False)
    limit: int | None = None
    shard: str | None = affects_results(None)  # "I/N"


@dataclass(frozen=True)
class SamplingSpec:
    """Job-level sampling; None means the model's generation_config, then vLLM's default."""

    max_tokens: int = affects_results(2048)
    temperature: float | None = affects_results(None)
    top_p: float | None = affects_results(None)
    top_k: int | None = affects_results(None)
    min_p: float | None = affects_results(None)
    presence_penalty: float | None = affects_results(None)
    frequency_penalty: float | None = affects_results(None)
    repetition_penalty: float | None = affects_results(None)
    stop: list[str] | None = affects_results(None)
    ignore_eos: bool = affects_results(False)
    # Structured output (at most one; a row's own constraint replaces it): json_schema and grammar are
    # a file or the text itself (the fingerprint holds the content: Job.fingerprint).
    json_schema: str | None = affects_results(None)
    choice: list[str] | None = affects_results(None)
    regex: str | None = affects_results(None)
    grammar: str | None = affects_results(None)
    n: int = affects_results(1)  # samples a row: one result row each (sample_index)
    logprobs: bool = affects_results(False)  # each output token's logprob (OpenAI's names)
    top_logprobs: int | None = affects_results(None)  # and its N most likely alternatives (implies logprobs)
    # vLLM's: reasoning tokens before the engine forces the reasoning's end (needs a reasoning parser)
    thinking_token_budget: int | None = affects_results(None)

    def structured_outputs(self) -> dict[str, Any] | None:
        """The job's constraint as vLLM's StructuredOutputsParams kwargs (files read), checked; None: none."""
        given = [name for name in ("json_schema", "choice", "regex", "grammar") if getattr(self, name) is not None]
        if not given:
            return None
        if len(given) > 1:
            raise SpecError(f"--{given[0].replace('_', '-')} and --{given[1].replace('_', '-')} are two "
                            "constraints; a job takes one", hint="keep one of them")
        name = given[0]
        value: Any = getattr(self, name)
        if name in ("json_schema", "grammar"):
            value = _file_or_text(value, name)
        try:
            return check_structured({"json" if name == "json_schema" else name: value})
        except RowError as exc:
            raise SpecError(exc.message, where=f"--{name.replace('_', '-')}",
                            hint=f"fix the {name.replace('_', ' ')} (rows may carry their own constraint)") from None


# ~2,000 rows a part at the default max_tokens (2048): each part costs a table, a Parquet file and
# two fsyncs, so fewer, larger parts cost less; a crash redoes at most the chunks in flight.
DEFAULT_CHUNK_TOKENS = 4_194_304


@dataclass(frozen=True)
class PlanSpec:
    """How rows are grouped: sorted inside a window, cut into token-budgeted chunks."""

    sort_window: int = 8192
    # or "longest-first-flat" (no prefix groups), or "input": rows reach the engine (and the parts) in input order
    order: str = "longest-first"
    # None: DEFAULT_CHUNK_TOKENS, split among the engines (qbatch/plan/resolve.py). One engine is fed
    # across chunk boundaries, so the size changes what a crash redoes (the chunks in flight) and the
    # number of parts, not the feed.
    chunk_tokens: int | None = None


@dataclass(frozen=True)
class EngineSpec:
    """vLLM engine settings; names mirror vLLM's. None leaves vLLM's own default."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = affects_results(None)
    revision: str | None = affects_results(None)
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None  # default on CPU: 2 GiB (plan/engine_args.py)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    dtype: str = affects_results("auto")
    quantization: str | None = affects_results(None)
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None  # None: True on CPU (compiling takes minutes there), else False
    # vLLM's compilation_config mode: 0 no torch.compile, 3 torch.compile. None: chosen from the job's
    # shape (plan/shape.py), else 0 on Hopper GPUs (plan/engine_args.py) and vLLM's own default elsewhere.
    compilation_mode: int | None = None
    # None: no seed (vLLM's engine seed 0, samples not reproducible). Set: each row gets a seed of its
    # own derived from it and the row id (qbatch.sampling.row_seed), so reruns repeat and rows differ.
    seed: int | None = affects_results(None)
    load_format: str | None = affects_results(None)
    performance_mode: str | None = "throughput"
    quantize: str | None = affects_results(None)  # "awq": quantize with AutoAWQ first, cached
    data_parallel_size: int = 1  # independent engines, one process per GPU (engines/processes.py)
    engines_per_gpu: int | None = None  # engines sharing each GPU; None: chosen by plan/placement.py
    # CUDA MPS for the engines sharing a GPU (engines/mps.py). None: on where they share one and the
    # driver's MPS control program is installed (plan/placement.py)
    mps: bool | None = None
    gpus: list[str] | None = None  # GPU ids for the engines; default 0..data_parallel_size-1
    # vLLM's reasoning parser: a constraint then applies after the reasoning. None: "qwen3" for Qwen3
    # models when the job has a constraint (plan/resolve.py), else none (rows with their own need the flag).
    reasoning_parser: str | None = affects_results(None)
    # "embed": vectors instead of text (vLLM's runner="pooling"; a decoder gets convert="embed"): `qbatch embed`
    task: str = affects_results("generate")
    # vLLM's StructuredOutputsConfig.backend and .disable_any_whitespace (None: qbatch's choice, plan/engine_args.py)
    structured_outputs_backend: str | None = affects_results(None)
    disable_any_whitespace: bool | None = affects_results(None)
    backend: str = affects_results("vllm")  # "ray": engines in Ray actors (engines/ray_actors.py); "null": returns instantly (tests)
    ray_address: str | None = None  # with backend "ray": the cluster to join; None: $RAY_ADDRESS, else a local one
    # LoRA adapters by name (--lora NAME=PATH, a job file's [lora] table): a row picks one by name (its
    # `adapter` column, or an OpenAI line's body.model); rows naming none use the base model. Their content
    # enters the fingerprint (Job.fingerprint). vLLM's LoRA settings: None is chosen from the adapters
    # (models/adapters.py), before the engine starts.
    lora: dict[str, str] | None = affects_results(None)
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    # False: vLLM computes its scheduler stats every step (running/waiting requests, KV-cache usage: telemetry
    # records them); vLLM's LLM() default is True, as it costs per-step work in its engine loop
    disable_log_stats: bool = True

    def engine_count(self) -> int:
        """Engine processes in all (engines_per_gpu None counts as one: not chosen yet)."""
        return self.data_parallel_size * (self.engines_per_gpu or 1)

    def one_engine(self, **changes: Any) -> EngineSpec:
        """The settings of one engine of these: what a data-parallel worker or a Ray actor runs here."""
        return dataclasses.replace(self, data_parallel_size=1, gpus=None, engines_per_gpu=1, **changes)


@dataclass(frozen=True)
class OutputSpec:
    """Where results go and how the run reports."""

    output_dir: str | None = None
    output_format: str = "parquet"
    include_prompt: bool = affects_results(False)
    progress: str = "auto"
    fail_on_row_errors: bool = False
    # exit EXIT_UNUSABLE when more than this share of result rows have no usable answer (output/flags.py)
    max_unusable: float | None = None
    price_per_gpu_hour: float | None = None  # a run's cost in its summary, a dry run's estimated cost
    fail_on_empty: bool = False  # inputs with no rows at all stop the run (exit 3) instead of a warning
    restart: bool = False
    retry_errors: bool = False
    dry_run: bool = False
    telemetry: bool = True  # GPU/CPU and engine counters once a second into OUT_DIR/telemetry.parquet
    report: bool = False  # write OUT_DIR/report.html when the run ends


@dataclass(frozen=True)
class EmbedSpec:
    """What an embedding job (task "embed") does to each vector; unused by generation."""

    dimensions: int | None = affects_results(None)  # keep the first N (Matryoshka), then re-normalize
    normalize: bool = affects_results(True)  # unit L2 norm (after the truncation)
    instruction: str | None = affects_results(None)  # query side: "Instruct: {instruction}\nQuery:{text}" (Qwen3-Embedding)
    truncate: bool = affects_results(False)  # over-long inputs keep their first max_model_len tokens, else error rows
    embedding_dtype: str = affects_results("float32")  # float16 halves the output


# vLLM's LoRA settings (vllm/config/lora.py): the ranks its LoRAConfig takes, and qbatch's names for them
LORA_SETTINGS = ("lora", "max_loras", "max_lora_rank", "max_cpu_loras")
# Settings of the engine section that are a job's own on engines started for others (a Session's, a
# service's): a seed seeds each row (vLLM's engine seed stays), and a job's adapters are those it names
# (none: an `adapter` column is plain data). A job whose adapters differ gets an engine of its own.
JOB_OWN_ENGINE_SETTINGS = frozenset({"seed", *LORA_SETTINGS})
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


# Settings of one task only: an embedding job takes none of generation's (chat turns, sampling,
# constraints, thinking), a generation job none of embedding's. `qbatch embed` has no flags for the
# first; fingerprints and reports leave out whichever does not apply.
GENERATION_ONLY = frozenset({"messages_column", "system_prompt", "raw", "thinking", "reasoning_parser", "quantize",
                             "structured_outputs_backend", "disable_any_whitespace", *LORA_SETTINGS,
                             *(f.name for f in dataclasses.fields(SamplingSpec))})
EMBEDDING_ONLY = frozenset(f.name for f in dataclasses.fields(EmbedSpec))


def applies_to(name: str, task: str) -> bool:
    """Whether the setting `name` means anything to a job of this task (generate or embed)."""
    return name not in (GENERATION_ONLY if task == "embed" else EMBEDDING_ONLY)


SECTIONS = {"input": InputSpec, "sampling": SamplingSpec, "plan": PlanSpec, "engine": EngineSpec, "output": OutputSpec,
            "embed": EmbedSpec}


@dataclass(frozen=True)
class JobSpec:
    input: InputSpec = field(default_factory=InputSpec)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    plan: PlanSpec = field(default_factory=PlanSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    embed: EmbedSpec = field(default_factory=EmbedSpec)

    @classmethod
    def from_flat(cls, values: dict[str, Any], *, source: str = "settings") -> JobSpec:
        """Build a spec from flat `key: value` pairs (flag names), checking every key."""
        owners = _key_owners()
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for raw_key, value in values.items():
            key = raw_key.replace("-", "_")
            if key not in owners:
                raise SpecError(
                    f"unknown setting '{raw_key}'{_did_you_mean(key, owners)}",
                    where=source,
                    hint="run `qbatch run --help` for the valid names",
                )
            sections[owners[key]][key] = _typed(raw_key, key, value, source)
        _normalize_gpus(sections["engine"])
        _normalize_paths(sections["input"], sections["output"])
        spec = cls(**{name: SECTIONS[name](**kw) for name, kw in sections.items()})
        spec.validate()
        return spec

    def flat(self) -> dict[str, Any]:
        """The spec as flat key/value pairs (for manifests and --dry-run output)."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out

    def validate(self) -> None:
        _check_choice("shape", self.input.shape, SHAPES)
        if self.input.format is not None:
            _check_choice("format", self.input.format, FORMATS)
        _check_choice("output_format", self.output.output_format, OUTPUT_FORMATS)
        _check_choice("progress", self.output.progress, PROGRESS)
        _check_choice("on_bad_line", self.input.on_bad_line, ON_BAD_LINE)
        _check_min("max_tokens", self.sampling.max_tokens, 1)
        self._check_sampling()
        self.sampling.structured_outputs()
        _check_min("sort_window", self.plan.sort_window, 1)
        _check_choice("order", self.plan.order, ORDERS)
        _check_min("tensor_parallel_size", self.engine.tensor_parallel_size, 1)
        _check_min("data_parallel_size", self.engine.data_parallel_size, 1)
        if self.engine.gpus is not None:
            twice = sorted({g for g in self.engine.gpus if self.engine.gpus.count(g) > 1})
            if twice:
                raise SpecError(f"--gpus lists GPU {twice[0]} more than once",
                                hint=f"for several engines on one GPU pass --engines-per-gpu {self.engine.gpus.count(twice[0])}")
            if self.engine.data_parallel_size != len(self.engine.gpus):
                raise SpecError(f"--gpus lists {len(self.engine.gpus)} GPUs but data_parallel_size is "
                                f"{self.engine.data_parallel_size}; give one GPU per engine")
        for name in ("chunk_tokens", "engines_per_gpu", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_memory_bytes", "limit", "max_loras", "max_cpu_loras"):
            value = next(getattr(part, name) for part in (self.engine, self.plan, self.input) if hasattr(part, name))
            if value is not None:
                _check_min(name, value, 1)
        share = self.output.max_unusable
        if share is not None and not 0 <= share <= 1:
            raise SpecError(f"max_unusable must be a share of the rows in [0, 1], got {share}",
                            hint="e.g. --max-unusable 0.05 fails the run when more than 5% of rows have no answer")
        price = self.output.price_per_gpu_hour
        if price is not None and price < 0:
            raise SpecError(f"price_per_gpu_hour must be >= 0, got {price}")
        util = self.engine.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise SpecError(f"gpu_memory_utilization must be in (0, 1], got {util}")
        _check_choice("backend", self.engine.backend, BACKENDS)
        self._check_embed()
        self._check_lora()
        self._check_ray()
        if self.engine.compilation_mode not in (None, 0, 1, 2, 3):
            raise SpecError(f"compilation_mode must be 0, 1, 2 or 3 (vLLM's CompilationMode), "
                            f"got {self.engine.compilation_mode}")
        self._check_structured_outputs_config()
        if self.engine.quantize not in (None, "awq"):
            raise SpecError(f"quantize must be 'awq', got '{self.engine.quantize}'")
        if self.input.raw and self.input.system_prompt:
            raise SpecError("--system-prompt needs the chat template; it cannot be combined with --raw")
        if self.input.shard is not None:
            parse_shard(self.input.shard)
        if self.input.keep_columns is not None and self.input.drop_columns is not None:
            raise SpecError("--keep-columns names the columns to carry, --drop-columns those to leave out: "
                            "pass one of them")
        if self.output.restart and self.output.retry_errors:
            raise SpecError("--restart starts over; --retry-errors resumes: choose one")

    def result_settings(self) -> dict[str, Any]:
        """The settings marked `affects_results`, by name: what a rerun may not change."""
        settings = {f.name: getattr(part, f.name) for part in (getattr(self, name) for name in SECTIONS)
                    for f in dataclasses.fields(part) if f.metadata.get("affects_results")}
        # Folders written before per-row seeds recorded the engine's seed, 0 by default: no seed is
        # still that (they resume); a seed now seeds every row, which an old folder's value never did.
        settings["seed"] = 0 if self.engine.seed is None else f"row seeds from {self.engine.seed}"
        # Folders written before the prompt and messages columns were carried by default hold results
        # without them: resuming one would leave those columns null in its earlier rows.
        if self.input.keep_columns is None:
            settings["carried_columns"] = "every input column, the prompt's and messages' too"
        return settings

    def _check_sampling(self) -> None:
        """Job-level sampling values follow the per-row rules (validate.py): refused here, before
        the model loads, instead of by vLLM once it has (a traceback, or every row an error)."""
        values = {k: v for k, v in dataclasses.asdict(self.sampling).items()
                  if v is not None and k in SAMPLING_KEY_SET}
        try:
            check_params(values)
        except RowError as exc:
            key = exc.message.split(" ", 1)[0]  # each rule's message starts with the value's name
            raise SpecError(exc.message,
                            hint=f"set --{key.replace('_', '-')} (job file: {key}) to a value the rule allows") from None

    def _check_embed(self) -> None:
        _check_choice("task", self.engine.task, TASKS)
        _check_choice("embedding_dtype", self.embed.embedding_dtype, EMBEDDING_DTYPES)
        if self.embed.dimensions is not None:
            _check_min("dimensions", self.embed.dimensions, 1)  # at most the model's hidden size: Job.setup

    def _check_structured_outputs_config(self) -> None:
        """vLLM's StructuredOutputsConfig rules, checked before the model loads (vLLM raises them at start)."""
        backend = self.engine.structured_outputs_backend
        if backend is not None:
            _check_choice("structured_outputs_backend", backend, STRUCTURED_OUTPUTS_BACKENDS)
        if self.engine.disable_any_whitespace and backend not in (None, "xgrammar", "guidance"):
            raise SpecError("disable_any_whitespace works with the xgrammar and guidance backends only (vLLM's rule), "
                            f"got structured_outputs_backend {backend}",
                            hint="add --structured-outputs-backend xgrammar (or guidance)")

    def _check_lora(self) -> None:
        """The adapters' names and vLLM's LoRA rules that need no file (models/adapters.py reads the adapters)."""
        engine = self.engine
        lora = engine.lora
        if lora is not None:
            if not isinstance(lora, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in lora.items()):
                raise SpecError(f"lora must be a table of adapter names and folders, got {_show(lora)}",
                                hint='--lora NAME=PATH, or in a job file: [lora] NAME = "PATH"')
            for name, path in lora.items():
                if not name.strip() or not path.strip():
                    raise SpecError(f"an adapter needs a name and a folder, got '{name}={path}'",
                                    hint="--lora NAME=PATH")
                if name == engine.model:
                    raise SpecError(f"the adapter name '{name}' is the base model's: rows naming it would be "
                                    "ambiguous", where=f"adapter {name}: {path}", hint="give the adapter another name")
        if engine.max_lora_rank is not None and engine.max_lora_rank not in LORA_RANKS:
            raise SpecError(f"max_lora_rank must be one of vLLM's {', '.join(map(str, LORA_RANKS))}; "
                            f"got {engine.max_lora_rank}", hint="pass --max-lora-rank with one of them")
        if engine.max_loras is not None and engine.max_cpu_loras is not None and engine.max_cpu_loras < engine.max_loras:
            raise SpecError(f"max_cpu_loras ({engine.max_cpu_loras}) must be >= max_loras ({engine.max_loras}) "
                            "(vLLM's rule)", hint="raise --max-cpu-loras or lower --max-loras")
        if not lora and any(getattr(engine, name) is not None for name in LORA_SETTINGS[1:]):
            raise SpecError("--max-loras, --max-lora-rank and --max-cpu-loras size vLLM's LoRA adapters; "
                            "the job has none", hint="add --lora NAME=PATH, or leave them out")

    def _check_ray(self) -> None:
        if self.engine.backend == "ray" and self.engine.gpus is not None:
            raise SpecError("--gpus picks GPUs of this machine; with --backend ray, Ray assigns them",
                            hint="pass --data-parallel-size N for N engines, one per GPU")
        if self.engine.backend == "ray" and (self.engine.engines_per_gpu or 1) > 1:
            raise SpecError("--engines-per-gpu works on this machine's GPUs; with --backend ray, Ray gives "
                            "each engine its own GPU", hint="leave --engines-per-gpu out with --backend ray")
        if self.engine.ray_address and self.engine.backend != "ray":
            raise SpecError("--ray-address needs --backend ray")


def load_job_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML job file into flat key/value pairs; paths in it (inputs, output_dir, a json_schema or
    grammar file, a model or tokenizer folder starting with `.`, [lora] folders) are relative to the file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError("job file not found", where=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"job file is not valid TOML: {exc}", where=str(path)) from None
    base = path.parent
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in ("inputs", "output_dir"):
            data[key] = _relative_to(base, value)
        elif name in ("json_schema", "grammar") and isinstance(value, str) and _names_file(base, value):
            data[key] = _relative_to(base, value)  # a file, not the schema or grammar itself
        elif name in ("model", "tokenizer") and isinstance(value, str) and value.startswith("."):
            data[key] = str((base / value).resolve())  # a folder; other names may be hub names
    lora = data.get("lora")
    if isinstance(lora, dict):  # [lora] NAME = "PATH": folders relative to the job file
        data["lora"] = {name: _relative_to(base, folder) for name, folder in lora.items()}
    return data


def _names_file(base: Path, value: str) -> bool:
    """Whether a json_schema or grammar value of a job file names a file (as `_file_or_text` reads it):
    one that exists next to the job file, or one line named like one."""
    if len(value) >= 4096 or "\n" in value or value.lstrip().startswith(("{", "[")):
        return False
    return (base / value).is_file() or Path(value).suffix.lower() in SETTING_FILE_SUFFIXES


def parse_shard(text: str) -> tuple[int, int]:
    """Parse `I/N` (0 <= I < N)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise SpecError(f"shard must look like I/N (e.g. 0/4), got '{text}'") from None
    if count < 1 or not 0 <= index < count:
        raise SpecError(f"shard must satisfy 0 <= I < N, got '{text}'")
    return index, count


def _relative_to(base: Path, value: Any) -> Any:
    """Paths in a job file are relative to it; `-` (standard input) is no path."""
    if isinstance(value, list):
        return [_relative_to(base, item) for item in value]
    if isinstance(value, str) and value != "-" and not is_url(value) and not Path(value).is_absolute():
        return normal_path(base / value)
    return value


def _normalize_paths(inputs: dict[str, Any], output: dict[str, Any]) -> None:
    """Input and output paths in normal form (`normal_path`), so that every message prints them so."""
    if inputs.get("inputs"):
        inputs["inputs"] = [normal_path(path) for path in inputs["inputs"]]
    if output.get("output_dir"):
        output["output_dir"] = normal_path(output["output_dir"])


def _normalize_gpus(engine: dict[str, Any]) -> None:
    """GPU ids as text, and as many engines as GPUs listed (data_parallel_size 1 is the default)."""
    if engine.get("gpus") is not None:
        engine["gpus"] = [str(g) for g in engine["gpus"]]
        if engine.get("data_parallel_size", 1) == 1:
            engine["data_parallel_size"] = len(engine["gpus"])


def _key_owners() -> dict[str, str]:
    return {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def _did_you_mean(key: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _field_types() -> dict[str, typing.Any]:
    """Each setting's type, from the dataclass annotations: the one place that declares them."""
    return {key: hint for cls in SECTIONS.values() for key, hint in typing.get_type_hints(cls).items()}


_FIELD_TYPES = _field_types()


def _typed(raw_key: str, key: str, value: Any, source: str) -> Any:
    """The value as its field's type says (an int is a float where a float is meant), else a SpecError
    naming the key, the type and the value: TOML's "false" or "a,b" must not pass as true or a list."""
    hint = _FIELD_TYPES[key]
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    kind = next(option for option in options if option is not type(None))
    if kind is bool:
        ok, expected = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif kind is str:
        ok, expected = isinstance(value, str), "a string"
    elif typing.get_origin(kind) is list:
        value = _list_convenience(key, value)
        ok, expected = isinstance(value, list) and all(isinstance(v, str) for v in value), "a list of strings"
    else:  # a field of a type the check does not know yet: its own checks in validate() apply
        return value
    if not ok:
        raise SpecError(f"{raw_key} must be {expected}, got {_show(value)}", where=source,
                        hint=f'e.g. {raw_key} = ["a", "b"] in a job file' if expected == "a list of strings" else None)
    return value


def _list_convenience(key: str, value: Any) -> Any:
    if key in ONE_ITEM_LISTS and isinstance(value, str):
        return [value]
    if key in NUMBER_ITEMS and isinstance(value, list):
        return [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
    return value


def _show(value: Any) -> str:
    """A value as a job file writes it: "false" with quotes is the string, not the boolean."""
    try:
        return json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        return repr(value)


# a json schema's or grammar's file, not the text itself
SETTING_FILE_SUFFIXES = (".json", ".gbnf", ".lark", ".ebnf", ".txt")


def _file_or_text(value: str, name: str) -> str:
    """A setting given as a file or as the text itself: an existing file's content, else the text.
    A one-line value named like a file (schema.json, grammar.gbnf) that does not exist is a missing
    file, not text to parse."""
    path = Path(value)
    one_line = len(value) < 4096 and "\n" not in value
    try:
        if one_line and path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read the {name.replace('_', ' ')} file: {exc}", where=value) from None
    if one_line and path.suffix.lower() in SETTING_FILE_SUFFIXES and not value.lstrip().startswith(("{", "[")):
        raise SpecError(f"the {name.replace('_', ' ')} file does not exist", where=value,
                        hint=f"check the path, or pass the {name.replace('_', ' ')} itself")
    return value


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(f"{name} must be one of {', '.join(choices)}; got '{value}'")


def _check_min(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SpecError(f"{name} must be an integer >= {minimum}, got {value!r}")
