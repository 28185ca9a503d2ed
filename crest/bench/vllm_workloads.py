"""The workloads of `crest bench vllm`: requests whose answers repeat text served before, built without a server.

- `humaneval_requests`: HumanEval prompts as plain completions (held out from a stdlib store);
- `edit_requests` and `second_turns`: chat requests to rewrite a standard-library function given in the prompt, and
  a second turn that sends back the first turn and its answer (the answer repeats earlier text);
- `chat_requests`: MT-Bench first turns as one-turn chats, drafted from a store warmed with the model's own answers
  to other users' questions (`self_corpus_lines`: the self corpus without its records of the measured questions);
- `fleet_schedule`: which replica serves each request of a fleet run, each prompt served by one replica and right
  after by the other.
"""

from __future__ import annotations

import ast
import gzip
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

EDIT_ASK = "Rewrite this Python function with type hints. Answer with the code only.\n\n```python\n{source}\n```"
SECOND_ASK = "Now add a docstring to that function and write the whole function again."


@dataclass(frozen=True)
class Request:
    """One request: a completion `prompt`, or a chat of `messages` (role, content) when it has any."""

    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = field(default=())

    @property
    def chat(self) -> bool:
        return bool(self.messages)


def humaneval_requests(prompts: Sequence[str]) -> list[Request]:
    """Return each prompt as a plain completion."""
    return [Request(prompt=p) for p in prompts]


def stdlib_functions(
    paths: Iterable[Path], *, count: int, min_lines: int = 8, max_lines: int = 30, seed: int = 0
) -> list[str]:
    """Return `count` seeded-random top-level functions of `min_lines`..`max_lines` lines from Python files."""
    found: list[str] = []
    for path in sorted(paths):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                source = ast.get_source_segment(text, node)
                if min_lines <= lines <= max_lines and source and "\t" not in source:
                    found.append(source)
    return random.Random(seed).sample(found, min(count, len(found)))


def edit_requests(functions: Sequence[str]) -> list[Request]:
    """Return one chat request per function: rewrite it with type hints."""
    return [Request(messages=(("user", EDIT_ASK.format(source=f)),)) for f in functions]


def second_turns(first: Sequence[Request], answers: Sequence[str | None]) -> list[Request]:
    """Return each first turn followed by its answer and a second question that makes the model repeat it."""
    return [
        Request(messages=(*r.messages, ("assistant", a or ""), ("user", SECOND_ASK)))
        for r, a in zip(first, answers, strict=True)
    ]


def chat_requests(questions: Sequence[str]) -> list[Request]:
    """Return each question as a one-turn chat (the server applies the model's chat template)."""
    return [Request(messages=(("user", q),)) for q in questions]


def self_corpus_lines(path: Path, *, leave_out: Sequence[str] = ()) -> Iterator[str]:
    """Yield the JSONL lines of a (gzipped) self corpus whose text holds none of the `leave_out` questions."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip() and not any(q in json.loads(line).get("text", "") for q in leave_out):
                yield line if line.endswith("\n") else line + "\n"


def fleet_schedule(prompts: int, *, replicas: int = 2) -> list[list[tuple[int, int]]]:
    """Return per client worker its (prompt, replica) requests in order: prompt i on replica i % R, then the next.

    Worker w takes prompts w, w + R, ...; each prompt is served by every replica in turn, starting with a
    different one per prompt, so one replica serves it and the other right after.
    """
    return [
        [(i, (i + step) % replicas) for i in range(w, prompts, replicas) for step in range(replicas)]
        for w in range(min(replicas, prompts))
    ]


def same_texts(texts: Sequence[str | None], reference: Sequence[str | None] | None) -> int | None:
    """Return how many texts equal the reference's (None without a reference of the same length)."""
    if reference is None or len(reference) != len(texts):
        return None
    return sum(a is not None and a == b for a, b in zip(texts, reference, strict=True))
