"""The requests `crest bench proposer` follows: held-out files, chat-templated texts, or `crest answer`'s answers.

Each request is a (prompt, output) pair of token lists: the stand-in runner feeds the prompt and verifies every
chain against the output, so the texts must be what the model would write. `file_requests` cuts source files
(prompt, then the next tokens); `chat_requests` splits chat-templated texts after the assistant's header, as a
self corpus holds them (`crest answer --chat`); `completion_requests` splits `crest answer`'s lines at their
prompt. `load_requests` picks among them and says clearly what it could not read.
"""

from __future__ import annotations

import glob
import gzip
import json
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from crest.errors import ConfigError

Requests = list[tuple[list[int], list[int]]]


def load_requests(
    inputs: str | None,
    tokenizer: Any,
    *,
    chat: bool = False,
    limit: int = 16,
    prompt_tokens: int = 100,
    output_tokens: int = 128,
) -> Requests:
    """Return up to `limit` requests from `inputs`: a glob of files (default: the standard library's subpackage
    modules), or a JSONL file of `crest answer` lines (chat-templated ones with `chat`)."""

    def encode(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    answers = inputs is not None and inputs.endswith((".jsonl", ".jsonl.gz"))
    if chat and (inputs is None or not answers):
        raise ConfigError("--chat needs --inputs FILE.jsonl (chat-templated texts)")
    if not answers:
        pattern = inputs or sysconfig.get_path("stdlib") + "/*/*.py"
        found = file_requests(sorted(glob.glob(pattern)), encode, limit=limit, prompt_tokens=prompt_tokens,
                              output_tokens=output_tokens)  # fmt: skip
        if not found:
            raise ConfigError(f"--inputs: no file of {pattern!r} holds {prompt_tokens + output_tokens} tokens")
        return found
    assert inputs is not None
    try:
        if chat:
            found = chat_requests(chat_texts(inputs), encode, assistant_header(tokenizer), limit=limit,
                                  output_tokens=output_tokens)  # fmt: skip
        else:
            found = completion_requests(jsonl_lines(inputs), encode, limit=limit, output_tokens=output_tokens)
    except (OSError, ValueError, EOFError) as exc:  # a missing, unreadable or malformed file (JSON, gzip)
        raise ConfigError(f"--inputs: cannot read {inputs!r}: {exc}") from exc
    if not found:
        kind = "chat text with an assistant header" if chat else '{"text", "prompt"} line with an answer'
        raise ConfigError(f"--inputs: {inputs!r} holds no {kind}")
    return found


def file_requests(
    paths: Iterable[str], encode: Callable[[str], list[int]], *, limit: int, prompt_tokens: int, output_tokens: int
) -> Requests:
    """Return up to `limit` requests of files long enough: each file's first tokens, then the next ones."""
    need, found = prompt_tokens + output_tokens, []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            tokens = encode(f.read())[:need]
        if len(tokens) == need:
            found.append((tokens[:prompt_tokens], tokens[prompt_tokens:]))
        if len(found) == limit:
            break
    return found


def assistant_header(tokenizer: Any) -> str:
    """Return the text a chat template puts before the assistant's answer (`<|im_start|>assistant\n` for SmolLM2)."""
    turn = [{"role": "user", "content": "?"}]
    asked = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    plain = tokenizer.apply_chat_template(turn, add_generation_prompt=False, tokenize=False)
    if not asked.startswith(plain) or asked == plain:
        raise ValueError("the chat template puts no header before the answer")
    return str(asked[len(plain) :])


def jsonl_lines(path: str) -> Iterator[dict[str, Any]]:
    """Yield each line of a JSONL file, gzipped or not, as a dict."""
    with gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                found = json.loads(line)
                yield found if isinstance(found, dict) else {}


def chat_texts(path: str) -> Iterator[str]:
    """Yield the `text` of each line of a JSONL file, gzipped or not (a self corpus: `crest answer --chat`)."""
    for line in jsonl_lines(path):
        yield str(line.get("text", ""))


def completion_requests(
    lines: Iterable[dict[str, Any]], encode: Callable[[str], list[int]], *, limit: int, output_tokens: int
) -> Requests:
    """Return up to `limit` (prompt, output) token lists of `crest answer` lines: `{"text": prompt + answer,
    "prompt": prompt}`, the prompt as the model read it and the answer its first `output_tokens` tokens (lines
    without a prompt the text starts with, or with an empty answer, are skipped)."""
    found = []
    for line in lines:
        text, prompt = str(line.get("text", "")), line.get("prompt")
        if not isinstance(prompt, str) or not prompt or not text.startswith(prompt):
            continue
        output = encode(text[len(prompt) :])[:output_tokens]
        if output:
            found.append((encode(prompt), output))
        if len(found) == limit:
            break
    return found


def chat_requests(
    texts: Iterable[str], encode: Callable[[str], list[int]], header: str, *, limit: int, output_tokens: int
) -> Requests:
    """Return up to `limit` (prompt, output) token lists of one-answer chat texts, split after the last `header`.

    The prompt is tokenized as the server reads it (the templated turns through the header), the answer as the
    model wrote it (its first `output_tokens` tokens); texts without the header or with an empty answer are skipped.
    """
    found = []
    for text in texts:
        prompt, sep, answer = text.rpartition(header)
        if not sep:
            continue
        output = encode(answer)[:output_tokens]
        if output:
            found.append((encode(prompt + sep), output))
        if len(found) == limit:
            break
    return found
