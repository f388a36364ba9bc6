"""`qbatch bench`: synthetic workloads (fast) and a small side-by-side run on the real engine (slow)."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from qbatch.bench.workloads import WORKLOADS, make_workload, sample_lengths, sample_rows
from qbatch.errors import EXIT_USAGE


def test_uniform_lengths_are_fixed():
    assert set(sample_lengths("uniform", 50)) == {(512, 256)}


def test_varied_lengths_follow_the_issue_and_stay_in_bounds():
    lengths = sample_lengths("varied", 4096)
    prompts, outputs = [p for p, _ in lengths], [o for _, o in lengths]
    assert 270 <= statistics.mean(prompts) <= 330 and 16 <= min(prompts) and max(prompts) <= 2048
    assert 190 <= statistics.mean(outputs) <= 240 and 8 <= min(outputs) and max(outputs) <= 1024
    assert len(set(prompts)) > 500  # really varied


def test_short_lengths_are_classification_like():
    lengths = sample_lengths("short", 1000)
    assert all(150 <= p <= 250 and 1 <= o <= 8 for p, o in lengths)
    assert 190 <= statistics.mean(p for p, _ in lengths) <= 210


def test_small_is_a_notebook_job():
    """200 rows of ~190 prompt tokens and 256 output tokens: the job a warm Session serves."""
    rows = sample_lengths("small", 200)
    assert all(170 <= p <= 210 and o == 256 for p, o in rows)


def test_lengths_are_seeded_and_scaled():
    assert sample_lengths("varied", 20, seed=1) == sample_lengths("varied", 20, seed=1)
    assert sample_lengths("varied", 20, seed=1) != sample_lengths("varied", 20, seed=2)
    assert set(sample_lengths("uniform", 3, scale=0.25)) == {(128, 64)}
    assert all(o >= 1 for _, o in sample_lengths("short", 100, scale=0.01))


def test_issue_19_shapes_have_their_lengths_and_row_counts():
    prefill = sample_rows("prefill", 8192)
    assert len(prefill) == 8192 and {o for _, o in prefill} == {8}
    assert {segments[0] for segments, _ in prefill} == {("instruction", 370)}  # one instruction, first
    assert 440 <= statistics.mean(segments[1][1] for segments, _ in prefill) <= 460
    longgen = sample_lengths("longgen", 1024)
    assert all(130 <= p <= 180 and 64 <= o <= 2048 for p, o in longgen)
    assert 650 <= statistics.mean(o for _, o in longgen) <= 780 and len({o for _, o in longgen}) > 300
    for name, rows, doc_tokens, questions, output in (("docqa", 8000, 800, 8, 16), ("docqa-large", 16000, 1500, 4, 16),
                                                      ("docqa-shared", 9000, 1500, 6, 24)):
        docqa = sample_rows(name, rows)
        assert len(docqa) == rows and {o for _, o in docqa} == {output}
        docs = [segments[0] for segments, _ in docqa]
        assert len({key for key, _ in docs}) == rows // questions
        assert 0.95 * doc_tokens <= statistics.mean(length for _, length in set(docs)) <= 1.05 * doc_tokens
        assert all(15 <= segments[1][1] <= 25 for segments, _ in docqa)


def test_docqa_counts_are_exact_and_its_order_scattered_and_seeded():
    rows = sample_rows("docqa", 21)
    assert len(rows) == 21  # 3 documents: 8, 8 and 5 questions
    docs = [segments[0][0] for segments, _ in rows]
    assert sorted(docs.count(d) for d in set(docs)) == [5, 8, 8]
    runs = sum(a != b for a, b in itertools.pairwise(docs))
    assert runs > 5  # scattered, not grouped by document
    assert sample_rows("docqa", 21, seed=3) == sample_rows("docqa", 21, seed=3) != rows


def test_scaling_keeps_the_shared_prefixes():
    rows = sample_rows("docqa", 40, scale=0.01)
    assert all(length >= 1 for segments, _ in rows for _, length in segments)
    assert len({segments[0] for segments, _ in rows}) == 5  # still 5 documents of 8 rows
    assert {segments[0] for segments, _ in sample_rows("prefill", 10, scale=0.01)} == {("instruction", 4)}


@pytest.fixture(scope="module")
def tokenizer(bundled_model):
    from qbatch.tokens import load_tokenizer

    return load_tokenizer(bundled_model)


def test_issue_34_prefill_shapes_share_one_instruction_over_texts_of_their_lengths(tokenizer):
    for name, instruction, (mean, low, high), output in (("prefill-short", 80, (120, 20, 400), 4),
                                                         ("prefill-mix", 200, (700, 50, 4000), 8),
                                                         ("extract-json", 120, (600, 300, 900), 48)):
        rows = sample_rows(name, 4000)
        assert {segments[0] for segments, _ in rows} == {("instruction", instruction)} and {o for _, o in rows} == {output}
        texts = [segments[1][1] for segments, _ in rows]
        assert low <= min(texts) and max(texts) <= high and 0.85 * mean <= statistics.mean(texts) <= 1.15 * mean
    assert statistics.pstdev(segments[1][1] for segments, _ in sample_rows("prefill-mix", 4000)) > 400  # very mixed
    extract = make_workload("extract-json", tokenizer, 3, scale=0.1)
    assert extract.structured_outputs["json"]["required"] == ["customer", "amount", "refund"]
    assert make_workload("prefill-short", tokenizer, 3).structured_outputs is None


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_prompts_have_the_sampled_token_counts(tokenizer, name):
    workload = make_workload(name, tokenizer, 40, scale=0.5)
    expected = sample_lengths(name, 40, scale=0.5)
    lengths = [len(ids) for ids in workload.prompt_token_ids]
    floor = min(lengths)  # the chat template alone plus one word: the shortest possible prompt
    assert lengths == [max(p, floor) for p, _ in expected]
    assert workload.max_tokens == [o for _, o in expected]
    if workload.task == "generate":  # an embedding workload's texts go as they are (test_bench_embed.py)
        assert all(p.startswith("<|im_start|>") for p in workload.prompts)  # chat-templated, as qbatch sends them


def _common_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("scale", [1.0, 0.02])
def test_shared_segments_are_shared_token_prefixes(tokenizer, scale):
    """prefill's rows share the instruction's tokens, docqa's rows of one document the document's (after the
    chat template's head), in token ids: what vLLM's prefix cache can reuse."""
    prefill = make_workload("prefill", tokenizer, 6, scale=scale)
    document_tokens = sample_rows("prefill", 1, scale=scale)[0][0][1][1]
    instruction = prefill.texts[0].split(" ")[:-document_tokens]  # the template's tokens came off it
    assert all(text.startswith(" ".join(instruction) + " ") for text in prefill.texts)
    ids = prefill.prompt_token_ids
    shared = min(_common_prefix(ids[0], other) for other in ids[1:])
    assert shared >= len(instruction) and shared < min(map(len, ids))  # and the documents differ
    docqa = make_workload("docqa", tokenizer, 24, scale=scale)
    rows = sample_rows("docqa", 24, scale=scale)
    assert docqa.groups == [segments[0][0] for segments, _ in rows]
    for i, j in itertools.combinations(range(24), 2):
        prefix = _common_prefix(docqa.prompt_token_ids[i], docqa.prompt_token_ids[j])
        if docqa.groups[i] == docqa.groups[j]:
            document_words = len(docqa.texts[i].split(" ")) - rows[i][0][1][1]
            assert prefix >= document_words + 1  # the template's head, then the whole document
        else:
            assert prefix < 40  # the template's head only
    assert make_workload("docqa", tokenizer, 24, scale=scale).prompt_token_ids == docqa.prompt_token_ids


def test_qbatch_tokenizes_the_jsonl_exactly_like_the_raw_modes(tokenizer, bundled_model, tmp_path):
    """`qbatch` and `vllm-tokens` must see the same token ids, or the comparison is void."""
    from qbatch.jobs.job import Job
    from qbatch.tokens import encode_prompts
    from qbatch.spec import JobSpec

    workload = make_workload("varied", tokenizer, 30, scale=0.2)
    path = workload.write_jsonl(tmp_path / "varied.jsonl")
    spec = JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "ignore_eos": True})
    job = Job.setup(spec)
    requests = [r for item in job.work(set()) for r in item]
    encode_prompts(requests, job.preparer.encoder)  # what the engines do with rows that travel as text
    by_id = {r.id: r for r in requests}
    assert len(by_id) == 30
    for i, (ids, max_tokens) in enumerate(zip(workload.prompt_token_ids, workload.max_tokens, strict=True)):
        request = by_id[f"varied-{i}"]
        assert request.prompt_token_ids == ids
        assert request.sampling["max_tokens"] == max_tokens and request.sampling["ignore_eos"] is True


def test_null_engine_pipeline_bench_reports_speed_and_memory(cli, bundled_model, tmp_path):
    out = tmp_path / "bench.json"
    result = cli("bench", "--null-engine", "--model", bundled_model, "--rows", 500, "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    r = report["results"]
    assert report["kind"] == "pipeline" and r["rows"] == 500
    assert r["pipeline_rows_per_s"] > 0 and r["rss_peak_mb"] >= r["rss_start_mb"] > 0
    assert r["tokenize_rendered_rows_per_s"] > 0 and r["vs_tokenize_rendered"] > 0
    assert "null-engine pipeline, 500 rows" in result.output


def test_inputs_only_writes_the_workload_files(cli, bundled_model, tmp_path):
    result = cli("bench", "varied", "short", "--model", bundled_model, "--rows", 5, "--inputs-only",
                 "--work-dir", tmp_path)
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "varied.jsonl").read_text().splitlines()
    assert len(lines) == 5 and set(json.loads(lines[0])) == {"id", "prompt", "max_tokens"}
    assert (tmp_path / "short.jsonl").is_file() and not (tmp_path / "uniform.jsonl").exists()


def test_every_workload_has_a_default_row_count():
    from qbatch.bench.settings import DEFAULT_ROWS
    from qbatch.bench.workloads import EMBED_WORKLOADS, WORKLOADS

    assert set(WORKLOADS) | set(EMBED_WORKLOADS) <= set(DEFAULT_ROWS)  # --rows may be left out for any of them


def test_unknown_mode_names_the_valid_ones(cli, bundled_model):
    result = cli("bench", "--model", bundled_model, "--modes", "vllm-tokens,sglang")
    assert result.exit_code == EXIT_USAGE
    assert ("mode must be one of vllm-text, vllm-tokens, qbatch, session, hf, vllm-best, vllm-grouped, first-run; "
            "got 'sglang'") in result.output


def test_bench_settings_are_checked_before_the_model_loads():
    from qbatch.bench.settings import BenchSettings
    from qbatch.errors import SpecError

    BenchSettings(["docqa", "prefill"], ["vllm-best", "vllm-grouped", "qbatch", "first-run"]).validate()
    with pytest.raises(SpecError, match="the vllm-grouped mode sorts rows by document: it needs a workload with "
                                        "documents \\(docqa, docqa-large, docqa-shared\\); got prefill, longgen"):
        BenchSettings(["prefill", "longgen"], ["vllm-best", "vllm-grouped"]).validate()
    with pytest.raises(SpecError, match="workload must be one of"):
        BenchSettings(["docqa-huge"]).validate()
    for bad in ({"repeats": 0}, {"rows": 0}, {"length_scale": 0}):
        with pytest.raises(SpecError, match="--rows, --hf-rows and --repeats must be >= 1"):
            BenchSettings(["docqa"], **bad).validate()


def test_a_variant_of_other_engine_settings_gets_engines_of_its_own(bundled_model, tmp_path):
    """A qbatch run shares the raw modes' engine only with its settings: a --variant that changes the
    engine (torch.compile, max_num_seqs) would otherwise start a second engine inside its timing."""
    from qbatch.bench.harness import on_shared_engine
    from qbatch.bench.settings import BenchSettings, qbatch_spec
    from qbatch.engines.pool import EnginePool
    from qbatch.jobs.job import Job

    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    settings = BenchSettings(["varied"], ["vllm-tokens", "qbatch"], run_settings={"model": bundled_model})
    shared = Job.setup(qbatch_spec(settings, path, tmp_path / "out", shared=True)).plan.engine
    pool = EnginePool()
    assert on_shared_engine(qbatch_spec(settings, path, tmp_path / "out"), shared, pool)  # a CPU: one engine
    assert on_shared_engine(qbatch_spec(settings, path, tmp_path / "out", {"order": "longest-first-flat"}), shared,
                            pool)
    for variant in ({"compilation_mode": 3, "engines_per_gpu": 1}, {"max_num_seqs": 64}):
        assert not on_shared_engine(qbatch_spec(settings, path, tmp_path / "out", variant), shared, pool)


def test_the_qbatch_mode_gets_the_engines_the_jobs_shape_chooses(bundled_model, tmp_path, monkeypatch):
    """On a GPU the bench starts a qbatch run's engines as the run itself would choose them (plan/shape.py):
    a long prefill-bound workload with a warm compile cache gets its two engines compiled, not the
    uncompiled defaults that its run would then have found running and kept."""
    import dataclasses

    from qbatch.bench.harness import resolved_job
    from qbatch.bench.settings import BenchSettings, qbatch_spec
    from qbatch.engines import compile_cache
    from qbatch.engines.pool import EnginePool
    from qbatch.jobs.job import Job
    from qbatch.models.ready import ready_model
    from qbatch.plan import placement, probe

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.setattr(placement, "WARM_COMPILE_REPAID_TOKENS", 10_000)
    path = tmp_path / "prefill.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt": "lorem ipsum " * 300, "max_tokens": 8}) + "\n"
                            for i in range(40)))
    settings = BenchSettings(["prefill"], ["qbatch"], run_settings={"model": bundled_model})
    spec = qbatch_spec(settings, path, tmp_path / "out")
    h200 = dataclasses.replace(probe(spec, ready_model(spec)), platform="cuda", gpu_capability=9,
                               gpu_memory_bytes=141 << 30, gpu_count=1, num_cores=16)  # an H200, 16 cores
    job = Job.setup(spec, h200)
    default = job.spec.engine
    assert (default.engines_per_gpu, default.compilation_mode) == (2, None)
    # a cold compile cache: too short to repay a first compile
    assert resolved_job(spec, EnginePool(), h200).spec.engine == default
    compile_cache.note_compiled(compile_cache.marker_settings(default.one_engine(compilation_mode=placement.TORCH_COMPILE),
                                                              job.model_path, job.max_model_len,
                                                              compile_cache.vllm_version()))
    warm = dataclasses.replace(h200, warm_compiles=compile_cache.warm_markers())
    chosen = resolved_job(spec, EnginePool(), warm).spec.engine
    assert (chosen.engines_per_gpu, chosen.compilation_mode) == (2, placement.TORCH_COMPILE)


def test_first_run_times_the_engine_start_and_keeps_every_run(cli, bundled_model, tmp_path):
    """first-run starts its engines inside the timing (here the null engine: the plumbing, fast); --json keeps
    each repeat, the table says both throughputs."""
    out = tmp_path / "bench.json"
    result = cli("bench", "docqa", "--model", bundled_model, "-s", "backend=null", "--modes", "first-run",
                 "--rows", 12, "--length-scale", 0.02, "--repeats", 2, "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    [row] = report["results"]
    assert row["mode"] == "first-run" and row["rows"] == 12 and len(row["notes"]["wall_s_runs"]) == 2
    assert {"engine_start_s", "generate_s", "generate_output_tok_s"} <= set(row["notes"])
    assert [(r["mode"], r["notes"]["repeat"]) for r in report["runs"]] == [("first-run", 0), ("first-run", 1)]
    assert report["engines"]["first-run"]["settings"]["engines"] == 1 and "repeat" not in row["notes"]
    assert report["engines"]["first-run"]["start_s"]["docqa"] == row["notes"]["engine_start_s"]
    assert "docqa first-run: engines started in" in result.output and "over generation" in result.output


def test_a_bench_cut_short_keeps_the_runs_that_finished(cli, bundled_model, tmp_path, monkeypatch):
    """A lease's time limit (SIGTERM) stops a long bench: --json still gets every run that finished, marked
    interrupted, so the lines it printed are not all that is left."""
    import signal

    from qbatch.bench import harness
    from qbatch.errors import Interrupted

    run_qbatch, calls = harness._run_qbatch, []

    def second_run_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Interrupted(signal.SIGTERM)
        return run_qbatch(*args, **kwargs)

    monkeypatch.setattr(harness, "_run_qbatch", second_run_interrupted)
    out = tmp_path / "bench.json"
    result = cli("bench", "docqa", "--model", bundled_model, "-s", "backend=null", "--modes", "first-run",
                 "--rows", 12, "--length-scale", 0.02, "--repeats", 3, "--json", out)
    assert result.exit_code != 0
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and report["command"].startswith("qbatch ")
    assert [(r["mode"], r["notes"]["repeat"]) for r in report["runs"]] == [("first-run", 0)]
    assert "interrupted: the 1 runs that finished are in" in result.output


def test_the_end_to_end_script_writes_the_benchs_own_rows(bundled_model, tmp_path, capsys):
    """benchmarks/cold_small.py workload: the rows `qbatch bench` times, as the JSONL both sides of an
    end-to-end comparison read (the raw script's and `qbatch run`'s)."""
    from transformers import AutoTokenizer

    from qbatch.bench.workloads import make_workload

    script = _load_benchmark_script("cold_small")
    script.workload("prefill-mix", str(tmp_path / "w.jsonl"), bundled_model, "24")
    rows = [json.loads(line) for line in (tmp_path / "w.jsonl").read_text().splitlines()]
    bench = make_workload("prefill-mix", AutoTokenizer.from_pretrained(bundled_model), 24)
    assert [r["prompt"] for r in rows] == bench.texts and [r["max_tokens"] for r in rows] == bench.max_tokens
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == bench.num_prompt_tokens


def test_the_kernel_profile_groups_the_kernels_an_h200_ran():
    """benchmarks/kernel_profile.py: kernel names as torch's profiler gave them on the H200 (vLLM 0.26),
    uncompiled and compiled, in the families docs/benchmarks.md reports."""
    family = _load_benchmark_script("kernel_profile").family
    names = {
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::Collective": "attention",
        "void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>, cute::C<128> >, 5": "attention",
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>": "attention",
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "gemm",
        "void vllm::rms_norm_kernel<c10::BFloat16, 8, 3, true>(c10::BFloat16*, c10::BFloat16 const*, long": "norm",
        "triton_per_fused_fused_add_rms_norm_2": "norm",
        "void vllm::rotary_embedding_kernel<c10::BFloat16, c10::BFloat16, true>(long const*, c10::BFloat16*": "rope",
        "void vllm::act_and_mul_kernel<c10::BFloat16, __nv_bfloat162, &(c10::BFloat16 vllm::silu_kernel": "activation",
        "triton_poi_fused_mul_silu_slice_1": "activation",
        "_gumbel_sample_kernel": "sampling",
        "triton_poi_fused_4": "other",
    }
    assert {name: family(name) for name in names} == names


def test_the_step_profile_reads_vllms_lines_between_a_runs_marks():
    """benchmarks/steps.py on lines as vLLM 0.26 (GPU) and 0.32 (CPU, from an engine process) write them:
    a run's steps are those logged between its marks, other engines' warm-up steps are not."""
    steps = _load_benchmark_script("steps")
    line = ("{prefix}INFO 12-03 00:04:02 [loggers.py:199] Engine 000: Iteration({i}): {c} context requests, {ct} context "
            "tokens, {g} generation requests, {g} generation tokens, iteration elapsed time: 40.12 ms, GPU KV cache usage: 0.1%")
    log = [line.format(prefix="", i=0, c=1, ct=8, g=0),  # a warm-up, before any run
           "qbatch-bench: start prefill vllm-best",
           line.format(prefix="", i=1, c=36, ct=32768, g=0), line.format(prefix="", i=2, c=3, ct=9000, g=36),
           line.format(prefix="", i=3, c=0, ct=0, g=39),
           "qbatch-bench: end prefill vllm-best",
           "qbatch-bench: start prefill qbatch engines_per_gpu=1",
           line.format(prefix="(MainProcess pid=13612) ", i=7, c=2, ct=100, g=5),
           "qbatch-bench: end prefill qbatch engines_per_gpu=1"]
    first, second = steps.runs(log)
    assert (first.name, second.name) == ("prefill vllm-best", "prefill qbatch engines_per_gpu=1")
    assert [(s.ctx_tokens, s.gen_tokens) for s in first.steps] == [(32768, 0), (9000, 36), (0, 39)]
    assert "3 steps (2 with prefill), 41,843 tokens (41,768 prefill, 75 decode)" in steps.describe(first)
    assert "steps of 24,576 or more tokens: 1, 32,768 tokens" in steps.describe(first)
    assert len(second.steps) == 1


def test_the_gpu_busy_report_averages_the_samples_inside_each_marked_run(tmp_path, monkeypatch):
    """benchmarks/gpu_busy.py: the bench's marks carry the wall clock (steps.py still reads the run's name
    alone), and each run gets the NVML samples taken between its marks, none of the others'."""
    from qbatch.bench import harness
    from qbatch.engines import vllm_output

    log = tmp_path / "engine.log"
    monkeypatch.setattr(vllm_output, "current", lambda: log)
    clock = iter([100.0, 102.0, 103.0, 104.0])
    monkeypatch.setattr(harness.time, "time", lambda: next(clock))
    for workload, mode in (("prefill", "vllm-best"), ("prefill", "qbatch compilation_mode=3")):
        with harness._marked(workload, mode):
            pass
    samples = tmp_path / "gpu.tsv"
    samples.write_text("99.5\t0\t1980\t100\n100.5\t90\t1900\t600\n101.5\t100\t1800\t650\n102.5\t7\t1980\t90\n"
                       "103.5\t50\t1980\t400\n")
    assert _load_benchmark_script("gpu_busy").report(str(samples), str(log)) == [
        "prefill vllm-best: 2.00 s, GPU busy 95.0% (median 95, 2 samples), SM clock 1850 MHz, 625 W",
        "prefill qbatch compilation_mode=3: 1.00 s, GPU busy 50.0% (median 50, 1 samples), SM clock 1980 MHz, 400 W"]
    assert _load_benchmark_script("gpu_busy").report(str(samples), str(log), timeline=True)[1] == "  every 0.2 s: 90"
    assert [run.name for run in _load_benchmark_script("steps").runs(log.read_text().splitlines())] == [
        "prefill vllm-best", "prefill qbatch compilation_mode=3"]


def test_table_compares_with_vllm_best_when_it_ran():
    from qbatch.bench.harness import format_table

    def row(mode, tok_s, **ratios):
        return {"workload": "docqa", "mode": mode, "rows": 8, "wall_s": 1.0, "rows_per_s": 8.0, "output_tok_s": tok_s,
                "total_tok_s": tok_s * 10, "notes": {}, **ratios}

    table = format_table({"kind": "engines", "results": [row("vllm-best", 100.0, vs_vllm_best=1.0),
                                                         row("qbatch", 150.0, vs_vllm_best=1.5)]})
    head, best, qbatch = table.splitlines()
    assert "vs vllm-best" in head and "vs vllm-tokens" not in head  # only the baselines that ran
    assert best.split()[:2] == ["docqa", "vllm-best"] and qbatch.rstrip().endswith("1.500x")


def test_checks_that_resolve_a_runs_engines_say_nothing_so_each_choice_is_logged_once(monkeypatch):
    """The bench resolves a run's engines to see whether it shares the bench's engine and how many it
    starts; only the start says `engines: ...` (the H200's stderr had each choice two or three times)."""
    import logging
    import threading
    from types import SimpleNamespace

    from qbatch.bench import harness
    from qbatch.log import log

    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    engine = SimpleNamespace(engine_count=lambda: 2)

    def resolved(spec, pool, machine=None):
        log.warning("engines: two, from the check")
        other = threading.Thread(target=log.warning, args=("engine worker 1 ready",))  # another thread's line
        other.start()
        other.join()
        return SimpleNamespace(plan=SimpleNamespace(engine=engine))

    monkeypatch.setattr(harness, "resolved_job", resolved)
    log.addHandler(handler)
    try:
        assert harness.on_shared_engine("spec", engine, "pool") and harness._engine_processes("spec", "pool") == 2
        log.warning("engines: two, at the start")
    finally:
        log.removeHandler(handler)
    assert heard == ["engine worker 1 ready", "engine worker 1 ready", "engines: two, at the start"]


def test_the_table_ends_with_its_host_and_the_report_records_how_fast_the_host_runs_python(monkeypatch):
    """Two H200 leases whose CPUs read alike ran raw vLLM's decode at 27k and 39k tok/s: the report says which
    CPU (family and model, which a VM's name hides) and how fast it ran a fixed Python loop."""
    from qbatch.bench import settings
    from qbatch.bench.harness import format_table

    hardware = settings.environment()["hardware"]
    assert hardware["python_msteps_s"] > 0 and hardware["cores"] >= 1
    assert hardware["cpu_model"].startswith("family ")  # Linux: /proc/cpuinfo
    monkeypatch.setattr(settings, "_steps", lambda n: __import__("time").sleep(0.01))  # 300,000 steps in 10 ms
    assert 20 < settings.python_speed() <= 30.0  # ...read as 30M steps a second, a little less with sleep's delay
    hardware = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_model": "family 6 model 207 stepping 2", "cores": 16,
                "python_msteps_s": 21.5, "gpu": "NVIDIA H200", "gpu_count": 1}
    table = format_table({"kind": "engines", "results": [], "hardware": hardware})
    assert table.splitlines()[-1] == ("host: Intel(R) Xeon(R) Processor (family 6 model 207 stepping 2), 16 cores, "
                                      "1 x NVIDIA H200; Python 21.5M loop steps/s")


def test_between_engines_the_bench_never_asks_torch_about_cuda(monkeypatch):
    """torch.cuda.is_available() or device_count() leaves CUDA uninitialised but marks the process's later
    forks as unable to use it: vLLM then forks the engine core of a one-engine-per-GPU run, which dies
    at its start (a first-run bench on the H200 did). Freeing memory between engines and reading the
    hardware for the report ask nvidia-smi and torch.cuda.is_initialized() instead."""
    import torch

    from qbatch.bench.harness import _free_torch_memory
    from qbatch.bench.settings import environment

    asked: list[str] = []
    for name in ("is_available", "device_count", "get_device_name", "init"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, _name=name: asked.append(_name))
    _free_torch_memory()
    environment()
    assert asked == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_every_mode_does_the_same_work(cli, tiny_qwen3, tmp_path):
    """The benchmark never rots: every mode runs on the tiny Qwen3 and generates exactly the forced tokens.
    Each timed run is marked in the engine log (benchmarks/steps.py reads vLLM's per-step lines between)."""
    out = tmp_path / "bench.json"
    result = cli("bench", "varied", "--model", tiny_qwen3, "--rows", 6, "--length-scale", 0.05, "--hf-rows", 2,
                 "--modes", "vllm-text,vllm-tokens,qbatch,session,hf", "--variant", "max_num_seqs=4", "--repeats", 2,
                 "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"hf", "vllm-text", "vllm-tokens", "qbatch", "session", "qbatch max_num_seqs=4"}
    expected = report["workloads"]["varied"]
    for mode in ("vllm-tokens", "qbatch", "session", "qbatch max_num_seqs=4"):
        assert rows[mode]["rows"] == 6
        assert rows[mode]["output_tokens"] == expected["output_tokens"]  # ignore_eos + per-row max_tokens
        assert rows[mode]["prompt_tokens"] == expected["prompt_tokens"]  # the same prompts
    assert rows["vllm-text"]["output_tokens"] == expected["output_tokens"]
    assert rows["vllm-tokens"]["vs_vllm_tokens"] == 1.0
    assert rows["qbatch"]["notes"]["engine_start_s"] < 1  # the engine was reused, not started again
    assert rows["session"]["notes"]["engine_start_s"] < 1  # the Session found the same warm engine
    assert 0 < rows["session"]["notes"]["overhead_s"] < rows["session"]["wall_s"]
    # other engine settings: an engine of its own, started after the shared one had gone and before the
    # timing (two engines per GPU take the same path: test_vllm_defaults_..., dispatch's wait_started)
    own = rows["qbatch max_num_seqs=4"]["notes"]
    assert own["engines"] == 1 and own["engine_start_s"] < 1 and own["own_engines_start_s"] > 1
    assert own["engine_settings"]["max_num_seqs"] == 4
    assert rows["hf"]["rows"] == 2
    assert len(rows["qbatch"]["notes"]["wall_s_runs"]) == 2  # two runs, in alternating order
    assert "vs vllm-tokens" in result.output
    runs = " ".join(f"{w:.2f}" for w in rows["qbatch"]["notes"]["wall_s_runs"])
    assert any(line.startswith("varied") and line.endswith(runs) for line in result.output.splitlines())
    steps = _load_benchmark_script("steps")
    marked = steps.runs((tmp_path / "bench.engine.log").read_text().splitlines())
    assert sorted(run.name for run in marked) == sorted(f"varied {mode}" for mode in rows if mode != "hf" for _ in range(2))


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(300)
def test_vllm_defaults_against_qbatch_on_its_own_engine(cli, tiny_qwen3, tmp_path):
    """The headline comparison in one command: raw vLLM on its defaults, qbatch on its own engine and settings."""
    out = tmp_path / "bench.json"
    result = cli("bench", "varied", "--model", tiny_qwen3, "--rows", 4, "--length-scale", 0.05,
                 "--modes", "vllm-text,qbatch", "--vllm-defaults", "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert report["engine"]["settings"]["vllm_defaults"] is True
    expected = report["workloads"]["varied"]["output_tokens"]
    assert rows["vllm-text"]["output_tokens"] == rows["qbatch"]["output_tokens"] == expected
    # not the defaults engine: one of qbatch's own, started after that one had gone and before the timing
    # (here possibly an engine an earlier test left in the suite's shared pool)
    assert "own_engines_start_s" in rows["qbatch"]["notes"] and rows["qbatch"]["notes"]["engine_start_s"] < 1
    assert rows["qbatch"]["vs_vllm_tokens"] is None
    assert rows["qbatch"]["vs_vllm_text"] == round(rows["qbatch"]["output_tok_s"] / rows["vllm-text"]["output_tok_s"], 3)
    assert "vs vllm-text" in result.output


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(300)
def test_docqa_raw_best_grouped_and_qbatch_through_the_cli(cli, tiny_qwen3, tmp_path):
    """Issue #19's table in one command: vllm-best on its own engine (closed before qbatch's), the same engine
    fed the rows grouped by document, and qbatch; ratios against vllm-best; every run in the JSON."""
    out = tmp_path / "bench.json"
    result = cli("bench", "docqa", "--model", tiny_qwen3, "--rows", 16, "--length-scale", 0.05,
                 "--modes", "vllm-best,vllm-grouped,qbatch", "--repeats", 2, "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert list(rows) == ["vllm-best", "vllm-grouped", "qbatch"]
    expected = report["workloads"]["docqa"]
    for row in rows.values():
        assert row["rows"] == 16 and row["output_tokens"] == expected["output_tokens"]
        assert row["prompt_tokens"] == expected["prompt_tokens"]
        assert len(row["notes"]["wall_s_runs"]) == 2
    assert rows["vllm-best"]["vs_vllm_best"] == 1.0
    assert rows["qbatch"]["vs_vllm_best"] == round(rows["qbatch"]["output_tok_s"] / rows["vllm-best"]["output_tok_s"], 3)
    best = report["engines"]["vllm-best"]
    assert best["start_s"] > 0 and best["settings"]["raw_best"] is True
    assert report["engines"]["shared"]["settings"]["vllm_defaults"] is False
    # alternating order: best, grouped, then grouped, best
    assert [(r["mode"], r["notes"]["repeat"]) for r in report["runs"][:4]] == [
        ("vllm-best", 0), ("vllm-grouped", 0), ("vllm-grouped", 1), ("vllm-best", 1)]
    assert len(report["runs"]) == 6 and {r["notes"]["engine"] for r in report["runs"][:4]} == {"vllm-best"}
    assert "vs vllm-best" in result.output and "vs vllm-tokens" not in result.output


def test_random_adapters_of_a_model_folder_without_weights_take_their_shapes_from_its_config(bundled_model, tmp_path):
    """The GPU bench runs a dummy-weights model (config and tokenizer only): its adapters' shapes come from
    config.json, the same shapes the weights' headers give where there are weights."""
    import shutil

    from qbatch.bench.adapters import _config_shapes, _weight_shapes, write_random_adapter

    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert _config_shapes(Path(bundled_model), targets) == _weight_shapes(Path(bundled_model), targets)
    bare = tmp_path / "dummy"
    bare.mkdir()
    shutil.copy(Path(bundled_model) / "config.json", bare)
    adapter = write_random_adapter(tmp_path / "adapter", str(bare), rank=4)
    assert (adapter / "adapter_model.safetensors").is_file()


def _load_benchmark_script(name: str):
    """A script of benchmarks/ as a module (registered: its dataclasses look their module up)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
