"""Continuous batching on the real SmolLM2: 8+ concurrent requests of different lengths joining at different steps.

Every row's greedy output must equal `model.generate` of that prompt alone, token for token; on a mismatch the
message shows the target's top-2 logit gap at the first differing token (a float32 rounding flip shows a gap
near 1e-5; a bug does not).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from crest.decoding.sizing import CostModel
from crest.drafters import PromptDrafter
from crest.serving.scheduler import Request, Scheduler
from tests.fix_serving import drive

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The capital of France is",
    "Write a haiku about the sea.",
    "import numpy as np\n\ndef mean(xs):\n    return",
    "List three colours: red, green,",
    "Q: What is 12 times 12?\nA:",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Once upon a time",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
]


@pytest.mark.slow
def test_smollm2_concurrent_requests_equal_generate_alone(smollm2_model: Any) -> None:
    model, tokenizer = smollm2_model.model, smollm2_model.tokenizer
    prompts = [smollm2_model.encode_prompt(p, chat=i % 3 == 2) for i, p in enumerate(PROMPTS)]
    lengths = [8 + 5 * i for i in range(len(prompts))]
    sched = Scheduler(model, tokenizer, max_batch=6, cost=CostModel([1, 64], [1.0, 1.0]))
    joins = [
        (3 * i, Request(p, max_tokens=n, drafter=PromptDrafter()))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    outcomes = drive(sched, joins)
    for prompt, n, outcome in zip(prompts, lengths, outcomes, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        got = outcome.result.output_token_ids
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            with torch.no_grad():
                logits = model(torch.tensor([prompt + want[:at]])).logits[0, -1]
            top = torch.topk(logits, 2).values
            pytest.fail(f"row differs at token {at}: top-2 logit gap there {float(top[0] - top[1]):.3g}")
    assert sum(o.accepted_draft_tokens for o in outcomes) > 0


@pytest.mark.slow
def test_smollm2_served_over_http_to_concurrent_clients(
    smollm2_model: Any, smollm2_gguf: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from crest.decoding.tokenizer import load_tokenizer
    from crest.serving.app import create_app
    from crest.serving.engine import Engine
    from tests.fix_serving import Running

    model, tokenizer = smollm2_model.model, smollm2_model.tokenizer
    sched = Scheduler(model, tokenizer, max_batch=8, cost=CostModel([1, 64], [1.0, 1.0]))
    prompts = [smollm2_model.encode_prompt(p) for p in PROMPTS]
    lengths = [6 + 4 * i for i in range(len(prompts))]
    texts: list[str | None] = [None] * len(prompts)
    # each request is sent once the batch is decoding the ones before it (the scheduler holds its next step until
    # the request is queued): it joins a running batch; `joined` counts the rows already there at each admission
    go = [threading.Event() for _ in prompts]
    go[0].set()
    joined: list[int] = []
    admit, step = sched._admit, sched.step

    def counted_admit() -> None:
        before = sched.active
        admit()
        joined.extend([before] * max(0, sched.active - before))

    def paced_step() -> bool:
        worked = step()
        waiting = next((e for e in go if not e.is_set()), None)
        if worked and waiting is not None:
            waiting.set()
            deadline = time.monotonic() + 60
            while sched.queued == 0 and time.monotonic() < deadline:  # the client thread posts it
                time.sleep(0.005)
        return worked

    monkeypatch.setattr(sched, "_admit", counted_admit)
    monkeypatch.setattr(sched, "step", paced_step)
    engine = Engine(sched, tokenizer, model_name="smollm2", drafter="prompt",
                    fingerprint=load_tokenizer(str(smollm2_gguf)).fingerprint)  # fmt: skip
    running = Running(create_app(engine), engine, model, tokenizer)

    def ask(i: int) -> None:
        assert go[i].wait(300)
        reply = running.client().completions.create(
            model="smollm2", prompt=prompts[i], max_tokens=lengths[i], temperature=0
        )
        texts[i] = reply.choices[0].text

    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 480  # within the test's 600 s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), f"requests unanswered after 480 s: {texts}"
    finally:
        running.stop()
    assert len(joined) == len(prompts) and sum(n > 0 for n in joined) >= len(prompts) // 2, joined  # joined a batch
    for prompt, n, text in zip(prompts, lengths, texts, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        assert text == tokenizer.decode(want[0, len(prompt) :], skip_special_tokens=True)
