"""Where one vLLM engine's GPU time goes, kernel by kernel (issue #34: targets 1 and 7).

`python benchmarks/kernel_profile.py MODEL SHAPE [LLM kwargs as JSON]`: one engine in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so torch's profiler sees its kernels), random token-id prompts,
`ignore_eos`, one warm-up `generate()` and then one under torch.profiler. Prints the wall time, the
kernels' summed GPU time (its share of the wall: how busy the GPU was), and the kernels that took
the most, grouped by family. SHAPE: `decode` (1,024 rows, 400 prompt tokens, 256 out: a decode-bound
batch of one engine) or `prefill` (2,048 rows, 800 prompt tokens, 1 out).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import defaultdict

SHAPES = {"decode": (1024, 400, 256), "prefill": (2048, 800, 1)}
# Kernel families by words in their names, first match wins: attention includes writing the KV cache.
FAMILIES = (("attention", ("flash", "attn", "fmha", "reshape_and_cache")),
            ("gemm", ("gemm", "cutlass", "sm90", "nvjet", "cublas", "matmul")),
            ("sampling", ("softmax", "sort", "topk", "exponential", "argmax", "log_softmax", "multinomial", "gumbel")),
            ("norm", ("rms", "norm")), ("rope", ("rotary", "rope")), ("activation", ("silu", "act_and_mul", "gelu")),
            ("copy/other elementwise", ("copy", "elementwise", "fill", "index", "cat")))


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, keys in FAMILIES if any(k in low for k in keys)), "other")


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    model, shape = sys.argv[1], sys.argv[2]
    kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    rows, prompt, out = SHAPES[shape]
    llm = LLM(model=model, **kwargs)
    rng, vocab = random.Random(0), llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": [rng.randrange(1000, vocab - 1000) for _ in range(prompt)]} for _ in range(rows)]
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    llm.generate(prompts[:64], params, use_tqdm=False)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    started = time.monotonic()
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.monotonic() - started
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.self_device_time_total for e in kernels) / 1e6
    by_family: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_family[family(e.key)] += e.self_device_time_total / 1e6
    print(json.dumps({"shape": shape, "rows": rows, "prompt": prompt, "out": out, "kwargs": kwargs,
                      "wall_s": round(wall, 2), "kernel_s": round(gpu, 2), "gpu_busy": round(gpu / wall, 3) if wall else None,
                      "families_s": {k: round(v, 2) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])}}))
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:18]:
        print(f"{e.self_device_time_total / 1e6:8.3f} s {e.count:8d}x  {family(e.key):12s} {e.key[:110]}")


if __name__ == "__main__":
    main()
