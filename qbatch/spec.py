"""The job spec: one typed object that every stage reads, and the one declaration of every setting.

Settings come from three places, merged here and nowhere else: command-line
flags override the TOML job file, which overrides the defaults below. Job
files use the flags' names (`max_tokens` or `max-tokens`) as flat keys.

A setting is declared once, as a field: its type (a `Literal` for a choice), default and `Setting` (help,
panel, range, flag, doors). The CLI's flags, the job file's checks, the Session's and the service's keys
and the reference's key table are read from it. Not pydantic or msgspec: every stage reads the spec as
frozen dataclasses (`replace`, `asdict`, `fields`), and the checks' messages are qbatch's own.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from qbatch._fs import is_url, normal_path
from qbatch.errors import EXIT_INPUT, EXIT_ROW_ERRORS, EXIT_UNUSABLE, RowError, SpecError
from qbatch.sampling import SAMPLING_KEY_SET, check_params, check_structured

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
COMPRESSED_SUFFIXES = (".gz", ".zst")  # read compressed, whatever the format
# Conveniences the type check allows besides each field's annotation (the README's "Job files" says so):
ONE_ITEM_LISTS = frozenset({"inputs", "stop"})  # one string is a one-item list
NUMBER_ITEMS = frozenset({"gpus"})  # GPU ids may be written as integers
# A setting with `results=True` changes what a row's result is: it enters the output folder's fingerprint,
# so a rerun that changes it refuses to mix its results with the old ones (`JobSpec.result_settings`).
# Planning, engine sizing and max_model_len may change between runs (raising max_model_len and rerunning
# with --retry-errors is how rows that were too long get processed).
GENERATE = "generate"  # the task of settings only generation takes (`qbatch embed` has no flag for them)


@dataclass(frozen=True)
class Setting:
    help: str  # the flag's help, and the reference's text for the key
    panel: str = ""  # its panel in --help (cli.HELP_PANELS orders them); "" for a key no flag sets
    results: bool = False  # changes what a row's result is: enters the fingerprint (see above)
    shown: str | None = None  # the help's [default: ...] where the field's own is None (resolved later) or a switch's
    low: float | None = None  # the least value allowed (`open_low`: low itself is not)
    high: float | None = None  # the largest
    open_low: bool = False
    rule: str | None = None  # the range in words, where "in [low, high]" says too little
    hint: str | None = None  # the hint of a value out of range
    flags: tuple[str, ...] = ()  # the flag's spelling where it is not --name (-o, --x/--enable-x)
    metavar: str | None = None
    envvar: str | None = None
    folder: bool = False  # a folder's path: the CLI refuses a file's
    repeat: bool = False  # a list given by repeating the flag (else a comma list)
    serve: bool = False  # a job setting `qbatch serve` takes for every batch (it takes every engine setting)
    task: Literal["generate", "embed"] | None = None  # the one task it means something to (else a section's)

    def check(self, name: str, value: Any) -> None:
        """The value's range (its type is checked as it is read: _typed; its choice by validate)."""
        if value is None or self.low is None and self.high is None:
            return
        too_low = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        if isinstance(value, int) and self.high is None and not self.rule:  # the common case: counts and sizes
            if too_low:
                raise SpecError(f"{name} must be an integer >= {self.low:g}, got {value!r}")
        elif too_low or self.high is not None and value > self.high:
            words = (f"{'>' if self.open_low else '>='} {self.low:g}" if self.high is None else
                     f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}]")
            raise SpecError(f"{name} must be {self.rule or words}, got {value}", hint=self.hint)


def setting(default: Any = None, help: str = "", *, factory: Any = None, **declared: Any) -> Any:
    """A spec field: its default (or `factory`) and its Setting."""
    metadata = {"setting": Setting(help, **declared)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def declared(spec_field: dataclasses.Field[Any]) -> Setting:
    return typing.cast(Setting, spec_field.metadata["setting"])


def from_environment(section: type) -> dict[str, str]:
    """The settings of `section` that their declared environment variable gives (set, not empty): a
    Session takes them from it as the CLI's flags do (`envvar`)."""
    return {f.name: os.environ[name] for f in dataclasses.fields(section)
            if (name := declared(f).envvar) and os.environ.get(name)}


def choices(hint: Any) -> tuple[Any, ...] | None:
    """A Literal's values (of `Literal[...] | None` too), else None."""
    if typing.get_origin(hint) is not Literal:
        hint = next((option for option in typing.get_args(hint) if typing.get_origin(option) is Literal), None)
    return None if hint is None else typing.get_args(hint)


@dataclass(frozen=True)
class InputSpec:
    """Where rows come from and how a row becomes a prompt."""

    inputs: list[str] = setting(help="The INPUT arguments: files, folders, globs, `-` for standard input (a "
                                "string is a one-item list).", factory=list)
    format: Literal["jsonl", "parquet"] | None = setting(None, "Input format (default: by file extension).",
                                                         panel="Input")
    shape: Literal["auto", "prompt", "chat", "openai"] = setting(
        "auto", "Row shape, detected per row.", panel="Input", results=True)
    prompt_column: str = setting("prompt", "Column holding the prompt text.", panel="Input", results=True)
    messages_column: str = setting("messages", "Column holding chat messages.", panel="Input", results=True,
                                   task=GENERATE)
    id_column: str | None = setting(None, "Column holding the row id (not for OpenAI batch lines: they are keyed by "
                                    "their custom_id whatever it says).", shown="id, or custom_id", panel="Input",
                                    results=True)
    template: str | None = setting(None, "Build the prompt from columns, e.g. 'Summarize: {text}'.",
                                   panel="Prompt and template", results=True)
    system_prompt: str | None = setting(None, "Add a system turn to every chat.", panel="Prompt and template",
                                        results=True, task=GENERATE, serve=True)
    raw: bool = setting(False, "Send prompt text as is, without the chat template.", panel="Prompt and template",
                        results=True, task=GENERATE)
    thinking: bool | None = setting(None, "Chat template enable_thinking (Qwen3).", panel="Prompt and template",
                                    results=True, task=GENERATE, serve=True)  # None: the template's own default
    keep_columns: list[str] | None = setting(None, "Input columns to carry to the results (comma list).",
                                             shown="all, the prompt's and messages' too", panel="Input",
                                             results=True)
    drop_columns: list[str] | None = setting(None, "Input columns not to carry to the results (comma list), e.g. "
                                             "prompt,messages.", panel="Input", results=True)  # all but these
    on_bad_line: Literal["error", "skip"] = setting("error", "Malformed JSONL line: stop, or record and go on.",
                                                    panel="Input")
    dedupe: bool = setting(False, "Keep the first row of each duplicated id.", panel="Input", results=True)
    limit: int | None = setting(None, "Process only the first N rows.", panel="Input", low=1)
    shard: str | None = setting(None, "Process only shard I of N (I/N), by id hash.", panel="Input", results=True)


@dataclass(frozen=True)
class SamplingSpec:
    """Job-level sampling; None means the model's generation_config, then vLLM's default."""

    max_tokens: int = setting(2048, "Max output tokens per row.", panel="Sampling", results=True, low=1, serve=True)
    temperature: float | None = setting(None, "Sampling temperature.", shown="model's generation_config",
                                        panel="Sampling", results=True)
    top_p: float | None = setting(None, "Nucleus sampling.", shown="model's generation_config", panel="Sampling",
                                  results=True)
    top_k: int | None = setting(None, "Top-k sampling.", shown="model's generation_config", panel="Sampling",
                                results=True)
    min_p: float | None = setting(None, "Min-p sampling.", panel="Sampling", results=True)
    presence_penalty: float | None = setting(None, "Presence penalty.", panel="Sampling", results=True)
    frequency_penalty: float | None = setting(None, "Frequency penalty.", panel="Sampling", results=True)
    repetition_penalty: float | None = setting(None, "Repetition penalty.", panel="Sampling", results=True)
    stop: list[str] | None = setting(None, "Stop string (repeatable).", panel="Sampling", results=True, repeat=True)
    ignore_eos: bool = setting(False, "Generate max_tokens regardless of EOS (benchmarks).", panel="Sampling",
                               results=True)
    # Structured output (at most one; a row's own constraint replaces it): json_schema and grammar are
    # a file or the text itself (the fingerprint holds the content: Job.fingerprint).
    json_schema: str | None = setting(None, "Constrain answers to a JSON schema (a file, or the JSON itself); see "
                                      "`parsed`.", panel="Structured output", results=True)
    choice: list[str] | None = setting(None, "Constrain answers to one of these labels (comma list), e.g. pos,neg.",
                                       panel="Structured output", results=True)
    regex: str | None = setting(None, "Constrain answers to full-match this regular expression.",
                                panel="Structured output", results=True)
    grammar: str | None = setting(None, "Constrain answers to a grammar (EBNF/Lark as vLLM takes it; a file or the "
                                  "text).", panel="Structured output", results=True)
    n: int = setting(1, "Samples per row: one result row each, with sample_index.", panel="Sampling", results=True)
    logprobs: bool = setting(False, "Add each output token's logprob (a logprobs column).", panel="Sampling",
                             results=True)  # OpenAI's names
    top_logprobs: int | None = setting(None, "With logprobs, the N most likely alternatives of each token (0-20).",
                                       panel="Sampling", results=True)  # implies logprobs
    # vLLM's: reasoning tokens before the engine forces the reasoning's end (needs a reasoning parser)
    thinking_token_budget: int | None = setting(
        None, "vLLM thinking_token_budget: reasoning tokens before the engine ends the reasoning (needs a reasoning "
        "parser; -1: unlimited).", panel="Prompt and template", results=True)

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

    sort_window: int = setting(8192, "Rows sorted by length together (the last window also takes the rows left at "
                               "the end).", panel="Chunks and order", low=1, serve=True)
    order: Literal["longest-first", "longest-first-flat", "input"] = setting(
        "longest-first", "Rows go to the engine longest first in each window (max_tokens, then prompt), rows sharing "
        "a long prompt prefix together; longest-first-flat: without the groups; input: in input order.",
        panel="Chunks and order")
    # None: DEFAULT_CHUNK_TOKENS, split among the engines (qbatch/plan/resolve.py). One engine is fed
    # across chunk boundaries, so the size changes what a crash redoes (the chunks in flight) and the
    # number of parts, not the feed.
    chunk_tokens: int | None = setting(None, "Token budget (prompt + max_tokens) of one chunk of rows fed to the "
                                       "engine.", panel="Chunks and order", low=1, serve=True,
                                       shown=f"{DEFAULT_CHUNK_TOKENS}; with N engines, {DEFAULT_CHUNK_TOKENS}/(16N)")


ENGINE = "Model and engine"
GPUS = "GPUs and scaling"


@dataclass(frozen=True)
class EngineSpec:
    """vLLM engine settings; names mirror vLLM's. None leaves vLLM's own default."""

    model: str = setting(DEFAULT_MODEL, "Model: hub name, folder, or smollm2-135m (bundled).", panel=ENGINE,
                         flags=("-m", "--model"), envvar="QBATCH_MODEL")
    tokenizer: str | None = setting(None, "Tokenizer folder or name (default: the model's).", panel=ENGINE,
                                    results=True)
    revision: str | None = setting(None, "Model revision (hub models).", panel=ENGINE, results=True)
    max_model_len: int | None = setting(None, "vLLM max_model_len.", shown="model's context", panel=ENGINE, low=1)
    gpu_memory_utilization: float | None = setting(
        None, "vLLM gpu_memory_utilization (of each GPU, split among its engines).", panel=ENGINE, low=0, high=1,
        open_low=True)
    kv_cache_memory_bytes: int | None = setting(  # the CPU's default: plan/engine_args.py
        None, "vLLM kv_cache_memory_bytes (overrides gpu_memory_utilization).  [default on CPU: 2 GiB; engines "
        "sharing a GPU: their share of it, so they start together]", panel=ENGINE, low=1)
    max_num_seqs: int | None = setting(None, "vLLM max_num_seqs.", panel=ENGINE, low=1)
    max_num_batched_tokens: int | None = setting(None, "vLLM max_num_batched_tokens.", panel=ENGINE, low=1)
    dtype: str = setting("auto", "vLLM dtype.", panel=ENGINE, results=True)
    quantization: str | None = setting(None, "vLLM quantization (usually detected from the checkpoint).",
                                       panel=ENGINE, results=True)
    tensor_parallel_size: int = setting(1, "vLLM tensor_parallel_size.", panel=GPUS, low=1)
    # None: True on CPU (compiling takes minutes there), else False
    enforce_eager: bool | None = setting(None, "vLLM enforce_eager: no torch.compile/CUDA graphs.",
                                         shown="on for CPU", panel=ENGINE)
    # None: chosen from the job's shape (plan/shape.py), else 0 on Hopper GPUs (plan/engine_args.py)
    compilation_mode: int | None = setting(
        None, "vLLM compilation_config mode: 0 no torch.compile, 3 torch.compile.", panel=ENGINE, low=0, high=3,
        rule="0, 1, 2 or 3 (vLLM's CompilationMode)",
        shown="chosen from the job's shape on a GPU (3 for prefill-bound jobs when compiling pays), else 0 on Hopper")
    # None: vLLM's engine seed 0, samples not reproducible; set: each row's own (qbatch.sampling.row_seed)
    seed: int | None = setting(None, "Seed: each row samples with a seed derived from it and the row id (reruns "
                               "repeat).", shown="none; vLLM engine seed 0", panel="Sampling", results=True)
    load_format: str | None = setting(None, "vLLM load_format (e.g. dummy for random weights).", panel=ENGINE,
                                      results=True)
    performance_mode: str | None = setting("throughput", "vLLM performance_mode.", panel=ENGINE)
    # None: vLLM's fcfs; `qbatch serve` sets priority (serve/config.py) so that its online rows go first
    scheduling_policy: Literal["fcfs", "priority"] | None = setting(
        None, "vLLM scheduling_policy: with priority, rows someone waits on (the service's online requests) go "
        "before the rows of batches queued in the engine.", shown="priority for qbatch serve's engines, else fcfs",
        panel=ENGINE)
    quantize: Literal["awq"] | None = setting(None, "Quantize the model with AutoAWQ first (cached).", panel=ENGINE,
                                              results=True, task=GENERATE)
    data_parallel_size: int = setting(1, "GPUs to use, each with its own engine process(es).", panel=GPUS, low=1)
    engines_per_gpu: int | None = setting(  # None: chosen by plan/placement.py
        None, "Engines sharing each GPU: a small model leaves the GPU idle between steps, a second engine fills the "
        "gaps.", shown="2 for models under 2% of a GPU's memory on hosts with 8+ cores per GPU, else 1", panel=GPUS,
        low=1)
    mps: bool | None = setting(None, "CUDA MPS for engines sharing a GPU: their kernels run side by side instead "
                               "of in turns (qbatch starts and stops a daemon of its own).", panel=GPUS,
                               shown="on where engines share a GPU and nvidia-cuda-mps-control is installed")
    # None: on for vLLM's generation engines on a GPU (plan/resolve.py, measured: docs/benchmarks.md#warm-up)
    warm_up: bool | None = setting(None, "Each engine on a GPU runs a short batch of dummy rows (a full decode batch, "
                                   "a few tokens each) before it takes the job's rows, so the job's first steps do "
                                   "not pay the engine's one-time costs; not counted in the results, stats or "
                                   "telemetry.", shown="on for generation engines on a GPU",
                                   panel=ENGINE, task=GENERATE)
    gpus: list[str] | None = setting(None, "GPU ids for the engines (comma list), e.g. 0,1.", panel=GPUS,
                                     shown="the first N of CUDA_VISIBLE_DEVICES, else 0..N-1")
    # None: plan/resolve.py's choice (rows with a constraint of their own need the flag)
    reasoning_parser: str | None = setting(
        None, "vLLM reasoning_parser: constraints apply after the reasoning.", panel="Structured output",
        shown="qwen3 for Qwen3 models with a job-level constraint or thinking budget", results=True, task=GENERATE)
    # "embed": vectors instead of text (vLLM's runner="pooling"; a decoder gets convert="embed"): `qbatch embed`
    task: Literal["generate", "embed"] = setting(
        "generate", "Set by the command: `generate` (`qbatch run`) or `embed` (`qbatch embed`).", results=True)
    # vLLM's StructuredOutputsConfig.backend and .disable_any_whitespace (None: qbatch's choice, plan/engine_args.py);
    # its backend values are the same in vLLM 0.26 and 0.32
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"] | None = (
        setting(None, "vLLM StructuredOutputsConfig.backend for constrained rows.", panel="Structured output",
                shown="guidance, compact JSON (a slow tokenizer: auto)", results=True, task=GENERATE))
    disable_any_whitespace: bool | None = setting(
        None, "vLLM StructuredOutputsConfig.disable_any_whitespace: compact JSON, no free whitespace (xgrammar, "
        "guidance).", panel="Structured output", flags=("--disable-any-whitespace",), results=True, task=GENERATE)
    # "ray": engines in Ray actors (engines/ray_actors.py); "null": returns instantly (tests)
    backend: Literal["vllm", "ray", "null"] = setting(
        "vllm", "Engine: vllm, ray (engines on a Ray cluster), or null (returns instantly; for pipeline tests).",
        panel=ENGINE, results=True)
    ray_address: str | None = setting(None, "Ray cluster to join with --backend ray: auto (on a cluster node) or "
                                      "HOST:6379.", shown="$RAY_ADDRESS, else a local cluster", panel=GPUS)
    # LoRA adapters by name (--lora NAME=PATH, a job file's [lora] table): a row picks one by name (its
    # `adapter` column, or an OpenAI line's body.model); rows naming none use the base model. Their content
    # enters the fingerprint (Job.fingerprint). vLLM's LoRA settings: None is chosen from the adapters
    # (models/adapters.py), before the engine starts.
    lora: dict[str, str] | None = setting(
        None, "A LoRA adapter (a PEFT folder) rows can pick by NAME in their `adapter` column or an OpenAI line's "
        "body.model (repeatable); rows naming none use the base model.", panel=ENGINE, metavar="NAME=PATH",
        repeat=True, results=True, task=GENERATE)
    max_loras: int | None = setting(None, "vLLM max_loras: adapters in one batch.", panel=ENGINE, low=1,
                                    shown="the adapters given, at most 8", task=GENERATE)
    max_lora_rank: int | None = setting(None, "vLLM max_lora_rank.", panel=ENGINE, task=GENERATE,
                                        shown="the adapters' largest rank, rounded up to one vLLM takes")
    max_cpu_loras: int | None = setting(None, "vLLM max_cpu_loras: adapters kept in CPU memory.", panel=ENGINE, low=1,
                                        shown="the adapters given", task=GENERATE)
    # False: vLLM computes its scheduler stats every step (running/waiting requests, KV-cache usage: telemetry
    # records them); vLLM's LLM() default is True, as it costs per-step work in its engine loop
    disable_log_stats: bool = setting(
        True, "vLLM disable_log_stats: --enable-log-stats adds running/waiting requests and KV-cache usage to the "
        "telemetry (vLLM then works out its stats every step).", shown="disabled", panel=ENGINE,
        flags=("--disable-log-stats/--enable-log-stats",))

    def engine_count(self) -> int:
        """Engine processes in all (engines_per_gpu None counts as one: not chosen yet)."""
        return self.data_parallel_size * (self.engines_per_gpu or 1)

    def one_engine(self, **changes: Any) -> EngineSpec:
        """The settings of one engine of these: what a data-parallel worker or a Ray actor runs here."""
        return dataclasses.replace(self, data_parallel_size=1, gpus=None, engines_per_gpu=1, **changes)


EXIT = "Exit codes and resume"


@dataclass(frozen=True)
class OutputSpec:
    """Where results go and how the run reports."""

    output_dir: str | None = setting(None, "Output folder (parts, results, manifest).", panel="Output",
                                     flags=("-o", "--output-dir"), folder=True)
    output_format: Literal["parquet", "jsonl-openai"] = setting(
        "parquet", "Also write results.jsonl in OpenAI Batch format (jsonl-openai).", panel="Output")
    include_prompt: bool = setting(False, "Add the rendered prompt to the results.", panel="Output", results=True)
    progress: Literal["auto", "bar", "log", "none"] = setting(
        "auto", "Progress: bar on a terminal, log lines otherwise.", panel="Output", serve=True)
    fail_on_row_errors: bool = setting(False, f"Exit {EXIT_ROW_ERRORS} if any row failed.", panel=EXIT)
    max_unusable: float | None = setting(
        None, f"Exit {EXIT_UNUSABLE} if more than this share of rows have no usable answer (ended inside their "
        "reasoning, empty, or not parsed under their constraint): the `flag` column.", panel=EXIT, metavar="SHARE",
        low=0, high=1, rule="a share of the rows in [0, 1]",
        hint="e.g. --max-unusable 0.05 fails the run when more than 5% of rows have no answer")
    price_per_gpu_hour: float | None = setting(
        None, "What a GPU-hour costs: the summary shows the run's cost, --dry-run the estimated cost.", panel="Output",
        metavar="PRICE", low=0)
    fail_on_empty: bool = setting(False, f"Exit {EXIT_INPUT} if the inputs hold no rows (else a warning).",
                                  panel=EXIT)
    restart: bool = setting(False, "Delete OUT_DIR's results and start over.", panel=EXIT)
    retry_errors: bool = setting(False, "Process rows recorded as errors again.", panel=EXIT)
    dry_run: bool = setting(False, "Read, tokenize, validate and plan; print what the engines would get and why; load "
                            "no model.", panel=EXIT)
    telemetry: bool = setting(True, "Record GPU (or CPU) and engine counters once a second into "
                              "OUT_DIR/telemetry.parquet.", shown="on", panel="Output")
    report: bool = setting(False, "Write OUT_DIR/report.html (qbatch report) when the run ends.", panel="Output")


EMBED = "Embeddings"


@dataclass(frozen=True)
class EmbedSpec:
    """What an embedding job (task "embed") does to each vector; unused by generation."""

    dimensions: int | None = setting(  # then re-normalized
        None, "Keep the first N values of each vector (Matryoshka: Qwen3-Embedding), then normalize.", panel=EMBED,
        shown="all, the model's hidden size", low=1, results=True)  # at most the model's hidden size: Job.setup
    normalize: bool = setting(True, "Scale each vector to unit L2 norm.", shown="normalize", panel=EMBED,
                              results=True)  # after the truncation
    instruction: str | None = setting(None, "Query-side task instruction, in Qwen3-Embedding's format "
                                      "'Instruct: {instruction}\\nQuery:{text}'. Leave it out for documents.",
                                      panel="Prompt and template", results=True)
    truncate: bool = setting(False, "Embed the first max_model_len tokens of over-long inputs (else they become "
                             "prompt_too_long error rows).", panel=EMBED, results=True)
    embedding_dtype: Literal["float32", "float16"] = setting(
        "float32", "Type of the stored vectors: float16 halves the output.", panel=EMBED, results=True)


# vLLM's LoRA settings (vllm/config/lora.py): the ranks its LoRAConfig takes, and qbatch's names for them
LORA_SETTINGS = ("lora", "max_loras", "max_lora_rank", "max_cpu_loras")
# Settings of the engine section that are a job's own on engines started for others (a Session's, a
# service's): a seed seeds each row (vLLM's engine seed stays), and a job's adapters are those it names
# (none: an `adapter` column is plain data). A job whose adapters differ gets an engine of its own.
JOB_OWN_ENGINE_SETTINGS = frozenset({"seed", *LORA_SETTINGS})
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The settings a Session(...) and `qbatch serve` take for their engines; a run's or a batch's are the others.
ENGINE_SETTINGS = frozenset(f.name for f in dataclasses.fields(EngineSpec))
# `qbatch serve`'s flags: its engine's, and the job settings every batch runs with (`serve=True`).
SERVE_SETTINGS = ENGINE_SETTINGS | {f.name for cls in (InputSpec, SamplingSpec, PlanSpec, OutputSpec, EmbedSpec)
                                    for f in dataclasses.fields(cls) if declared(f).serve}


# Settings of one task only: an embedding job takes none of generation's (chat turns, sampling,
# constraints, thinking), a generation job none of embedding's. `qbatch embed` has no flags for the
# first; fingerprints and reports leave out whichever does not apply.
GENERATION_ONLY = frozenset({*(f.name for f in dataclasses.fields(SamplingSpec)),
                             *(f.name for cls in (InputSpec, EngineSpec) for f in dataclasses.fields(cls)
                               if declared(f).task == GENERATE)})
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
        """Each setting's choices and range (its declaration), then the rules between settings."""
        for section in SECTIONS:
            part = getattr(self, section)
            for f in dataclasses.fields(part):
                value, allowed = getattr(part, f.name), _CHOICES[f.name]
                if allowed is not None and value is not None and value not in allowed:
                    raise SpecError(f"{f.name} must be one of {', '.join(map(str, allowed))}; got '{value}'"
                                    if len(allowed) > 1 else f"{f.name} must be {allowed[0]!r}, got {value!r}")
                declared(f).check(f.name, value)
        self._check_sampling()
        self.sampling.structured_outputs()
        if self.engine.gpus is not None:
            twice = sorted({g for g in self.engine.gpus if self.engine.gpus.count(g) > 1})
            if twice:
                raise SpecError(f"--gpus lists GPU {twice[0]} more than once",
                                hint=f"for several engines on one GPU pass --engines-per-gpu {self.engine.gpus.count(twice[0])}")
            if self.engine.data_parallel_size != len(self.engine.gpus):
                raise SpecError(f"--gpus lists {len(self.engine.gpus)} GPUs but data_parallel_size is "
                                f"{self.engine.data_parallel_size}; give one GPU per engine")
        self._check_lora()
        self._check_ray()
        self._check_structured_outputs_config()
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
        """The settings declared `results=True`, by name: what a rerun may not change."""
        settings = {f.name: getattr(part, f.name) for part in (getattr(self, name) for name in SECTIONS)
                    for f in dataclasses.fields(part) if declared(f).results}
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

    def _check_structured_outputs_config(self) -> None:
        """vLLM's StructuredOutputsConfig rules, checked before the model loads (vLLM raises them at start)."""
        backend = self.engine.structured_outputs_backend
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


# Each setting's type, from the dataclass annotations (the one place that declares them), and a Literal's values
_FIELD_TYPES = {key: hint for cls in SECTIONS.values() for key, hint in typing.get_type_hints(cls).items()}
_CHOICES = {key: choices(hint) for key, hint in _FIELD_TYPES.items()}


def _typed(raw_key: str, key: str, value: Any, source: str) -> Any:
    """The value as its field's type says (an int is a float where a float is meant), else a SpecError
    naming the key, the type and the value: TOML's "false" or "a,b" must not pass as true or a list."""
    hint = _FIELD_TYPES[key]
    options = typing.get_args(hint) if typing.get_origin(hint) in (types.UnionType, typing.Union) else (hint,)
    if value is None and type(None) in options:
        return None
    kind = next(option for option in options if option is not type(None))
    if typing.get_origin(kind) is Literal:  # a choice: of its values' type here, one of them in validate()
        kind = type(typing.get_args(kind)[0])
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
