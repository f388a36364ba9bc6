"""Issue #52 on a GPU: qbatch's answers against vLLM's own, and JSON-schema rows with the constraint in force.

    python benchmarks/answers_gpu.py DUMMY_MODEL_DIR WORK_DIR [PROMPTS_JSONL] [--rows N] [--reuse-vllm] [--model-only]

1. A Qwen3-0.6B of real random weights (transformers' init, seed 0): vLLM's dummy loader fills each
   model class's parameters its own way, so qbatch's fused Qwen3 class and vLLM's own would not even
   hold the same weights.
2. Two processes, one after the other (one GPU), each with one warm engine set running every workload:
   vLLM's own `LLM` at vLLM's defaults (its Qwen3 class, one engine; `LLM.chat`/`LLM.generate`), and a
   `qbatch.Session` at qbatch's defaults (its fused class, two engines a GPU under MPS, compiled).
   Equivalence, greedy: MT-bench turns, chat template thinking off, and raw prompts: the share of
   rows whose text is equal; the control is vLLM against itself with the rows in reverse order
   (another batch composition: bf16 results depend on it).
3. JSON extraction (~300-600 words of text in, a small object out): qbatch's JSON-schema rows against
   the same rows unconstrained and against vLLM's constrained rows (output tok/s over each side's
   generate time, warm against warm); the share of rows finished by `stop` that parse and validate,
   raw and with the chat template (thinking off and on), and qbatch's flags.
Prints one JSON object (also WORK_DIR/answers.json). $ANSWERS_QBATCH_SETTINGS (JSON): the qbatch side's Session
settings, e.g. '{"compilation_mode": 3}' for the compiled model vLLM's defaults run. `--reuse-vllm` keeps
the vLLM side of an earlier run in WORK_DIR (vllm.json) and runs the qbatch side only; `--model-only` writes
WORK_DIR/qwen3-random (step 1) and stops, for other benchmarks to load real weights.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"customer": {"type": "string", "maxLength": 40},
                                           "amount": {"type": "number"}, "refund": {"type": "boolean"}},
          "required": ["customer", "amount", "refund"], "additionalProperties": False}
MAX_TOKENS = 48
# name: (rows key, chat or raw, thinking (None: the template's default), JSON schema)
WORKLOADS = {"eq-chat": ("turns", "chat", False, False), "eq-raw": ("turns", "raw", None, False),
             "json-free": ("docs", "raw", None, False), "json-raw": ("docs", "raw", None, True),
             "json-chat-off": ("docs512", "chat", False, True), "json-chat-on": ("docs512", "chat", None, True)}


def make_model(dummy: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "model.safetensors").exists():
        return
    config = AutoConfig.from_pretrained(dummy)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in os.listdir(dummy):
        if name != "config.json" and (dummy / name).is_file():
            shutil.copy(dummy / name, out / name)


def vllm_side(model: str, work: Path) -> dict:
    """vLLM's own LLM at its defaults: each workload's texts, finish reasons, tokens and generate time."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    rows = json.loads((work / "rows.json").read_text())
    import torch

    t0 = time.monotonic()
    # vLLM's defaults on a GPU; on the CPU (a smoke run of this script) a small KV cache
    llm = LLM(model=model) if torch.cuda.is_available() else LLM(model=model, kv_cache_memory_bytes=1 << 30)
    out: dict = {"start_s": time.monotonic() - t0}
    runs = [(name, False) for name in WORKLOADS] + [("eq-chat", True), ("eq-raw", True)]
    for name, reverse in runs:
        key, mode, thinking, schema = WORKLOADS[name]
        todo = rows[key][::-1] if reverse else rows[key]
        so = StructuredOutputsParams(json=json.dumps(SCHEMA)) if schema else None
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so)
        t0 = time.monotonic()
        if mode == "raw":
            got = llm.generate([r["prompt"] for r in todo], sp, use_tqdm=False)
        else:
            kw = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
            got = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in todo], sp, use_tqdm=False, **kw)
        wall = time.monotonic() - t0
        out[name + ("-reversed" if reverse else "")] = {
            "generate_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in got),
            "texts": {r["id"]: o.outputs[0].text for r, o in zip(todo, got)},
            "finish": {r["id"]: o.outputs[0].finish_reason for r, o in zip(todo, got)}}
    return out


def qbatch_side(model: str, work: Path) -> dict:
    """A qbatch.Session at qbatch's defaults (or with $ANSWERS_QBATCH_SETTINGS, a JSON object of Session
    settings, e.g. '{"compilation_mode": 3}'): each workload as one `session.run`."""
    import qbatch

    rows = json.loads((work / "rows.json").read_text())
    out: dict = {}
    with qbatch.Session(model=model, **json.loads(os.environ.get("ANSWERS_QBATCH_SETTINGS") or "{}")) as session:
        for name, (key, mode, thinking, schema) in WORKLOADS.items():
            settings: dict = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "progress": "none"}
            if mode == "raw":
                settings["raw"] = True
            if thinking is not None:
                settings["thinking"] = thinking
            if schema:
                settings["json_schema"] = json.dumps(SCHEMA)
            result = session.run(rows[key], **settings)
            df, s = result.results, result.summary
            out[name] = {"generate_s": s.generate_s, "output_tokens": s.completion_tokens, "wall_s": s.wall_s,
                         "engine_start_s": s.engine_start_s, "engine_choice": s.engine_choice, "flags": s.flags,
                         "texts": dict(zip(df["id"], df["text"])), "reasoning": dict(zip(df["id"], df["reasoning"])),
                         "finish": dict(zip(df["id"], df["finish_reason"]))}
    return out


def valid(text: str | None) -> bool:
    try:
        value = json.loads(text or "")
    except json.JSONDecodeError:
        return False
    types = {"customer": str, "amount": (int, float), "refund": bool}
    return (isinstance(value, dict) and set(value) == set(types) and isinstance(value["customer"], str)
            and len(value["customer"]) <= 40
            and all(isinstance(value[k], t) and not (t != bool and isinstance(value[k], bool)) for k, t in types.items()))


def share_valid(run: dict) -> list[int]:
    stopped = [rid for rid, why in run["finish"].items() if why == "stop"]
    return [sum(valid(run["texts"][rid]) for rid in stopped), len(stopped), len(run["finish"])]


def rows_of(prompts_file: Path | None, count: int) -> dict:
    turns = [t for line in prompts_file.read_text().splitlines() for t in json.loads(line)["turns"]] \
        if prompts_file else [f"Question {i}: explain topic {i}." for i in range(160)]
    eq = [{"id": f"r{i}", "prompt": turns[i % len(turns)] + ("" if i < len(turns) else f" (variant {i})")}
          for i in range(count)]
    rng = random.Random(0)
    words = " ".join(turns).split()
    docs = [{"id": f"j{i}", "prompt": "Extract the customer's name, the amount and whether a refund is asked, as JSON.\n\n"
             + " ".join(rng.choice(words) for _ in range(rng.randint(300, 600)))} for i in range(2 * count)]
    return {"turns": eq, "docs": docs, "docs512": docs[:count // 2]}


def run_side(side: str, model: Path, work: Path) -> dict:
    with open(work / f"{side}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--side", side, str(model), str(work)],
                                stdout=log, stderr=log, start_new_session=True)
        code = proc.wait()
    try:  # what the side's engine left running (its engine core) goes with it
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    gpu_free(work / f"{side}.log")
    if code:
        raise SystemExit(f"the {side} side exited {code}: see {work / (side + '.log')}")
    return json.loads((work / f"{side}.json").read_text())


def gpu_free(log: Path, timeout_s: float = 120) -> None:
    """Wait until the GPU's memory is back (the next side's engines check what is free at their start)."""
    if not shutil.which("nvidia-smi"):
        return
    t0 = time.monotonic()
    while True:
        used = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True).stdout.split()[0])
        if used < 2048 or time.monotonic() - t0 > timeout_s:
            with open(log, "a") as f:
                f.write(f"\nGPU memory used {used} MiB, {time.monotonic() - t0:.1f}s after the side ended\n")
            return
        time.sleep(1)


def compare(ours: dict, theirs: dict) -> dict:
    report: dict = {"vllm_start_s": round(theirs["start_s"], 1)}
    for name in ("eq-chat", "eq-raw"):
        ids = list(theirs[name]["texts"])
        report[name] = {"rows": len(ids),
                        "qbatch_equal_vllm": sum(ours[name]["texts"][i] == theirs[name]["texts"][i] for i in ids),
                        "vllm_reversed_equal_vllm": sum(theirs[name + "-reversed"]["texts"][i] == theirs[name]["texts"][i]
                                                        for i in ids),
                        "qbatch_reasoning_nonempty": sum(bool(v) for v in ours[name]["reasoning"].values()),
                        "qbatch_engine_choice": ours[name]["engine_choice"]}
    rate = {side: {name: run["output_tokens"] / max(run["generate_s"], 1e-9) for name, run in runs.items()
                   if isinstance(run, dict)} for side, runs in (("qbatch", ours), ("vllm", theirs))}
    report["json_raw"] = {"qbatch_json_out_tok_s": round(rate["qbatch"]["json-raw"]),
                          "qbatch_free_out_tok_s": round(rate["qbatch"]["json-free"]),
                          "vllm_json_out_tok_s": round(rate["vllm"]["json-raw"]),
                          "vllm_free_out_tok_s": round(rate["vllm"]["json-free"]),
                          "json_over_free": round(rate["qbatch"]["json-raw"] / rate["qbatch"]["json-free"], 3),
                          "qbatch_over_vllm_json": round(rate["qbatch"]["json-raw"] / rate["vllm"]["json-raw"], 3),
                          "qbatch_generate_s": round(ours["json-raw"]["generate_s"], 2),
                          "vllm_generate_s": round(theirs["json-raw"]["generate_s"], 2)}
    report["valid_of_stop_of_rows"] = {name: {"qbatch": share_valid(ours[name]), "vllm": share_valid(theirs[name]),
                                              "qbatch_flags": ours[name]["flags"]}
                                       for name in ("json-raw", "json-chat-off", "json-chat-on")}
    return report


def main() -> None:
    args = sys.argv[1:]
    if args[0] == "--side":  # one side, in a process of its own
        side, model, work = args[1], args[2], Path(args[3])
        got = vllm_side(model, work) if side == "vllm" else qbatch_side(model, work)
        (work / f"{side}.json").write_text(json.dumps(got))
        return
    reuse, model_only = "--reuse-vllm" in args, "--model-only" in args
    args = [a for a in args if a not in ("--reuse-vllm", "--model-only")]
    count = int(args[args.index("--rows") + 1]) if "--rows" in args else 1024
    args = [a for i, a in enumerate(args) if a != "--rows" and (i == 0 or args[i - 1] != "--rows")]
    dummy, work = Path(args[0]), Path(args[1])
    work.mkdir(parents=True, exist_ok=True)
    model = work / "qwen3-random"
    t0 = time.monotonic()
    make_model(dummy, model)
    if model_only:  # only the random-weight checkpoint, for other benchmarks to load
        return
    (work / "rows.json").write_text(json.dumps(rows_of(Path(args[2]) if len(args) > 2 else None, count)))
    report: dict = {"model_s": round(time.monotonic() - t0, 1)}
    t0 = time.monotonic()
    theirs = json.loads((work / "vllm.json").read_text()) if reuse and (work / "vllm.json").exists() \
        else run_side("vllm", model, work)
    report["vllm_side_s"] = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()
    ours = run_side("qbatch", model, work)
    report["qbatch_side_s"] = round(time.monotonic() - t0, 1)
    report.update(compare(ours, theirs))
    (work / "answers.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1), flush=True)


if __name__ == "__main__":
    main()
