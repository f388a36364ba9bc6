"""LoRA adapters through the real CLI on the null engine (fast): the refusals before any engine starts, the
rows' choice (adapter or lora column, an OpenAI line's body.model), the results' adapter column, the
counts per adapter, the fingerprint, the job file's [lora] table, the engine arguments and the planner.
The real engine's answers per adapter: tests/engines/test_lora_engine.py."""

from __future__ import annotations

import json

import polars as pl
import pytest

from qbatch.bench.adapters import write_random_adapter
from qbatch.errors import EXIT_MISMATCH, EXIT_USAGE


@pytest.fixture
def adapters(bundled_model, tmp_path):
    """Two random adapters of the bundled model: one of rank 8, two of rank 4 (seeded)."""
    return {name: write_random_adapter(tmp_path / "adapters" / name, bundled_model, rank=rank, seed=seed)
            for name, rank, seed in (("one", 8, 1), ("two", 4, 2))}



def lora_flags(adapters) -> list[str]:
    return [flag for name, folder in adapters.items() for flag in ("--lora", f"{name}={folder}")]


def test_rows_pick_adapters_by_column_and_body_model(run_null_short, adapters, write_jsonl, tmp_path, bundled_model):
    rows = [{"id": "a", "prompt": "hi", "adapter": "one"}, {"id": "b", "prompt": "hi"},
            {"id": "c", "prompt": "hi", "lora": "two"}, {"id": "d", "prompt": "hi", "adapter": "three"},
            {"custom_id": "e", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "two", "messages": [{"role": "user", "content": "hi"}]}},
            {"custom_id": "f", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": bundled_model, "messages": [{"role": "user", "content": "hi"}]}}]
    out = tmp_path / "out"
    result = run_null_short(write_jsonl(rows), "-o", out, *lora_flags(adapters), "--output-format", "jsonl-openai")
    assert result.exit_code == 0, result.output  # an unknown adapter fails its row, not the run
    results = pl.read_parquet(out / "results.parquet")
    assert dict(zip(results["id"], results["adapter"], strict=True)) == {"a": "one", "b": None, "c": "two",
                                                                         "e": "two", "f": None}
    assert "lora" not in results.columns and "input_adapter" not in results.columns  # the choice is the column
    (error,) = pl.read_parquet(out / "errors.parquet").to_dicts()
    assert (error["id"], error["error"]) == ("d", "unknown_adapter")
    assert error["message"] == ("adapter names 'three', which is neither the base model nor one of the job's "
                                "adapters: one, two")
    stats = json.loads((out / "stats.json").read_text())
    assert {name: counts["rows"] for name, counts in stats["adapters"].items()} == {"(base model)": 2, "one": 1,
                                                                                      "two": 2}
    assert "adapter two" in result.output and "2 rows, tokens in / out" in result.output
    lines = {line["custom_id"]: line for line in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert lines["e"]["response"]["body"]["model"] == "two"  # as vLLM's server answers for an adapter


def test_without_adapters_the_columns_are_data_and_body_model_changes_nothing(run_null_short, write_jsonl, tmp_path):
    rows = [{"id": "a", "prompt": "hi", "adapter": "one"},
            {"custom_id": "e", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}}]
    out = tmp_path / "out"
    assert run_null_short(write_jsonl(rows), "-o", out).exit_code == 0
    results = pl.read_parquet(out / "results.parquet")
    assert results.height == 2 and results.filter(pl.col("id") == "a")["adapter"].to_list() == ["one"]


@pytest.mark.parametrize(("make", "flags", "message"), [
    (None, ["--lora", "one=missing"], "Error: the adapter folder does not exist (adapter one: missing)"),
    ("empty", ["--lora", "one=ADAPTER"], "Error: the adapter folder has no adapter_config.json (adapter one: ADAPTER)"),
    ("rank8", ["--lora", "one=ADAPTER", "--max-lora-rank", "1"],
     "Error: the adapter's rank 8 is above --max-lora-rank (1) (adapter one: ADAPTER)"),
    ("targets", ["--lora", "one=ADAPTER"],
     "Error: the adapter's target modules nonexistent_proj are not layers of the base model a LoRA adapter can change "
     "(adapter one: ADAPTER)"),
    ({"target_modules": ["q_proj", "input_layernorm"]}, ["--lora", "one=ADAPTER"],
     "Error: the adapter's target modules input_layernorm are not layers of the base model a LoRA adapter can change "
     "(adapter one: ADAPTER)\nHint: use an adapter trained on this --model (its layers: down_proj, embed_tokens, "
     "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj)"),
    ('[{"r": 8}]', ["--lora", "one=ADAPTER"],
     "Error: adapter_config.json holds a JSON array, not an object (adapter one: ADAPTER/adapter_config.json)"),
    ('"LORA"', ["--lora", "one=ADAPTER"],
     "Error: adapter_config.json holds a JSON string, not an object (adapter one: ADAPTER/adapter_config.json)"),
    ("{r: 8", ["--lora", "one=ADAPTER"],
     "Error: adapter_config.json is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1) (adapter one: ADAPTER/adapter_config.json)"),
    ({"peft_type": "PREFIX_TUNING"}, ["--lora", "one=ADAPTER"],
     "Error: the adapter is a PREFIX_TUNING adapter (peft_type); vLLM runs LoRA adapters only "
     "(adapter one: ADAPTER/adapter_config.json)"),
    ({"target_modules": 7}, ["--lora", "one=ADAPTER"],
     "Error: adapter_config.json's target_modules must be a list of module names or a regular expression, got 7 "
     "(adapter one: ADAPTER/adapter_config.json)"),
    ({"lora_alpha": None}, ["--lora", "one=ADAPTER"],
     "Error: adapter_config.json has no lora_alpha (it is None) (adapter one: ADAPTER/adapter_config.json)"),
    ({"use_dora": True}, ["--lora", "one=ADAPTER"],
     "Error: the adapter uses DoRA (use_dora), which vLLM does not run (adapter one: ADAPTER/adapter_config.json)"),
    ({"init_lora_weights": "pissa"}, ["--lora", "one=ADAPTER"],
     "Error: the adapter uses init_lora_weights 'pissa' (it changes the base model's weights), which vLLM does not "
     "run (adapter one: ADAPTER/adapter_config.json)"),
    ({"rank_pattern": {"q_proj": 16}}, ["--lora", "one=ADAPTER", "--max-lora-rank", "8"],
     "Error: the adapter's rank 16 is above --max-lora-rank (8) (adapter one: ADAPTER)"),
    (None, ["--lora", "one=x", "--max-lora-rank", "12"],
     "Error: max_lora_rank must be one of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, 512; got 12"),
    (None, ["--max-loras", "2"], "Error: --max-loras, --max-lora-rank and --max-cpu-loras size vLLM's LoRA adapters; "
                                 "the job has none"),
])
def test_bad_adapters_are_refused_before_any_engine_starts(run_null_short, bundled_model, write_jsonl, tmp_path, make,
                                                           flags, message):
    folder = tmp_path / "adapter"
    if make == "empty":
        folder.mkdir()
    elif make is not None:
        write_random_adapter(folder, bundled_model, rank=8)
    message = message.replace("ADAPTER", str(folder))
    if make == "targets":
        make = {"target_modules": ["q_proj", "nonexistent_proj"]}
    if isinstance(make, dict):  # the config with these keys changed
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **make}))
    elif make not in (None, "empty", "rank8"):  # the config's text
        (folder / "adapter_config.json").write_text(make)
    flags = [flag.replace("ADAPTER", str(folder)) for flag in flags]
    result = run_null_short(write_jsonl([{"id": "a", "prompt": "hi"}]), "-o", tmp_path / "out", *flags)
    assert result.exit_code == EXIT_USAGE, result.output
    assert message in result.output
    assert "Hint: " in result.output and "Traceback" not in result.output


def _break_weights(folder, how: str) -> None:
    """Rewrite the adapter's weights (written by the safetensors package) so that they no longer match its config."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    q_a, q_b = (f"base_model.model.model.layers.0.self_attn.q_proj.lora_{side}.weight" for side in "AB")
    if how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"PK\x03\x04 a zip, not safetensors at all")
    elif how == "cut":
        path.write_bytes(path.read_bytes()[:100])
    elif how == "missing":
        path.unlink()
    elif how == "rank":  # rank 4 weights, r = 8 in the config
        save_file({k: (v[:4] if ".lora_A." in k else v[:, :4]).copy() for k, v in tensors.items()}, str(path))
    elif how == "untargeted":  # k_proj weights; the config targets q_proj and v_proj
        k_a, k_b = (key.replace("q_proj", "k_proj") for key in (q_a, q_b))
        save_file({**tensors, k_a: tensors[q_a], k_b: tensors[q_b][:192]}, str(path))
    elif how == "dtype":
        save_file({k: v.astype(np.int8) for k, v in tensors.items()}, str(path))
    elif how == "other_model":  # trained on a model of another width
        save_file({**tensors, q_a: np.zeros((8, 100), np.float32)}, str(path))
    elif how == "unpaired":
        save_file({k: v for k, v in tensors.items() if k != q_b}, str(path))
    elif how == "not_lora":
        save_file({**tensors, "base_model.model.model.layers.0.self_attn.q_proj.weight": tensors[q_b]}, str(path))


@pytest.mark.parametrize(("how", "problem"), [
    ("empty", "adapter_model.safetensors cannot be read: it is empty (0 bytes); save the adapter again "
              "(PEFT's save_pretrained)"),
    ("garbage", "adapter_model.safetensors cannot be read: its header says "),
    ("cut", "adapter_model.safetensors cannot be read: its header says "),
    ("missing", "the folder has no weights (adapter_model.safetensors, adapter_model.bin, adapter_model.pt); pass the "
                "folder PEFT's save_pretrained wrote"),
    ("rank", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has rank 4 (shape [4, 576]) but "
             "adapter_config.json says r = 8; save the adapter again, or set r to its weights' rank"),
    ("untargeted", "the weights hold modules adapter_config.json's target_modules does not name: k_proj; save the "
                   "adapter again (PEFT's save_pretrained), or list them in target_modules"),
    ("dtype", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight is I8; LoRA weights are floating point "
              "(F16, BF16, F32, F64): save the adapter in one of them"),
    ("other_model", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape [8, 100] but the base "
                    "model's model.layers.0.self_attn.q_proj takes 576 inputs; use an adapter trained on this --model"),
    ("unpaired", "model.layers.0.self_attn.q_proj has lora_A only, not both lora_A and lora_B"),
    ("not_lora", "adapter_model.safetensors holds base_model.model.model.layers.0.self_attn.q_proj.weight, which is "
                 "not a LoRA weight"),
])
def test_an_adapter_whose_weights_do_not_match_fails_its_own_rows(run_null_short, adapters, write_jsonl, tmp_path,
                                                                   bundled_model, how, problem):
    bad = write_random_adapter(tmp_path / "adapters" / "bad", bundled_model, rank=8, seed=3)
    _break_weights(bad, how)
    rows = [{"id": "base", "prompt": "hi"}, {"id": "good", "prompt": "hi", "adapter": "one"},
            {"id": "bad", "prompt": "hi", "adapter": "bad"},
            {"custom_id": "bad-line", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "bad", "messages": [{"role": "user", "content": "hi"}]}}]
    out = tmp_path / "out"
    result = run_null_short(write_jsonl(rows), "-o", out, "--lora", f"one={adapters['one']}", "--lora", f"bad={bad}")
    assert result.exit_code == 0, result.output
    assert sorted(pl.read_parquet(out / "results.parquet")["id"]) == ["base", "good"]
    errors = pl.read_parquet(out / "errors.parquet").sort("id").to_dicts()
    assert [(e["id"], e["error"]) for e in errors] == [("bad", "bad_adapter"), ("bad-line", "bad_adapter")]
    assert errors[0]["message"].startswith(f"adapter bad ({bad}): {problem}"), errors[0]["message"]
    assert f"adapter bad ({bad}): " in result.output and "its rows fail (bad_adapter), the others run" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["fingerprint"]["settings"]["lora"]) == ["one"]  # the engines load the good one only


def test_only_unusable_adapters_leave_the_engine_without_lora(run_null_short, write_jsonl, tmp_path, bundled_model):
    bad = write_random_adapter(tmp_path / "bad", bundled_model, rank=8)
    _break_weights(bad, "empty")
    rows = [{"id": "base", "prompt": "hi"}, {"id": "bad", "prompt": "hi", "adapter": "bad"}]
    out = tmp_path / "out"
    result = run_null_short(write_jsonl(rows), "-o", out, "--lora", f"bad={bad}", "--max-loras", "2")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["base"]
    assert pl.read_parquet(out / "errors.parquet")["error"].to_list() == ["bad_adapter"]


def test_a_regular_expression_for_target_modules_runs_and_its_weights_are_checked(run_null_short, write_jsonl,
                                                                                 tmp_path, bundled_model):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    folders = {name: write_random_adapter(tmp_path / name, bundled_model, rank=8) for name in ("regex", "stray")}
    for folder in folders.values():  # vLLM goes by the weights' names, whatever the expression says
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "target_modules": r".*\.(q|v)_proj"}))
    stray = folders["stray"] / "adapter_model.safetensors"
    prefix = "base_model.model.model.layers.0.self_attn.nonexistent_proj"
    save_file({**load_file(stray), f"{prefix}.lora_A.weight": np.zeros((8, 576), np.float32),
               f"{prefix}.lora_B.weight": np.zeros((576, 8), np.float32)}, str(stray))
    rows = [{"id": "a", "prompt": "hi", "adapter": "regex"}, {"id": "b", "prompt": "hi", "adapter": "stray"}]
    out = tmp_path / "out"
    flags = [flag for name, folder in folders.items() for flag in ("--lora", f"{name}={folder}")]
    result = run_null_short(write_jsonl(rows), "-o", out, *flags)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a"]
    (error,) = pl.read_parquet(out / "errors.parquet").to_dicts()
    assert error["message"] == (f"adapter stray ({folders['stray']}): the weights hold modules the base model does not "
                                "have: nonexistent_proj; use an adapter trained on this --model")


@pytest.mark.parametrize(("row", "message"), [
    ({"adapter": "one", "lora": "two"}, "the row names two models: adapter names 'one', lora names 'two'; name one "
                                        "adapter (or none: the base model) in adapter"),
    ({"adapter": "one", "lora": "BASE"}, "the row names two models: adapter names 'one', lora names 'BASE'; name one "
                                         "adapter (or none: the base model) in adapter"),
    ({"custom_id": "x", "url": "/v1/chat/completions", "adapter": "one",
      "body": {"model": "two", "messages": [{"role": "user", "content": "hi"}]}},
     "the row names two models: body.model names 'two', adapter names 'one'; name one adapter (or none: the base "
     "model) in body.model"),
])
def test_a_row_naming_two_adapters_fails_with_both_names(run_null_short, adapters, write_jsonl, tmp_path,
                                                         bundled_model, row, message):
    row = {"id": "x", "prompt": "hi", **{k: (bundled_model if v == "BASE" else v) for k, v in row.items()}}
    message = message.replace("BASE", bundled_model)
    out = tmp_path / "out"
    rows = [row, {"id": "same", "prompt": "hi", "adapter": "one", "lora": "one"}]
    result = run_null_short(write_jsonl(rows), "-o", out, *lora_flags(adapters))
    assert result.exit_code == 0, result.output
    (error,) = pl.read_parquet(out / "errors.parquet").to_dicts()
    assert (error["id"], error["error"], error["message"]) == ("x", "bad_adapter", message)
    assert pl.read_parquet(out / "results.parquet")["adapter"].to_list() == ["one"]  # the same name twice is one


def test_an_adapter_vllm_cannot_load_fails_its_rows_not_the_engine():
    from qbatch.engines.lora import LoraRequests

    class Dead(Exception):
        pass

    class Engine:  # vLLM's LLMEngine.add_lora: the utility call's failure comes back as an Exception
        def __init__(self, fails):
            self.fails, self.loaded = fails, []

        def add_lora(self, request):
            if request.lora_name in self.fails:
                raise self.fails[request.lora_name]
            self.loaded.append(request.lora_name)

    loras = LoraRequests((("one", "/a/one"), ("bad", "/a/bad")))
    engine = Engine({"bad": Exception("Call to add_lora method failed: invalid load key, 'x'.\nmore")})
    loras.load(engine, (Dead,))
    assert engine.loaded == ["one"] and loras.get("one").lora_int_id == 2 and loras.get(None) is None
    with pytest.raises(ValueError, match=r"^adapter bad \(/a/bad\) did not load in vLLM: Call to add_lora method "
                                         r"failed: invalid load key, 'x'.$"):
        loras.get("bad")
    with pytest.raises(Dead):  # a dead engine is no adapter's fault: it stops the run
        LoraRequests((("one", "/a/one"),)).load(Engine({"one": Dead()}), (Dead,))


def test_a_changed_adapter_file_is_a_changed_setting(run_null_short, adapters, write_jsonl, tmp_path):
    path, out = write_jsonl([{"id": "a", "prompt": "hi", "adapter": "one"}]), tmp_path / "out"
    assert run_null_short(path, "-o", out, *lora_flags(adapters)).exit_code == 0
    assert run_null_short(path, "-o", out, *lora_flags(adapters)).exit_code == 0  # unchanged: resumes (nothing to do)
    config = adapters["one"] / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 8', '"lora_alpha": 16'))
    result = run_null_short(path, "-o", out, *lora_flags(adapters))
    assert result.exit_code == EXIT_MISMATCH, result.output
    assert "lora was {" in result.output


def test_a_job_files_lora_table_names_folders_relative_to_it(cli, bundled_model, adapters, write_jsonl, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'inputs = ["{write_jsonl([{"id": "a", "prompt": "hi", "adapter": "two"}]).name}"]\n'
                   f'output_dir = "out"\nmodel = "{bundled_model}"\nbackend = "null"\nmax_tokens = 4\n'
                   '[lora]\none = "adapters/one"\ntwo = "adapters/two"\n')
    result = cli("run", "--job", job, "--progress", "none")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(tmp_path / "out" / "results.parquet")["adapter"].to_list() == ["two"]


def test_vllm_settings_are_chosen_from_the_adapters(bundled_model, adapters):
    from qbatch.engines.lora import adapter_ids
    from qbatch.models.adapters import read_adapters
    from qbatch.plan import resolve
    from qbatch.plan.engine_args import llm_kwargs
    from qbatch.plan.machine import Machine, ModelFacts
    from qbatch.spec import EngineSpec, JobSpec

    job = JobSpec.from_flat({"model": bundled_model, "lora": {k: str(v) for k, v in adapters.items()}})
    facts = read_adapters(job.engine, bundled_model)
    assert [fact.problem for fact in facts] == [None, None]
    plan = resolve(job, Machine(ModelFacts(bundled_model, max_model_len=512), adapters=facts))
    spec = plan.spec.engine
    assert spec.max_lora_rank == 8 and plan.unusable_adapters == {}  # the largest rank, a rank vLLM takes
    assert plan.decision("max_lora_rank").reason == "the adapters' largest rank, rounded up to one vLLM takes"
    lora_keys = ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank")
    gpu = Machine(ModelFacts(bundled_model), platform="cuda", gpu_name="NVIDIA H200", gpu_capability=9)
    kwargs, why = llm_kwargs(spec, 512, gpu)
    assert {k: kwargs[k] for k in lora_keys} == {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 2, "max_lora_rank": 8}
    assert why["max_loras"] == "the job's adapters, at most 8 in a batch"
    cpu_kwargs, _ = llm_kwargs(spec, 512, Machine(ModelFacts(bundled_model), platform="cpu"))
    assert cpu_kwargs["max_loras"] == 3  # one empty slot more: vLLM's CPU ops decode base rows from it
    assert "enable_lora" not in llm_kwargs(EngineSpec(model=bundled_model), 512, gpu)[0]
    assert adapter_ids(adapters) == {"one": 1, "two": 2}


def test_a_window_keeps_an_adapters_rows_together_only_past_max_loras():
    from qbatch.jobs.chunking import by_adapter, order_groups
    from qbatch.records import Request

    def request(i: int, adapter: str | None) -> Request:
        return Request(str(i), 0, i, [1] * (10 + i), {"max_tokens": 4}, None, adapter=adapter)

    window = [request(i, [None, "a", "b", "c"][i % 4]) for i in range(8)]
    groups = order_groups(window, "longest-first-flat")
    assert by_adapter(groups, 3) == groups  # every adapter fits one batch: longest first as before
    grouped = [g[0] for g in by_adapter(groups, 2)]
    assert [r.adapter for r in grouped] == [None, None, "a", "a", "b", "b", "c", "c"]
    assert [r.row_index for r in grouped] == [4, 0, 5, 1, 6, 2, 7, 3]  # each adapter's rows longest first


def test_data_parallel_workers_get_each_rows_adapter():
    from qbatch.engines.base import Chunk
    from qbatch.engines.dispatch import slim
    from qbatch.records import Request

    chunk = Chunk(3, [Request("a", 0, 0, [1, 2], {"max_tokens": 4}, None, {"text": "x"}, "p", adapter="one")])
    (travelling,) = slim(chunk, 0).requests
    assert (travelling.adapter, travelling.extra, travelling.prompt) == ("one", {}, None)


def test_the_bench_variant_spreads_a_workloads_rows_over_random_adapters(bundled_model, tmp_path):
    from qbatch.bench.settings import BenchSettings, qbatch_spec

    path = tmp_path / "varied.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt": "hi", "max_tokens": 4}) + "\n" for i in range(6)))
    settings = BenchSettings(["varied"], ["qbatch"], {"model": bundled_model, "backend": "null"})
    spec = qbatch_spec(settings, path, tmp_path / "out", {"adapters": 4})
    assert sorted(spec.engine.lora) == ["adapter0", "adapter1", "adapter2", "adapter3"]
    rows = [json.loads(line) for line in open(spec.input.inputs[0])]
    assert [row["adapter"] for row in rows] == ["adapter0", "adapter1", "adapter2", "adapter3", "adapter0", "adapter1"]
    assert spec.output.output_dir.endswith("out-adapters4")


def test_a_session_picks_an_adapter_per_call_and_refuses_an_unknown_one(bundled_model, adapters):
    from qbatch import Session
    from qbatch.errors import SpecError

    with Session(bundled_model, backend="null", lora={name: str(folder) for name, folder in adapters.items()}) as session:
        result = session.run([{"prompt": "hi", "adapter": "one"}, {"prompt": "hi"}], max_tokens=4)
        assert result.results["adapter"].to_list() == ["one", None]
        assert len(session.generate(["hi"], adapter="two", max_tokens=4)) == 1
        with pytest.raises(SpecError, match="adapter='three' is not one of this session's LoRA adapters: one, two"):
            session.generate(["hi"], adapter="three")


def test_an_embedding_job_runs_the_base_model(bundled_model, adapters, caplog, write_jsonl):
    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    spec = JobSpec.from_flat({"model": bundled_model, "task": "embed", "backend": "null", "max_loras": 2,
                              "inputs": [str(write_jsonl([{"id": "a", "prompt": "hi"}]))],
                              "lora": {k: str(v) for k, v in adapters.items()}})
    plan = Job.setup(spec).plan
    assert (plan.spec.engine.lora, plan.spec.engine.max_loras) == (None, None)
    assert plan.decision("lora").reason == "an embedding job runs the base model"
    assert "an embedding job runs the base model: lora ignored" in caplog.text
