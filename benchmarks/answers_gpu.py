"""Issue #52 on a GPU: qbatch's answers against vLLM's own, and JSON-schema rows with the constraint in force.

    python benchmarks/answers_gpu.py DUMMY_MODEL_DIR WORK_DIR [PROMPTS_JSONL]

1. A Qwen3-0.6B of real random weights (transformers' init, seed 0): vLLM's dummy loader fills each
   model class's parameters its own way, so qbatch's fused Qwen3 class and vLLM's own would not even
   hold the same weights.
2. Equivalence, greedy: the same rows (MT-bench turns; chat template thinking off, and raw prompts)
   through `qbatch run` at its defaults (its fused class, two engines, MPS where the GPU has it) and
   through vLLM's own `LLM.chat`/`LLM.generate` at vLLM's defaults (vLLM's class, one engine). The
   share of rows whose text is equal, and, as the control, vLLM against itself with the rows in
   reverse order (another batch composition: bf16 results depend on it).
3. JSON extraction (~600 tokens of text in, a small object out): qbatch JSON-schema rows against the
   same rows unconstrained, and against raw vLLM's constrained rows at vLLM's defaults (output tok/s,
   generate time from the engine log's summary); the share of rows finished by `stop` that parse and
   validate, raw and with the chat template (thinking off and on).
Each engine runs in a process of its own, one after the other (one GPU). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"customer": {"type": "string", "maxLength": 40},
                                           "amount": {"type": "number"}, "refund": {"type": "boolean"}},
          "required": ["customer", "amount", "refund"], "additionalProperties": False}
MAX_TOKENS = 48
JSON_ROWS = 2048


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
        if name != "config.json":
            shutil.copy(dummy / name, out / name)


def vllm_reference(model: str, rows: list[dict], mode: str, out: Path, *, reverse: bool = False,
                   schema: bool = False, thinking: bool | None = False) -> dict:
    """vLLM's own LLM at its defaults, in a process of its own: texts by id, and its generate time."""
    script = f"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
if __name__ == "__main__":
    rows = json.load(open({str(out / 'rows.json')!r}))
    if {reverse}: rows = rows[::-1]
    llm = LLM(model={model!r})
    so = StructuredOutputsParams(json={json.dumps(SCHEMA)!r}) if {schema} else None
    sp = SamplingParams(temperature=0, max_tokens={MAX_TOKENS}, structured_outputs=so)
    t0 = time.monotonic()
    if {mode!r} == "raw":
        outs = llm.generate([r["prompt"] for r in rows], sp, use_tqdm=False)
    else:
        kw = {{}} if {thinking!r} is None else {{"chat_template_kwargs": {{"enable_thinking": {thinking!r}}}}}
        outs = llm.chat([[{{"role": "user", "content": r["prompt"]}}] for r in rows], sp, use_tqdm=False, **kw)
    wall = time.monotonic() - t0
    result = {{"generate_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
              "texts": {{r["id"]: o.outputs[0].text for r, o in zip(rows, outs)}},
              "finish": {{r["id"]: o.outputs[0].finish_reason for r, o in zip(rows, outs)}}}}
    json.dump(result, open({str(out / 'vllm.json')!r}, "w"))
"""
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows))
    (out / "ref.py").write_text(script)
    with open(out / "vllm.log", "w") as log:
        subprocess.run([sys.executable, str(out / "ref.py")], check=True, stdout=log, stderr=log)
    return json.loads((out / "vllm.json").read_text())


def qbatch_run(model: str, rows: list[dict], out: Path, *flags: str) -> dict:
    """`qbatch run` at its defaults: texts by id, and its summary (stats.json)."""
    import polars as pl

    out.mkdir(parents=True, exist_ok=True)
    data = out / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "qbatch.cli", "run", str(data), "-o", str(out / "o"), "--model", model,
                    "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--progress", "none", *flags],
                   check=False, stdout=open(out / "stdout.txt", "w"), stderr=open(out / "stderr.txt", "w"))
    wall = time.monotonic() - t0
    stats = json.loads((out / "o" / "stats.json").read_text())
    df = pl.read_parquet(out / "o" / "results.parquet")
    return {"wall_s": wall, "stats": stats, "texts": dict(zip(df["id"], df["text"])),
            "reasoning": dict(zip(df["id"], df["reasoning"])), "finish": dict(zip(df["id"], df["finish_reason"])),
            "flags": dict(zip(df["id"], df["flag"])) if "flag" in df.columns else {}}


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return False
    types = {"customer": str, "amount": (int, float), "refund": bool}
    return (isinstance(value, dict) and set(value) == set(types) and len(value["customer"]) <= 40
            and all(isinstance(value[k], t) and not (t != bool and isinstance(value[k], bool)) for k, t in types.items()))


def share_valid(texts: dict, finish: dict) -> tuple[int, int]:
    stopped = [rid for rid, why in finish.items() if why == "stop"]
    return sum(valid(texts[rid]) for rid in stopped), len(stopped)


def main() -> None:
    dummy, work = Path(sys.argv[1]), Path(sys.argv[2])
    prompts_file = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    model = work / "qwen3-random"
    t0 = time.monotonic()
    make_model(dummy, model)
    report: dict = {"model_s": round(time.monotonic() - t0, 1)}
    turns = [t for line in prompts_file.read_text().splitlines() for t in json.loads(line)["turns"]] \
        if prompts_file else [f"Question {i}: explain topic {i}." for i in range(160)]
    rows = [{"id": f"r{i}", "prompt": turns[i % len(turns)] + ("" if i < len(turns) else f" (variant {i})")}
            for i in range(1024)]

    # 2. equivalence, greedy: chat thinking off, and raw
    for mode, flags in (("chat", ("--no-thinking",)), ("raw", ("--raw",))):
        ours = qbatch_run(str(model), rows, work / f"eq-{mode}-qbatch", *flags)
        theirs = vllm_reference(str(model), rows, mode, work / f"eq-{mode}-vllm")
        control = vllm_reference(str(model), rows, mode, work / f"eq-{mode}-control", reverse=True)
        same = sum(ours["texts"][r["id"]] == theirs["texts"][r["id"]] for r in rows)
        same_control = sum(control["texts"][r["id"]] == theirs["texts"][r["id"]] for r in rows)
        report[f"equal_{mode}"] = {"rows": len(rows), "qbatch_equal_vllm": same, "vllm_reversed_equal_vllm": same_control,
                                   "qbatch_plan": ours["stats"].get("engine_choice")}
        print(json.dumps(report), flush=True)

    # 3. JSON extraction with the constraint in force
    rng = random.Random(0)
    words = " ".join(turns).split()
    docs = [{"id": f"j{i}", "prompt": "Extract the customer's name, the amount and whether a refund is asked, as JSON.\n\n"
             + " ".join(rng.choice(words) for _ in range(rng.randint(300, 600)))} for i in range(JSON_ROWS)]
    schema_file = work / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    free = qbatch_run(str(model), docs, work / "json-free", "--raw")
    ours = qbatch_run(str(model), docs, work / "json-qbatch", "--raw", "--json-schema", str(schema_file))
    theirs = vllm_reference(str(model), docs, "raw", work / "json-vllm", schema=True)
    report["json_raw"] = {
        "qbatch_json_out_tok_s": ours["stats"]["output_tok_s"], "qbatch_free_out_tok_s": free["stats"]["output_tok_s"],
        "vllm_json_out_tok_s": round(theirs["output_tokens"] / theirs["generate_s"], 1),
        "qbatch_json_generate_s": ours["stats"]["generate_s"], "vllm_json_generate_s": theirs["generate_s"],
        "qbatch_valid_of_stop": share_valid(ours["texts"], ours["finish"]),
        "vllm_valid_of_stop": share_valid(theirs["texts"], theirs["finish"]),
        "qbatch_flags": ours["stats"].get("flags")}
    print(json.dumps(report), flush=True)
    for name, flags in (("off", ("--no-thinking",)), ("on", ())):
        got = qbatch_run(str(model), docs[:512], work / f"json-chat-{name}", "--json-schema", str(schema_file), *flags)
        report[f"json_chat_thinking_{name}"] = {"valid_of_stop": share_valid(got["texts"], got["finish"]),
                                               "flags": got["stats"].get("flags"),
                                               "out_tok_s": got["stats"]["output_tok_s"]}
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
