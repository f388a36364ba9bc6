"""qbatch's once-per-chunk decoding gives exactly the text vLLM's incremental detokenizer gives."""

from __future__ import annotations

import random
import time

import pytest

from qbatch.engines.detokenize import FinalDecoder


def vllm_text(tokenizer, prompt: list[int], output: list[int], *, stopped: bool) -> str:
    """What vLLM's own FastIncrementalDetokenizer makes of a finished row (the reference)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    request = EngineCoreRequest(request_id="r", prompt_token_ids=prompt, mm_features=None,
                                sampling_params=SamplingParams(max_tokens=len(output)), pooling_params=None,
                                arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None)
    detokenizer = FastIncrementalDetokenizer(tokenizer, request)
    for i in range(0, len(output), 3):  # vLLM hands over one or more new tokens per step
        last = i + 3 >= len(output)
        detokenizer.update(output[i:i + 3], stop_terminated=stopped and last)
    return detokenizer.get_next_output_text(finished=True, delta=False)


@pytest.fixture(scope="module")
def tokenizer(bundled_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model)


def rows(tokenizer, n: int) -> list[tuple[list[int], list[int]]]:
    """Prompts and outputs that stress decoding: random ids (bytes that are no whole character),
    special tokens, and multilingual text cut at random token boundaries."""
    rng = random.Random(7)
    vocab = tokenizer.vocab_size
    specials = tokenizer.all_special_ids
    text = "Grüße, 世界! naïve café — 🙂🚀 ok. " * 4
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for i in range(n):
        prompt = tokenizer.encode(f"<|im_start|>user\nrow {i}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        if i % 3 == 0:
            output = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        elif i % 3 == 1:
            start = rng.randrange(len(ids))
            output = ids[start:start + rng.randint(1, 30)]
        else:
            output = [rng.choice(specials + ids) for _ in range(rng.randint(1, 20))]
        if i % 5 == 0:
            prompt = prompt + ids[:rng.randint(1, 9)]  # ends inside a character now and then (vLLM then repeats it)
        out.append((prompt, output))
    return out


def test_batched_decoding_equals_vllms_incremental_text(tokenizer):
    decoder = FinalDecoder.for_tokenizer(tokenizer)
    assert decoder is not None
    cases = rows(tokenizer, 600)
    texts = decoder.decode([p for p, _ in cases], [o for _, o in cases])
    for (prompt, output), text in zip(cases, texts, strict=True):
        assert text == vllm_text(tokenizer, prompt, output, stopped=False), (prompt[-8:], output)
    assert any("\ufffd" in t for t in texts) and any("世界" in t for t in texts)  # the hard cases did occur


def test_stop_token_is_left_out_as_vllm_does(tokenizer):
    decoder = FinalDecoder.for_tokenizer(tokenizer)
    prompt = tokenizer.encode("hello", add_special_tokens=False)
    output = tokenizer.encode(" the end.", add_special_tokens=False) + [tokenizer.encode(" again")[0]]
    assert decoder.decode([prompt], [output[:-1]]) == [vllm_text(tokenizer, prompt, output, stopped=True)]


def test_no_rust_tokenizer_leaves_decoding_to_vllm():
    assert FinalDecoder.for_tokenizer(object()) is None


def test_an_engine_without_a_tokenizer_leaves_decoding_to_vllm():
    class NoTokenizer:
        def get_tokenizer(self):
            raise ValueError("tokenizer was not initialized")

    assert FinalDecoder.for_llm(NoTokenizer()) is None
