"""The warm-up batch an engine runs inside its start (`--warm-up`), before it takes a job's rows.

A fresh engine may pay one-time costs in its first steps (suspected, not measured: docs/benchmarks.md): under
CUDA MPS a client's first allocations go through the server, CUDA loads a kernel at its first launch, a
captured CUDA graph's first replay may be slower than the next. A job's first rows pay them unless something
ran first (the bench warms its engines: the first run on fresh engines was slower than the next). The batch
is shaped like a real decode batch: as many rows as the engine runs at once, all prefilled in one step (their
prompts fit one step's token budget) at several prompt lengths, then decoded together for a few tokens while
half the rows end at each step, so the decode steps go through the batch sizes the engine captured graphs for,
from every row at once down to one. It goes through `LLM.generate`, not the engine's run(): qbatch's counters
(telemetry, stats, results) never see it; its blocks are dropped from vLLM's prefix cache after it, so the
job's cached share is its own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from qbatch.log import log

# The prompt lengths, as quarters of the mean length one step's budget allows: several lengths, as a real
# batch has, whose mean is that (so the whole batch is prefilled in one step).
LENGTH_QUARTERS = (1, 3, 5, 7)
# The rows' token ids from here: one id a row, each its own, so no row finds another's prompt in the prefix cache.
FIRST_TOKEN_ID = 1000


@dataclass(frozen=True)
class WarmUpBatch:
    """The warm-up's rows: each one's prompt (token ids) and output tokens."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


def warm_up_batch(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, vocab_size: int,
                  kv_cache_tokens: int | None = None, block_size: int = 16) -> WarmUpBatch:
    """The batch for an engine of these limits: max_num_seqs rows (fewer where one step's token budget or
    the KV cache, `kv_cache_tokens` in blocks of `block_size`, holds fewer), prompts of LENGTH_QUARTERS of
    the budget's mean, each shorter than max_model_len with its output, and output_tokens(rows) each."""
    num_rows = max(1, min(max_num_seqs, max_num_batched_tokens))
    mean = max_num_batched_tokens // num_rows
    most = max_output_tokens(num_rows)
    longest = max(1, max_model_len - most - 1)  # vLLM wants prompt + output under max_model_len
    lengths = [max(1, min(longest, mean * q // 4)) for q in LENGTH_QUARTERS]
    if kv_cache_tokens:  # each row holds the blocks of its longest case at once (a batch that fits runs at once)
        blocks = math.ceil((max(lengths) + most) / block_size)
        num_rows = max(1, min(num_rows, kv_cache_tokens // block_size // blocks))
    first = min(FIRST_TOKEN_ID, vocab_size // 2)  # a tiny vocabulary: its upper half
    return WarmUpBatch(
        prompts=[[first + i % (vocab_size - first)] * lengths[i % len(lengths)] for i in range(num_rows)],
        max_tokens=output_tokens(num_rows),
    )


def output_tokens(num_rows: int) -> list[int]:
    """Each row's output tokens, by rank: the prefill step gives every row its first token, the first decode
    step runs every row, and each decode step after it half as many (the row of rank i runs while
    num_rows // (i + 1) >= 2**step), down to one row: the decode batch sizes from the largest to the smallest."""
    return [1 + (num_rows // (i + 1)).bit_length() for i in range(num_rows)]


def max_output_tokens(num_rows: int) -> int:
    """The longest row's output tokens (rank 0's): two more than log2 of the rows, rounded down."""
    return 1 + num_rows.bit_length()


def run_warm_up(llm: Any) -> float:
    """Run the warm-up batch through vLLM's `llm`, then clear its prefix cache; the seconds it took (logged)."""
    from vllm import SamplingParams

    config = llm.llm_engine.vllm_config
    cache = config.cache_config
    blocks = getattr(cache, "num_gpu_blocks", None)
    block_size = getattr(cache, "block_size", None) or 16
    batch = warm_up_batch(config.scheduler_config.max_num_seqs, config.scheduler_config.max_num_batched_tokens,
                          config.model_config.max_model_len, config.model_config.get_vocab_size(),
                          blocks * block_size if blocks else None, block_size)
    # the model's generation_config sampling, as a job's rows get by default: the sampler's kernels a job runs
    model_sampling = llm.get_default_sampling_params()
    params = [SamplingParams.from_optional(temperature=model_sampling.temperature, top_p=model_sampling.top_p,
                                           top_k=model_sampling.top_k, min_p=model_sampling.min_p, max_tokens=n,
                                           ignore_eos=True, detokenize=False)
              for n in batch.max_tokens]
    started = time.monotonic()
    llm.generate([{"prompt_token_ids": ids} for ids in batch.prompts], params, use_tqdm=False)
    if not llm.reset_prefix_cache():  # every warm-up row has finished: vLLM refuses only with rows running
        log.warning("warm-up: vLLM kept its prefix cache; the job's first rows may find the warm-up's blocks")
    seconds = time.monotonic() - started
    log.info(f"engine warm-up: {len(batch.prompts)} rows, {batch.num_prompt_tokens} prompt tokens, "
             f"{sum(batch.max_tokens)} output tokens, in {seconds:.2f}s (not counted in the job)")
    return seconds
