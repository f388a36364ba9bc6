"""AWQ 4-bit quantization with AutoAWQ: the only module that imports it (inside functions).

`quantize()` builds an AWQ checkpoint that vLLM loads as is. Everything that can
be checked from the config and the tokenizer is checked before the weights load
(already quantized, architecture, layer sizes vs group size, calibration tokens).
Calibration prompts (calibration.py) reach AutoAWQ as token ids, so it never
downloads its default data set.
The folder is built next to OUT_DIR and renamed into place: no half-written
model survives a crash. `ensure_quantized()` is `qbatch run --quantize awq`:
the same build into qbatch's cache, keyed by (model, settings, calibration data),
under a file lock, and reused by every later run.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qbatch._fs import atomic_folder, exclusive_lock
from qbatch.models import registry as models
from qbatch.models.calibration import Calibration, calibration_files, files_sha256, load_calibration
from qbatch.errors import MissingDependency, ModelError, OutputError, SpecError, first_line
from qbatch.log import log as qbatch_log
from qbatch.spec import JobSpec
from qbatch.versions import __version__, package_versions

META_NAME = "qbatch-quantize.json"
VERSIONS = ("gemm", "gemv")
GROUP_SIZES = (128, 64, 32)  # the ones vLLM's fast AWQ kernels take, largest first
WEIGHT_SUFFIXES = (".safetensors", ".bin")
CACHE_FORMAT = 1  # bump when a build would differ for the same inputs

Log = Callable[[str], None]


@dataclass(frozen=True)
class AwqSettings:
    """AutoAWQ's settings; the defaults are those of `qbatch run --quantize awq`."""

    w_bit: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    calib: str | None = None  # None: the shipped sample_data/calib.jsonl
    calib_samples: int = 128
    calib_seq_len: int = 512

    def validate(self) -> None:
        if self.w_bit != 4:
            raise SpecError(f"w_bit must be 4 (AutoAWQ and vLLM's AWQ kernels are 4-bit only), got {self.w_bit}")
        for name in ("group_size", "calib_samples", "calib_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"{name} must be an integer >= 1, got {value!r}")
        if self.version not in VERSIONS:
            raise SpecError(f"version must be one of {', '.join(VERSIONS)}; got '{self.version}'")

    def quant_config(self) -> dict[str, Any]:
        return {"w_bit": self.w_bit, "q_group_size": self.group_size, "zero_point": self.zero_point,
                "version": self.version.upper()}

    def describe(self) -> str:
        zero = "zero point" if self.zero_point else "no zero point"
        return f"AWQ {self.w_bit}-bit, group {self.group_size}, {zero}, {self.version}"


RUN_SETTINGS = AwqSettings()  # what `qbatch run --quantize awq` builds


def quantize(model: str, out_dir: str | Path, settings: AwqSettings, *, log: Log | None = None) -> dict[str, Any]:
    """Quantize MODEL (name, folder or bundled alias) into OUT_DIR; returns what qbatch-quantize.json holds."""
    settings.validate()
    target = Path(out_dir).expanduser().absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise OutputError("output folder already exists and is not empty", where=str(target),
                          hint="pass a new OUT_DIR, or delete this one first")
    source = local_folder(models.resolve(model))
    target.parent.mkdir(parents=True, exist_ok=True)
    return build(source, target, settings, model_name=model, log=log or _stderr_log)


def ensure_quantized(model_path: str, spec: JobSpec) -> str:
    """The AWQ model for a run: from qbatch's cache, built there once (under a file lock) if missing."""
    settings = RUN_SETTINGS
    log = _stderr_log  # quiet with --progress none: the logger's level says
    if spec.engine.dtype in ("float32", "float"):
        raise SpecError("AWQ weights run in float16 or bfloat16; --dtype float32 cannot load them",
                        hint="drop --dtype (auto picks the checkpoint's dtype) or pass --dtype bfloat16")
    if spec.engine.backend == "vllm" and (reason := four_bit_unsupported_reason()):
        raise SpecError(f"--quantize awq cannot run here: {reason}",
                        hint="drop --quantize awq on this machine, or run on a GPU or an AVX-512 CPU "
                             "(`qbatch quantize` still builds the checkpoint here)")
    source = local_folder(model_path)
    key = cache_key(source, settings)
    target = models.cache_dir() / "awq" / key
    if (target / META_NAME).is_file():
        log(f"using the cached AWQ model {target}")
        return str(target)
    if spec.output.dry_run:  # check what can be checked; the source has the same tokenizer and context
        check(source, settings)
        log(f"dry run: the AWQ model is not built yet; a run builds it into {target}")
        return source
    with exclusive_lock(target.parent / f".{key}.lock"):  # another run may be building it: wait, then reuse
        if (target / META_NAME).is_file():
            log(f"using the AWQ model another run just built: {target}")
        else:
            for stale in target.parent.glob(f".{key}-*"):  # left by a killed build; we hold the lock
                shutil.rmtree(stale, ignore_errors=True)
            log(f"quantizing {spec.engine.model} ({settings.describe()}) into {target}; later runs reuse it")
            build(source, target, settings, model_name=spec.engine.model, log=log)
    return str(target)


def refuse_unrunnable(model_path: str, spec: JobSpec) -> None:
    """A 4-bit checkpoint given with --model is refused before the engine starts where this vLLM
    has no kernel for it, as --quantize awq is (vLLM would fail its own validation after loading)."""
    if spec.engine.backend != "vllm":
        return
    method = models.four_bit_method(model_path)
    if method is not None and (reason := four_bit_unsupported_reason()):
        raise SpecError(f"the model is a 4-bit {method} checkpoint, which cannot run here: {reason}",
                        where=model_path, hint="pass the unquantized model with --model on this machine, "
                                               "or run on a GPU or an AVX-512 CPU")


def four_bit_unsupported_reason() -> str | None:
    from qbatch.engines.platform import awq_unsupported_reason

    return awq_unsupported_reason()


def build(source: str, target: Path, settings: AwqSettings, *, model_name: str, log: Log) -> dict[str, Any]:
    """Check, calibrate, quantize and write `target` atomically. `source` is a local model folder."""
    started = time.monotonic()
    config, tokenizer, calibration = check(source, settings)
    log(f"calibration: {calibration.describe()}")
    awq = import_autoawq()
    import torch

    on_gpu = torch.cuda.is_available()
    # AutoAWQ computes in float16 on GPUs; on CPUs float32 (float16 is emulated there, and slow).
    compute_dtype = torch.float16 if on_gpu else torch.float32
    t0 = time.monotonic()
    with _quiet_transformers():  # AutoAWQ passes torch_dtype, which transformers 5 warns about
        model = awq.AutoAWQForCausalLM.from_pretrained(
            source, torch_dtype=compute_dtype, trust_remote_code=False, device_map=None,
            safetensors=any(Path(source).glob("*.safetensors")))
    t1 = time.monotonic()
    log(f"loaded {model_name} in {t1 - t0:.1f}s; quantizing on {'cuda' if on_gpu else 'cpu'} ({settings.describe()})")
    model.quantize(tokenizer, quant_config=settings.quant_config(), calib_data=calibration.token_ids,
                   max_calib_samples=len(calibration.token_ids), max_calib_seq_len=calibration.seq_len)
    t2 = time.monotonic()
    save_dtype = _save_dtype(config, torch)
    _cast_unquantized(model.model, save_dtype)
    model.model.config.use_cache = getattr(config, "use_cache", True)  # AutoAWQ turns it off to calibrate
    meta = {
        "qbatch_version": __version__, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": {"model": model_name, "path": source, "identity": model_identity(source)},
        "settings": {k: v for k, v in asdict(settings).items() if k != "calib"},
        "calibration": {"files": calibration.files, "sha256": calibration.sha256,
                        "num_texts": len(calibration.token_ids), "num_tokens": calibration.num_tokens,
                        "num_blocks": calibration.num_blocks, "num_skipped_long": calibration.num_skipped_long},
        "dtype": str(save_dtype).removeprefix("torch."), "device": "cuda" if on_gpu else "cpu",
        "weights_bytes_before": weights_bytes(source),
        "versions": package_versions(("autoawq", "torch", "transformers")),
    }

    def write(folder: Path) -> None:
        model.save_quantized(str(folder))
        tokenizer.save_pretrained(folder)  # with the chat template (chat_template.jinja)
        generation = Path(source) / "generation_config.json"
        if generation.is_file():  # AutoAWQ rewrites it with do_sample=True; keep the model's own
            shutil.copyfile(generation, folder / "generation_config.json")
        meta["weights_bytes_after"] = weights_bytes(str(folder))
        meta["timings_s"] = {"check_and_calibration_data": round(t0 - started, 2), "load": round(t1 - t0, 2),
                             "quantize": round(t2 - t1, 2), "save": round(time.monotonic() - t2, 2),
                             "total": round(time.monotonic() - started, 2)}
        (folder / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")

    atomic_folder(target, write)
    return meta


def check(source: str, settings: AwqSettings) -> tuple[Any, Any, Calibration]:
    """Everything checked before the weights load: (config, tokenizer, calibration data)."""
    from qbatch.tokens import load_tokenizer

    config = check_model(source, settings)
    tokenizer = load_tokenizer(source)
    calibration = load_calibration(calibration_files(settings.calib), tokenizer, samples=settings.calib_samples,
                                   seq_len=settings.calib_seq_len)
    return config, tokenizer, calibration


def check_model(path: str, settings: AwqSettings) -> Any:
    """Refuse, before any weight loads, what AutoAWQ cannot quantize; returns the model's config."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ModelError(f"cannot load the config of model '{path}': {first_line(exc, 300)}",
                         hint=models.OFFLINE_HINT) from None
    existing = getattr(config, "quantization_config", None)
    if existing:
        method = existing.get("quant_method") if isinstance(existing, dict) else getattr(existing, "quant_method", "?")
        raise ModelError(f"model is already quantized (quant_method: {method})", where=path,
                         hint="quantize the original model; to run this one, pass it to `qbatch run --model` "
                              "without --quantize")
    text = config.get_text_config()
    found = {"hidden_size": getattr(text, "hidden_size", None),
             "intermediate_size": getattr(text, "intermediate_size", None),
             "moe_intermediate_size": getattr(text, "moe_intermediate_size", None)}
    heads, head_dim = getattr(text, "num_attention_heads", None), getattr(text, "head_dim", None)
    if heads and head_dim:
        found["num_attention_heads * head_dim"] = heads * head_dim
    sizes = {name: size for name, size in found.items() if isinstance(size, int)}
    bad = {name: size for name, size in sizes.items() if size % settings.group_size}
    if bad:
        listed = ", ".join(f"{name} is {size}" for name, size in bad.items())
        fits = [g for g in GROUP_SIZES if all(size % g == 0 for size in sizes.values())]
        hint = (f"quantize with `qbatch quantize MODEL OUT_DIR --group-size {fits[0]}`, then `qbatch run --model OUT_DIR`"
                if fits else "this model's layer sizes fit none of AWQ's group sizes (128, 64, 32)")
        raise ModelError(f"layer sizes must be multiples of the group size {settings.group_size}: {listed}",
                         where=path, hint=hint)
    known = import_autoawq().models.auto.AWQ_CAUSAL_LM_MODEL_MAP
    if config.model_type not in known:
        raise ModelError(f"AutoAWQ cannot quantize architecture '{config.model_type}'", where=path,
                         hint=f"it knows: {', '.join(sorted(known))}; or run the model without --quantize")
    return config


def cache_key(source: str, settings: AwqSettings) -> str:
    """`<model folder name>-<hash of model identity, settings and calibration data>`."""
    files = calibration_files(settings.calib)
    payload = {"format": CACHE_FORMAT, "model": model_identity(source),
               "settings": {k: v for k, v in asdict(settings).items() if k != "calib"},
               "calibration_sha256": files_sha256(files)}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(source).name).strip(".-") or "model"
    return f"{name}-w{settings.w_bit}g{settings.group_size}-{digest}"


def model_identity(folder: str) -> str:
    """A hash of the folder: text files by content, weight files by name, size and modification time."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).iterdir()):
        if not path.is_file():
            continue
        if path.suffix in WEIGHT_SUFFIXES:
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
        elif path.suffix in (".json", ".jinja", ".txt", ".model"):
            digest.update(f"{path.name}\n".encode() + path.read_bytes())
    return digest.hexdigest()


def local_folder(model_path: str) -> str:
    """A hub name becomes its downloaded snapshot (cached by huggingface_hub); folders stay as they are."""
    if Path(model_path).is_dir():
        return str(Path(model_path).resolve())
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except Exception as exc:
        raise ModelError(f"cannot download model '{model_path}': {first_line(exc, 300)}",
                         hint=models.OFFLINE_HINT) from None


def weights_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def import_autoawq() -> Any:
    try:
        # Its import prints a long deprecation notice (it installs its own filter first, so only
        # recording the warnings keeps them quiet) and changes the global filters (restored on exit).
        with warnings.catch_warnings(record=True):
            import awq
            import awq.models.auto
    except ImportError as exc:
        raise MissingDependency(f"AWQ quantization needs AutoAWQ ({exc.name or 'awq'} is not installed)",
                                hint="pip install 'qbatch[awq]'") from None
    return awq


def summary_lines(meta: dict[str, Any], out_dir: str) -> list[str]:
    """What `qbatch quantize` prints when it is done."""
    before, after = meta["weights_bytes_before"], meta["weights_bytes_after"]
    timings, calib = meta["timings_s"], meta["calibration"]
    settings = AwqSettings(**meta["settings"])
    return [
        f"quantized {meta['source']['model']} -> {out_dir} ({settings.describe()})",
        f"  weights      {_mb(before)} -> {_mb(after)} ({after / before:.0%} of before)" if before else
        f"  weights      {_mb(after)}",
        f"  time         {timings['total']:.1f}s (load {timings['load']:.1f}s, quantize {timings['quantize']:.1f}s, "
        f"save {timings['save']:.1f}s)",
        f"  calibration  {calib['num_texts']} texts, {calib['num_tokens']:,} tokens, {calib['num_blocks']} blocks "
        f"of {settings.calib_seq_len}",
    ]


def _save_dtype(config: Any, torch: Any) -> Any:
    """The source's dtype when vLLM's AWQ kernels take it (float16, bfloat16), else float16."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


def _cast_unquantized(model: Any, dtype: Any) -> None:
    """Embeddings, norms and the head go back to the save dtype; packed AWQ layers keep their float16 scales."""
    for module in model.modules():
        if type(module).__name__.startswith("WQLinear"):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    model.config.dtype = dtype


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:,.1f} MB"


def _stderr_log(message: str) -> None:
    """Quantization's progress lines, through qbatch's logger (stderr)."""
    qbatch_log.info(message)
