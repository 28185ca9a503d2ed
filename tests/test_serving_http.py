"""The server for real: uvicorn in a thread on a free port, a real Postgres store, the `openai` client and raw HTTP.

The model is a tiny random llama over the real SmolLM2 tokenizer (its chat template included), so every
request runs in milliseconds and greedy outputs can be checked against `model.generate` of the prompt alone.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from crest.config import IngestOptions
from crest.ingest.pipeline import ingest
from crest.serving.app import StopText, create_app
from crest.serving.engine import Engine
from crest.serving.scheduler import Scheduler
from tests.fix_corpus import write_jsonl
from tests.fix_proxy import Proxy
from tests.fix_serving import Running, flat_cost, start

pytest_plugins = ["tests.fix_corpus", "tests.fix_serving"]

CORPUS = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 20


@pytest.fixture
def served(
    db_dsn: str, tiny_served: Any, smollm2_tokenizer: Any, smollm2_gguf: Path, tmp_path: Path
) -> Iterator[Running]:
    corpus = tmp_path / "code.jsonl"
    corpus.write_text(json.dumps({"text": CORPUS}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="code", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=1000))
    running = start(tiny_served, smollm2_tokenizer, db_dsn, store="code", max_batch=4)
    yield running
    running.stop()


def test_completions_are_exact_streamed_or_not(
    served: Running, db_dsn: str, smollm2_gguf: Path, tmp_path: Path
) -> None:
    client = served.client()
    prompt = "def add(a, b):\n    return"
    ids = served.tokenizer.encode(prompt, add_special_tokens=False)
    want = served.tokenizer.decode(served.reference(ids, 12), skip_special_tokens=True)
    # a store holding this very continuation: its drafts are verified and accepted, and change no token
    echo = write_jsonl(tmp_path / "echo.jsonl", [{"text": prompt + want}] * 3)
    ingest([str(echo)], store="echo", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=1000))
    from_store = {"store": "echo", "drafter": "crest"}
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=from_store)
    assert whole.choices[0].text == want
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == len(ids) + 12
    assert 6 <= drafted(whole.usage)[0] <= 12  # store drafts verified, counted in crest's own usage object
    details = whole.usage.completion_tokens_details  # OpenAI's prediction counts: no prediction was sent
    assert details is not None and details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=from_store,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert drafted(chunks[-1].usage)[0] >= 6
    streamed = chunks[-1].usage.completion_tokens_details
    assert streamed is not None and streamed.accepted_prediction_tokens == 0
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)  # store `code`
    assert plain.choices[0].text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_and_not(served: Running) -> None:
    client = served.client()
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add two numbers."}]
    ids = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = served.tokenizer.decode(served.reference(ids, 10), skip_special_tokens=True)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert whole.choices[0].message.content == want
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_per_request_store_and_prediction(served: Running, db_dsn: str, smollm2_gguf: Path, tmp_path: Path) -> None:
    client = served.client()
    prompt = "def sub(a, b):\n"
    plain = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"drafter": "none"}
    )
    text = plain.choices[0].text
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    # a store other than the server's (`code`) holding this very continuation: the request's store drafts it
    echo = write_jsonl(tmp_path / "echo.jsonl", [{"text": prompt + text}] * 3)
    ingest([str(echo)], store="echo", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=1000))
    stored = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"store": "echo", "drafter": "crest"}
    )
    assert stored.choices[0].text == text
    assert stored.usage is not None and stored.usage.completion_tokens == 16
    assert (stored.usage.model_extra or {})["crest"]["forward_passes"] <= 16 // 2, stored.usage  # store drafts taken
    predicted = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"prediction": {"type": "content", "content": text}, "drafter": "none"},
    )
    assert predicted.choices[0].text == text
    assert predicted.usage is not None and predicted.usage.completion_tokens_details is not None
    assert (predicted.usage.completion_tokens_details.accepted_prediction_tokens or 0) >= 8  # the prediction was right
    assert drafted(predicted.usage)[0] == predicted.usage.completion_tokens_details.accepted_prediction_tokens


def drafted(usage: Any) -> tuple[int, int]:
    """Return the draft tokens accepted and rejected, from crest's own object in a response's usage."""
    own = (usage.model_extra or {})["crest"]
    return int(own["accepted_draft_tokens"]), int(own["rejected_draft_tokens"])


def test_openais_boolean_store_is_ignored_and_crest_store_names_the_store(served: Running) -> None:
    client = served.client()
    messages: Any = [{"role": "user", "content": "Add two numbers."}]
    for keep in (False, True):  # OpenAI's `store`: whether OpenAI keeps the completion; nothing to do here
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0, store=keep)
        assert reply.choices[0].message.content is not None
    ask: Any = {"model": "tiny", "prompt": "def add(a, b):\n    return", "max_tokens": 12, "temperature": 0}
    by_new_name = client.completions.create(**ask, extra_body={"crest_store": "code", "drafter": "crest"})
    assert by_new_name.usage is not None and sum(drafted(by_new_name.usage)) > 0  # drafted from store `code`
    by_old_name = client.completions.create(**ask, extra_body={"store": "code", "drafter": "crest"})  # still read
    assert by_old_name.choices[0].text == by_new_name.choices[0].text
    assert by_old_name.usage is not None and drafted(by_old_name.usage) == drafted(by_new_name.usage)


@pytest.mark.parametrize(
    ("body", "status", "match"),
    [
        ({"prompt": "x", "n": 2}, 400, "n > 1"),
        ({"prompt": "x", "logprobs": 2}, 400, "logprobs"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ({"prompt": "x", "store": "nosuch"}, 404, "nosuch"),
        ({"prompt": "x", "store": "bad name"}, 400, "name"),
        ({"prompt": "x", "crest_store": "nosuch"}, 404, "nosuch"),
        ({"prompt": "x", "crest_store": "code", "store": "other"}, 400, "differ"),
        ({"prompt": "x", "store": 3}, 400, "store"),
        ({"prompt": "x", "drafter": "rest"}, 400, "drafter"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "stop": [""]}, 400, "stop"),
        ({"prompt": "x", "seed": -1}, 400, "seed"),
        ({"prompt": [70000]}, 400, "vocabulary"),
    ],
    ids=[
        "n",
        "logprobs",
        "wrong-type",
        "unknown-field",
        "unknown-store",
        "bad-store-name",
        "unknown-crest-store",
        "two-store-names",
        "store-not-bool-or-name",
        "rest",
        "temperature",
        "stop",
        "seed",
        "out-of-vocab",
    ],
)
def test_bad_requests_get_openai_errors(served: Running, body: dict[str, Any], status: int, match: str) -> None:
    r = httpx.post(f"{served.url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["type"]


def test_seeded_sampling_repeats(served: Running) -> None:
    client = served.client()
    texts = [
        client.completions.create(model="tiny", prompt="def", max_tokens=12, temperature=0.9, seed=seed).choices[0].text
        for seed in (7, 7, 8)
    ]
    assert texts[0] == texts[1] != texts[2]


def test_bad_json_and_tools(served: Running) -> None:
    bad = b'{"prompt": "x",\n "max_tokens": }'
    r = httpx.post(f"{served.url}/v1/completions", content=bad, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("request body is not valid JSON: Expecting value at line 2 column 16"), message
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = httpx.post(
        f"{served.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    )
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]


def test_models_health_metrics(served: Running) -> None:
    assert served.client().models.list().data[0].id == "tiny"
    assert httpx.get(f"{served.url}/health").json()["status"] == "ok"
    served.client().completions.create(model="tiny", prompt="def", max_tokens=3, temperature=0)
    text = httpx.get(f"{served.url}/metrics").text
    for name in ("crest_requests_total", "crest_completion_tokens_total", "crest_accepted_tokens_per_step_bucket",
                 "crest_draft_seconds_bucket", "crest_queue_depth", "crest_batch_size"):  # fmt: skip
        assert name in text
    assert 'crest_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert "crest_completion_tokens_total 3.0" in text  # the scheduler reports to the app's metrics
    counters = store_counters(text)  # the store's lookups by outcome, read from the SDK at the scrape
    assert counters["lookups"] >= 1 and counters["timeouts"] == counters["errors"] == 0, counters
    served.client().completions.create(model="tiny", prompt="def", max_tokens=3, temperature=0)
    assert store_counters(httpx.get(f"{served.url}/metrics").text)["lookups"] > counters["lookups"]


def store_counters(text: str, store: str = "code") -> dict[str, float]:
    """Return a store's lookup counters from a /metrics page: lookups, hits, timeouts, errors."""
    names = {"lookups": "lookups", "cache_hits": "hits", "lookup_timeouts": "timeouts", "lookup_errors": "errors"}
    found = re.findall(r'^crest_store_(\w+)_total\{store="' + store + r'"\} ([0-9.e+]+)$', text, re.MULTILINE)
    return {names[name]: float(value) for name, value in found if name in names}


def test_a_model_that_is_not_served_is_openais_404(served: Running) -> None:
    client = served.client()
    with pytest.raises(openai.NotFoundError) as found:
        client.completions.create(model="gpt-4o", prompt="def", max_tokens=2)
    assert found.value.body == {  # what OpenAI answers, which clients rely on
        "message": "The model 'gpt-4o' does not exist: this server serves 'tiny' (GET /v1/models)",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert client.models.retrieve("tiny").id == "tiny"
    r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "def", "max_tokens": 2})  # no model: the served one
    assert r.status_code == 200 and r.json()["model"] == "tiny", r.text


def test_disconnect_frees_the_row(served: Running) -> None:
    body = {"prompt": "def", "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body) as r:
        next(r.iter_lines())
        assert served.engine.scheduler.active == 1
    deadline = time.monotonic() + 10
    while served.engine.scheduler.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert served.engine.scheduler.active == 0


def test_api_key_and_queue_bound(tiny_served: Any, smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    running = start(tiny_served, smollm2_tokenizer, None, api_key="sekrit", max_batch=1, max_queue=0)
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200
        r = httpx.get(f"{running.url}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            running.client("wrong").models.list()
        assert running.client("sekrit").models.list().data
        gate = threading.Event()
        step = running.engine.scheduler.step
        monkeypatch.setattr(running.engine.scheduler, "step", lambda: gate.wait() and step())
        first = threading.Thread(
            target=lambda: running.client("sekrit").completions.create(model="tiny", prompt="a", max_tokens=2)
        )
        first.start()
        deadline = time.monotonic() + 60
        while running.engine.scheduler.queued == 0:
            assert time.monotonic() < deadline and first.is_alive(), "the first request never queued"
            time.sleep(0.01)
        r = httpx.post(
            f"{running.url}/v1/completions", json={"prompt": "b"}, headers={"Authorization": "Bearer sekrit"}
        )
        assert (
            r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        )
        gate.set()
        first.join(30)
    finally:
        running.stop()


def test_database_down_gives_the_same_output(tiny_served: Any, smollm2_tokenizer: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    running = start(
        tiny_served, smollm2_tokenizer, f"postgresql://u@127.0.0.1:{port}/db?connect_timeout=1", store="code"
    )
    try:
        client = running.client()
        a = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=10, temperature=0)
        b = client.completions.create(
            model="tiny", prompt="def add(a, b):", max_tokens=10, temperature=0, extra_body={"drafter": "none"}
        )
        assert a.choices[0].text == b.choices[0].text
        zeros = dict.fromkeys(("lookups", "hits", "timeouts", "errors"), 0.0)
        assert store_counters(httpx.get(f"{running.url}/metrics").text) == zeros  # not connected: nothing counted
    finally:
        running.stop()


@pytest.mark.parametrize(
    ("pieces", "stops", "sent"),
    [
        (["ab", "cS", "TOPx"], ["STOP"], "abc"),
        (["abS", "Tx"], ["STOP"], "abSTx"),
        (["a", "b"], [], "ab"),
        (["xEN", "D"], ["END", "N"], "xE"),
        (["xEND"], ["N", "END"], "x"),
    ],
    ids=["split-stop", "false-start", "no-stops", "first-completed", "earliest-in-a-piece"],
)
def test_stop_text_cuts_at_the_first_stop(pieces: list[str], stops: list[str], sent: str) -> None:
    cut = StopText(stops)
    assert "".join(cut.feed(p) for p in pieces) + cut.flush() == sent


SERVER_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.fix_models import IdTokenizer, tiny_model
from crest.decoding.sizing import CostModel
from crest.serving.app import create_app
from crest.serving.engine import Engine
from crest.serving.scheduler import Scheduler
torch.set_num_threads(1)
model = tiny_model("llama", vocab=64, max_positions=4096)
sched = Scheduler(model, IdTokenizer(), cost=CostModel([1, 64], [1.0, 1.0]))
engine = Engine(sched, IdTokenizer(), model_name="tiny", drafter="none")
from crest.serving.server import run_app
try:
    run_app(create_app(engine), host="127.0.0.1", port={port}, log_level="warning")
except KeyboardInterrupt:
    sys.exit(130)  # what crest's main makes of it
"""


@pytest.mark.parametrize(("signame", "code"), [("SIGTERM", 0), ("SIGINT", 130)], ids=["sigterm", "ctrl-c"])
def test_sigterm_drains_in_flight_requests(tmp_path: Path, signame: str, code: int) -> None:
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT.format(root=root, port=port)], stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240  # a fresh interpreter importing torch: over 60 s at load 20 on 2 cores
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            time.sleep(0.1)
        body = {"prompt": [1, 2, 3], "max_tokens": 600, "temperature": 0, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line and not lines:
                    proc.send_signal(getattr(signal, signame))
                lines.append(line)
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        last = json.loads([x for x in lines if x.startswith("data: {")][-1][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == code  # drained, then exit 0 (SIGTERM) or 130 (Ctrl-C), not killed by the signal
        assert b"Traceback" not in (proc.stderr.read() if proc.stderr else b"")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
        if proc.stderr is not None:
            proc.stderr.close()


def test_database_down_at_start_then_back_then_down(
    db_dsn: str, tiny_served: Any, smollm2_tokenizer: Any, smollm2_gguf: Path, tmp_path: Path
) -> None:
    import glob

    import psycopg

    corpus = tmp_path / "code.jsonl"
    corpus.write_text(json.dumps({"text": CORPUS}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="code", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=1000))
    info = psycopg.conninfo.conninfo_to_dict(db_dsn)
    proxy = Proxy(glob.glob(f"{info['host']}/.s.PGSQL.*")[0])
    dsn = f"postgresql://{info['user']}@127.0.0.1:{proxy.port}/{info['dbname']}"
    sched = Scheduler(tiny_served, smollm2_tokenizer.hf, cost=flat_cost())
    engine = Engine(sched, smollm2_tokenizer.hf, model_name="t", store="code", drafter="crest", dsn=dsn,
                    fingerprint=smollm2_tokenizer.fingerprint, retry_interval=0.2)  # fmt: skip
    running = Running(create_app(engine), engine, tiny_served, smollm2_tokenizer.hf)
    try:
        client = running.client()
        prompt = "def add(a, b):\n    return a + b\n\ndef"
        want = client.completions.create(
            model="t", prompt=prompt, max_tokens=12, temperature=0, extra_body={"drafter": "none"}
        )

        def ask() -> tuple[str, int]:
            got = client.completions.create(model="t", prompt=prompt, max_tokens=12, temperature=0)
            assert got.usage is not None and got.usage.completion_tokens_details is not None
            return got.choices[0].text, sum(drafted(got.usage))

        assert ask() == (want.choices[0].text, 0)  # down at start: no store drafts, same output
        proxy.up()
        deadline = time.monotonic() + 20
        while (found := ask())[1] == 0:  # back: drafts once the background retry connected
            assert found[0] == want.choices[0].text
            assert time.monotonic() < deadline, "the store never came back"
            time.sleep(0.1)
        assert found[0] == want.choices[0].text
        proxy.down()
        engine.store("code").store.clear_cache()
        assert ask()[0] == want.choices[0].text  # down again: same output
    finally:
        running.stop()
        proxy.down()
